"""LoRA adapters and their optimizer state as files: the PEFT adapter dir and optimizer.safetensors
that init, sft and update publish, and the teacher with an SFT adapter merged in.

Publishing an update is split in two (docs/architecture.md, "The update and its publishing"): the
caller takes a snapshot right after the optimizer step (`host_copy`: one device -> host copy per
dtype, queued, never waited for on the caller's thread), and the publish thread writes it
(`write_adapter`, `save_tensors`). The files are safetensors byte for byte as
`safetensors.torch.save` writes them (tests/weights/test_adapters.py compares), but written from the
snapshot's own memory: safetensors' serialiser copies every byte into one Python bytes object while
holding the interpreter lock, stalling every other thread for the whole copy (the 360M student's
adapter and moments are ~100 MB), where writing the buffers as they are releases it
(docs/performance.md).
`store.write_bytes` hashes the bytes as it writes them: sealing does not read them back."""
from __future__ import annotations

import json
import struct
import weakref
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from . import lora, models
from ..run.config import LoraCfg, OptimCfg
from ..run.store import write_bytes

# safetensors' dtype names, in the order its serialiser lays tensors out: by dtype (this rank,
# highest first), then by name
SAFETENSORS_DTYPES = {torch.bool: ("BOOL", 0), torch.uint8: ("U8", 1), torch.int8: ("I8", 2),
                      torch.int16: ("I16", 3), torch.float16: ("F16", 4), torch.bfloat16: ("BF16", 5),
                      torch.int32: ("I32", 6), torch.float32: ("F32", 7), torch.float64: ("F64", 8),
                      torch.int64: ("I64", 9)}


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """A safetensors file of host tensors: the header as safetensors writes it, then each tensor's
    bytes straight from its memory (no serialised copy; see the module docstring)."""
    order = sorted(tensors, key=lambda n: (-SAFETENSORS_DTYPES[tensors[n].dtype][1], n))
    header: dict = {"__metadata__": metadata} if metadata else {}
    off = 0
    for n in order:
        t = tensors[n]
        nb = t.numel() * t.element_size()
        header[n] = {"dtype": SAFETENSORS_DTYPES[t.dtype][0], "shape": list(t.shape),
                     "data_offsets": [off, off + nb]}
        off += nb
    h = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    h += b" " * (-len(h) % 8)  # the data starts 8-byte aligned
    write_bytes(path, struct.pack("<Q", len(h)), h, *_raw_bytes([tensors[n] for n in order]))


def _raw_bytes(tensors: list[torch.Tensor]) -> list:
    """The tensors' bytes one after another, as numpy views of their memory: one per run of tensors
    that lie back to back in one storage (`host_copy` lays each dtype's tensors out in the order
    `save_tensors` writes them), so the file takes a write per run, not per tensor. A torch call per
    tensor (`reshape`, `view`), and a write and a hash update per tensor, each give the interpreter
    lock up and wait to get it back, up to the switch interval when another thread runs Python (as
    the read-ahead thread does while policy 0 is published; numpy's slices and torch's metadata
    reads keep the lock): benchmarks/switch_interval.py --what publish."""
    whole: dict = {}  # storage (address, bytes), or a tensor taken apart (its id) -> its bytes (numpy uint8)
    runs: list[list] = []  # [key into whole, start, end]
    for t in tensors:
        if t.numel() == 0:  # (no bytes)
            continue
        if t.device.type != "cpu" or not t.is_contiguous():
            key, start = id(t), 0
            whole[key] = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        else:
            st = t.untyped_storage()
            key, start = (st.data_ptr(), st.nbytes()), t.storage_offset() * t.element_size()
            if key not in whole:
                whole[key] = torch.empty(0, dtype=torch.uint8).set_(st).numpy()
        end = start + t.numel() * t.element_size()
        if runs and runs[-1][0] == key and runs[-1][2] == start:
            runs[-1][2] = end
        else:
            runs.append([key, start, end])
    return [whole[key][start:end] for key, start, end in runs]


def host_copy(tensors: dict[str, torch.Tensor]) -> Callable[[], dict[str, torch.Tensor]]:
    """Snapshot `tensors` now; the returned function waits for the copy and gives host tensors
    (views into one buffer per dtype: hundreds of small LoRA tensors would each be a copy).

    CUDA tensors: the snapshot is one flattening copy per dtype on the current stream, in order with
    the kernels that made the values (an optimizer step may change the originals right after: the
    snapshot is private); it goes to pinned host memory on a side stream, and only the caller of
    the returned function waits for that copy. A blocking `.cpu()` would wait for everything queued
    before it and crawl through pageable memory.
    Host tensors (on CPU runs, and AdamW's step count on CUDA ones) are copied right away.
    Both ways are a few torch calls per dtype, not per tensor (`_raw_bytes` says why); what is left
    per tensor is freeing its view once the caller drops it. The returned function holds the
    buffers and their views, not `tensors`."""
    def groups(names) -> dict[torch.dtype, list[str]]:  # names by name in each: safetensors' order, so
        out: dict[torch.dtype, list[str]] = {}  # a file's tensors of one dtype are one run of its buffer
        for n in sorted(names):
            out.setdefault(tensors[n].dtype, []).append(n)
        return out

    def flat(names) -> torch.Tensor:  # [n], a copy (one tensor alone would come back as a view of it)
        with torch.no_grad():  # (parameters in: no autograd record of the copy)
            ts = [tensors[n] for n in names]
            return _flatten_dense_tensors(ts) if len(ts) > 1 else ts[0].reshape(-1).clone()

    def views(names, buf) -> tuple:  # (names, views into buf shaped as the tensors): metadata only
        return names, _unflatten_dense_tensors(buf, [tensors[n] for n in names])

    on_dev = groups(n for n, t in tensors.items() if t.device.type == "cuda")
    on_host = groups(n for n, t in tensors.items() if t.device.type != "cuda")
    parts = [views(names, flat(names)) for names in on_host.values()]
    done = None
    if on_dev:
        snaps = [(names, flat(names)) for names in on_dev.values()]
        made = torch.cuda.Event()
        made.record()
        side, done = torch.cuda.Stream(snaps[0][1].device), torch.cuda.Event()
        side.wait_event(made)
        with torch.cuda.stream(side):
            for names, snap in snaps:
                pinned = torch.empty(snap.shape, dtype=snap.dtype, pin_memory=True)
                pinned.copy_(snap, non_blocking=True)
                snap.record_stream(side)  # (its memory is reused only after the side stream read it)
                parts.append(views(names, pinned))  # (the values land before `result` waits for `done`)
        done.record(side)

    def result() -> dict[str, torch.Tensor]:
        if done is not None:
            done.synchronize()
        return {n: v for names, vs in parts for n, v in zip(names, vs)}

    return result


_STATE_KEYS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def adapter_state(student) -> dict[str, torch.Tensor]:
    """The adapter's tensors under the names PEFT saves them (what PeftModel.from_pretrained reads).
    PEFT's get_peft_model_state_dict walks every module (thousands in a LoRA'd 360M model); the names
    do not change while the model lives, so the walk is done once per model and later calls read the
    same parameters under the same names. They are the live parameters, not detached views (a torch
    call each): `host_copy` snapshots them without recording autograd."""
    keys = _STATE_KEYS.get(student)
    if keys is None:
        from peft import get_peft_model_state_dict

        # PEFT's "auto" looks up the base's config.json by name (a stable name here, not a path) to see
        # whether the embeddings changed, and warns when it cannot; they only can when LoRA targets
        # them. Not targeted: False is what "auto" resolves to, without the lookup (same tensors).
        tm = student.peft_config["default"].target_modules
        embeddings = isinstance(tm, str) or any(m in ("embed_tokens", "lm_head") for m in tm)  # (a regex: let PEFT decide)
        state = get_peft_model_state_dict(student, save_embedding_layers="auto" if embeddings else False)
        params = {(p.data_ptr(), p.shape): p for p in student.parameters()}
        if not all((v.data_ptr(), v.shape) in params for v in state.values()):
            return state  # (not every tensor is a parameter as it is: take PEFT's walk every time)
        keys = _STATE_KEYS[student] = {k: params[(v.data_ptr(), v.shape)] for k, v in state.items()}
    return dict(keys)


def optimizer_state(opt, named) -> dict[str, torch.Tensor]:
    """AdamW's moments per parameter name and the step count (`__step__`), as optimizer.safetensors holds them."""
    out, step = {}, None
    for name, p in named:
        st = opt.state.get(p)
        if st:
            out[f"{name}.exp_avg"] = st["exp_avg"]
            out[f"{name}.exp_avg_sq"] = st["exp_avg_sq"]
            step = st["step"]
    if step is not None:
        # a copy, where it lives (fused AdamW's on the device: no sync here; host_copy brings it over)
        out["__step__"] = step.detach().float().reshape(()).clone() if torch.is_tensor(step) else torch.tensor(float(step))
    return out


def make_optimizer(o: OptimCfg, student, state_file: Path | None):
    """AdamW over the LoRA parameters (o: OptimCfg), state restored from optimizer.safetensors when given."""
    named = models.trainable(student)
    dev = named[0][1].device if named else torch.device("cpu")
    # On CUDA one fused kernel steps every LoRA tensor (foreach launches several per tensor group, and
    # keeps the step counts on the host); the CPU keeps foreach, whose bytes its records hold
    fused = dev.type == "cuda"
    opt = torch.optim.AdamW([p for _, p in named], lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay, foreach=not fused, fused=fused)
    if state_file is not None and state_file.exists():
        sd = load_file(state_file, device=str(dev))
        step = sd.pop("__step__", None)
        step_dev = dev if fused else torch.device("cpu")  # fused AdamW reads its step counts on the device
        for name, p in named:
            if f"{name}.exp_avg" in sd:
                # one step tensor per parameter (a shared one is advanced once per parameter by foreach
                # AdamW: a resumed run would then differ from an uninterrupted one)
                opt.state[p] = {"step": (step.float().clone() if step is not None else torch.tensor(0.0)).to(step_dev),
                                "exp_avg": sd[f"{name}.exp_avg"], "exp_avg_sq": sd[f"{name}.exp_avg_sq"]}
    return opt, named


def save_optimizer(opt, named, path: Path) -> None:
    save_tensors(path, host_copy(optimizer_state(opt, named))())


def write_adapter(student, state: dict[str, torch.Tensor], out: Path, base_name: str) -> None:
    """A standard PEFT adapter dir (adapter_model.safetensors + adapter_config.json, what
    PeftModel.from_pretrained reads) from `adapter_state`'s tensors on the host; the base path is a
    stable name so files are byte-reproducible."""
    pc = student.peft_config["default"]
    pc.base_model_name_or_path = base_name
    out.mkdir(parents=True, exist_ok=True)
    save_tensors(out / "adapter_model.safetensors", dict(sorted(state.items())), metadata={"format": "pt"})
    pc.save_pretrained(out)
    # PEFT keeps target_modules as a set: its JSON order follows string hashing, which changes per
    # process. Sorted, the file is byte-reproducible.
    cfg_file = out / "adapter_config.json"
    acfg = json.loads(cfg_file.read_text())
    if isinstance(acfg.get("target_modules"), list):
        acfg["target_modules"] = sorted(acfg["target_modules"])
    acfg["inference_mode"] = True  # what PEFT's own save_pretrained records for a saved adapter
    cfg_file.write_text(json.dumps(acfg, indent=2, sort_keys=True) + "\n")


def save_adapter(student, out: Path, base_name: str) -> None:
    write_adapter(student, host_copy(adapter_state(student))(), out, base_name)


def merged(teacher, adapter_dir: Path, lcfg: LoraCfg):
    """The frozen teacher with a published adapter merged in (a plain model again)."""
    model = lora.add(teacher, lcfg, 0)  # init values are overwritten by the load
    lora.load(model, adapter_dir)
    out = model.merge_and_unload()
    out.eval()
    out.requires_grad_(False)
    return out
