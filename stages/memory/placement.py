"""Memory at run time: the budget, which placements a config can run, model placement between phases,
and the OOM retry of a phase.

Placements (`memory.placement`, chosen weight-free by `opd plan`, stages/memory/plan.py):
- resident: both roles stay on the device for the whole loop (nothing moves).
- swap: the idle role waits in host memory: the teacher during rollout/update, the student (its
  LoRA, gradients, AdamW moments and rollout engine) during score. Only unquantized roles can move (bitsandbytes
  weights are not movable), so a quantized role is refused before anything loads.
- shared_backbone: the teacher *is* the student's base with the student's LoRA disabled (PEFT's
  `disable_adapter()`), one copy of the weights; only when both roles name the same base model.

None of this is part of any stage identity: every placement computes the same numbers.
"""
from __future__ import annotations

import os
from typing import Callable

import torch

from ..engine import graphs
from ..weights import models
from ..errors import UserError

GIB = 2**30


# ---- the budget ----

def device_total(device_type: str) -> tuple[int, str]:
    """(bytes, description) of the memory a run on `device_type` can use: the CUDA device's total,
    or the host's RAM on CPU."""
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise UserError("key 'memory.vram_gib' = null: no CUDA device here to detect the budget from; "
                            "set memory.vram_gib (e.g. memory.vram_gib=16) to plan for a CUDA card")
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return int(props.total_memory), f"detected: {props.name}"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "detected: host RAM"


def limit_process(vram_gib: float | None, device: torch.device) -> None:
    """With an explicit `memory.vram_gib` on a larger CUDA card, make the caching allocator refuse
    past that budget, so a 16 GiB plan is tested as a 16 GiB card (real OOMs, real retries)."""
    if vram_gib is None or device.type != "cuda":
        return
    # "cuda" names no index; the allocator's fraction is per device and wants one
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, vram_gib * GIB / total), index)


# ---- which placements a config can run (weight-free: `opd plan` and the session ask here) ----

BASE_KEYS = ("name", "revision", "init", "keep_layers", "quant", "double_quant", "trust_remote_code", "tokenizer")


def refusal(cfg, placement: str) -> str | None:
    """Why `placement` cannot run this config (None: it can). Weight-free."""
    if placement in ("swap", "shared_backbone") and cfg.memory.merge_in_place:
        return (f"memory.placement={placement} with memory.merge_in_place=true: "
                + ("swap moves the student to host memory and back, which would undo its weights' fused layout"
                   if placement == "swap" else "the teacher reads the student's base while a rollout has "
                   "the LoRA merged into it") + "; use memory.placement=resident or memory.merge_in_place=false")
    if placement == "swap":
        for role in ("student", "teacher"):
            q = getattr(cfg, role).quant
            if q != "none":
                return (f"memory.placement=swap: {role}.quant={q} is a bitsandbytes-quantized role whose weights "
                        f"cannot move to host memory and back; use memory.placement=resident (or {role}.quant=none)")
    if placement == "shared_backbone":
        diff = [k for k in BASE_KEYS if getattr(cfg.student, k, None) != getattr(cfg.teacher, k, None)]
        if diff:
            d = ", ".join(f"student.{k}={getattr(cfg.student, k)!r} vs teacher.{k}={getattr(cfg.teacher, k)!r}"
                          for k in diff)
            return (f"memory.placement=shared_backbone needs the teacher to be the student's base, but the bases "
                    f"differ ({d}); use memory.placement=resident or swap")
        if getattr(cfg, "teacher_mode", "raw") == "protocol_sft":
            return ("memory.placement=shared_backbone: teacher_mode=protocol_sft gives the teacher its own adapter; "
                    "a shared backbone here only disables the student's; use memory.placement=resident or swap")
    return None


def check_placement(cfg, placement: str) -> None:
    why = refusal(cfg, placement)
    if why:
        raise UserError(why)


# ---- shared backbone: the student's base with its LoRA disabled ----

def _unwrap(v, peft):
    if isinstance(v, torch.nn.Module):
        if hasattr(v, "base_layer") and hasattr(v, "lora_A"):
            return v.base_layer  # a LoRA-wrapped layer: its plain base (same weight tensors, no copy)
        return _View(v, peft)
    return v


class _View:
    """A read-only view of a module of the student's base: attribute access unwraps LoRA layers
    (so the rollout engine reads plain base weights) and calls run under `disable_adapter()` (so
    a transformers forward is the base's). Nothing is copied; the student is untouched."""

    def __init__(self, module, peft):
        object.__setattr__(self, "_m", module)
        object.__setattr__(self, "_peft", peft)

    def __call__(self, *args, **kwargs):
        with self._peft.disable_adapter():
            return self._m(*args, **kwargs)

    def __getattr__(self, name):
        return _unwrap(getattr(self._m, name), self._peft)

    def __iter__(self):
        return (_unwrap(v, self._peft) for v in self._m)

    def __len__(self):
        return len(self._m)

    def __getitem__(self, i):
        return _unwrap(self._m[i], self._peft)


class SharedTeacher:
    """The teacher under placement shared_backbone. lmhead and the sampler reach models through
    `get_base_model()` (or call them, for the transformers fallback): both paths see the base."""

    def __init__(self, peft_model):
        self.peft = peft_model
        self._view = _View(peft_model.get_base_model(), peft_model)  # one view: it holds the teacher's graphs

    def get_base_model(self):
        return self._view

    def __call__(self, *args, **kwargs):
        with self.peft.disable_adapter():
            return self.peft(*args, **kwargs)

    def parameters(self):
        return self.peft.parameters()

    @property
    def config(self):
        return self.peft.get_base_model().config


def shared_teacher(resident) -> SharedTeacher:
    """Refuse unless student and teacher materialised to the very same model (same digest)."""
    if resident.prepared["student"] != resident.prepared["teacher"]:
        raise UserError(f"memory.placement=shared_backbone: student model/{resident.prepared['student'][:12]} and "
                        f"teacher model/{resident.prepared['teacher'][:12]} differ; the teacher must be the student's "
                        "base (same name, revision, init, keep_layers); use memory.placement=resident or swap")
    return SharedTeacher(resident.student())


# ---- swap: the idle role waits in host memory (Resident.activate decides when) ----

def move(model, device: torch.device) -> None:
    """Move a role (parameters, buffers and gradients: Module.to carries .grad) to `device`."""
    target = model.peft if isinstance(model, SharedTeacher) else model
    graphs.drop(models.base_of(target))  # captured at the old addresses: freed (pools too) before the move
    target.to(device)


def move_moments(opt, device: torch.device) -> None:
    """AdamW moments (the resident optimizer between updates) travel with the student."""
    for st in opt.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            if key in st:
                st[key] = st[key].to(device)


# ---- CUDA OOM in score/update: halve the position chunk and retry ----

def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError)


def chunk_retry(sess, stage: str, k: int, state: dict, attempt: Callable[[int], object]):
    """Run `attempt(chunk)`; on a CUDA out-of-memory error halve the position chunk (not below
    `memory.chunk_floor`) and run it again. The chunk that worked is kept for the rest of the
    session (later steps start there) and recorded with the retries in `state` (state.json).

    The stage digest keeps the configured `train.chunk`: chunking changes only the order of float
    sums, so a retried step publishes what the configured chunk would, up to rounding."""
    chunk = sess.chunk_sizes.get(stage, sess.cfg.train.chunk)
    floor = min(sess.cfg.memory.chunk_floor, sess.cfg.train.chunk)
    tried = []
    while True:
        failed = None
        try:
            out = attempt(chunk)
        except Exception as e:  # noqa: BLE001  only OOM is handled; everything else re-raises below
            if not is_oom(e):
                raise
            failed = str(e).splitlines()[0][:160]
        if failed is None:
            break
        # the except block has ended: the traceback's frames (and their tensors) are released
        tried.append(chunk)
        alloc = torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else 0.0
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if chunk <= floor:
            hint = " or runtime.cuda_graphs=false (a captured forward's pool keeps its memory)" \
                if sess.device.type == "cuda" and sess.cfg.runtime.cuda_graphs else ""
            raise UserError(
                f"{stage} step {k}: CUDA out of memory at position chunk {chunk} (memory.chunk_floor = {floor}) after "
                f"{len(tried)} attempts (chunks {', '.join(map(str, tried))}); peak allocated {alloc:.2f} GiB; "
                f"the chunk is not what fills memory: run `opd plan` and try memory.placement=swap, "
                f"student.quant=nf4 / teacher.quant=nf4, a smaller rollout.batch_size{hint} ({failed})")
        chunk = max(floor, chunk // 2)
    sess.chunk_sizes[stage] = chunk
    if tried or chunk != sess.cfg.train.chunk:
        state["chunk"] = chunk
        state["oom_retries"] = len(tried)
        if tried:
            state["oom_chunks"] = tried
    return out
