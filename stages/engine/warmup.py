"""CUDA's first calls, paid on a thread beside the models' loads (docs/architecture.md, "Startup").

A fresh process pays for the first call of each kind of GPU work far more than for later ones:
CUDA loads kernel modules on their first launch, cuBLAS and cuDNN pick kernels per shape (cuDNN's
attention builds a plan), Triton loads its compiled kernels, autograd starts its device thread:
seconds of the first update's main thread sat inside such first calls, the first SDPA calls,
autograd's first backward, the draw's first launch (docs/performance.md). Meanwhile the GPU is idle
for the seconds the main thread spends importing and reading the models. `start` runs that kind of work
once, on a daemon thread of its own with a stream of its own, on throwaway tensors of the run's
shapes: one decoder layer of each model with constant weights, through the rollout engine's
prefill and decode step (stages/engine/sampler.py's own functions), the teacher's scoring forward
and the student's training forward and backward as transformers and peft compute them (the padded
layout's boolean mask, fp32 LoRA matmuls), and an LM-head chunk's loss. Library loads, kernel modules and
autograd's thread are the process's, so the main thread finds them ready; what stays per thread
(cuDNN keeps its plans per thread) it still builds, which is cheap once the library is loaded.

Nothing it computes is kept or changes what the run computes: no random generator is used (the
main thread seeds and draws from the global ones meanwhile), every input is a constant, and
`wait` (before any phase and any CUDA graph capture, Resident.before_capture) joins it and gives its
memory back, so no capture sees another thread's device work and no phase's peak memory counts
it. A failure is reported as one warning and the run goes on without it (runtime.warmup=false:
not started; nor with memory.vram_gib set, whose budget its transient ~0.5 GiB is not planned in).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
import xxhash

from . import decoder, draw, graphs, kernels, sampler
from ..weights import lora_kernels, norms
from .sampling import Decode, Sampling

_RUNNING: list[threading.Thread] = []  # at most one: the process's warm-up, until `wait` joins it
_RESULT: dict = {}  # what it recorded (`report`)


def dims(config_json: Path) -> dict:
    """A model dir's config.json -> the shapes the warm-up uses."""
    c = json.loads(config_json.read_text())
    H, E = c["num_attention_heads"], c["hidden_size"]
    return {"E": E, "H": H, "KV": c.get("num_key_value_heads") or H, "D": c.get("head_dim") or E // H,
            "I": c["intermediate_size"], "V": c["vocab_size"], "eps": c.get("rms_norm_eps", 1e-6),
            "act": c.get("hidden_act", "silu"), "qk_norm": c.get("model_type") == "qwen3",
            "bias": bool(c.get("attention_bias", False))}


def start(student: Path, teacher: Path, *, rows: int, prompt: int, new: int, length: int, rank: int,
          sampling: Sampling, min_new: int, dtype: torch.dtype, device: torch.device, compiled: bool,
          precompile: bool, engine: bool = True, lora_kernels: bool = False) -> None:
    """Start the warm-up (CUDA only). student/teacher: the models' config.json, read by `dims` on the
    thread (prepare checked its hash; a read that fails anyway fails the warm-up, not the run); rows: the
    rollout's batch; prompt: its padded prompt length; new: new tokens; length: the teacher-forced
    forwards' padded length; rank: the LoRA's r; sampling: the rollout's (Sampling.of); min_new: the
    rollout's min_new_tokens (the draw's EOS block is compiled in or not); compiled: the engine's
    decode kernels; precompile: compile the engine's Triton kernels in child processes first (`parts`,
    `_child`); engine: the rollout samples with the engine (false: through transformers, int8 or
    dense_copy=false, whose small cards the engine's sampling weights and the children's CUDA contexts
    would crowd: neither is made); lora_kernels: the student's LoRA computes through
    stages/weights/lora_kernels.py (its kernels compile here, at the run's widths)."""
    if device.type != "cuda" or _RUNNING:
        return
    if isinstance(sampling, tuple):  # (temperature, top_p, greedy): train.warm_up's, until it passes
        sampling = Sampling(*sampling)  # Sampling.of(rollout)
    spec = {"config": str(student), "rows": rows, "prompt": prompt, "new": new, "sampling": asdict(sampling),
            "min_new": min_new, "dtype": str(dtype).removeprefix("torch."), "compiled": compiled,
            "device": device.index if device.index is not None else torch.cuda.current_device(),
            "length": length, "rank": rank, "engine": engine, "lora": lora_kernels}
    which = parts(compiled, sampling, cpus(), engine, lora_kernels) if precompile and kernels.triton is not None else ()
    # a part some earlier child compiled at these shapes, with this code, is in the caches: the thread
    # loads it below, sooner than a child's own imports and CUDA context would (a child took 5.5 to
    # 8.3 s on warm caches, docs/performance.md "The first update")
    marks = _markers(spec, which)
    warm = [part for part in which if marks[part] and marks[part].exists()]
    cold = [part for part in which if part not in warm]
    children = [_spawn({**spec, "part": part, "marker": str(marks[part] or "")}) for part in cold]
    if cold:
        _RESULT["precompile_parts"] = cold
    if warm:
        _RESULT["precompile_warm"] = warm

    def run() -> None:
        t = time.perf_counter()
        try:
            ds, dt = dims(student), dims(teacher)
            with torch.cuda.stream(torch.cuda.Stream(device)):
                _teacher_forced(dt, rows, length, 0, dtype, device, train=False)
                if not lora_kernels:
                    _teacher_forced(ds, rows, length, rank, dtype, device, train=True)
                _join_children(children)  # (their compilations in Triton's cache: the calls below load them)
                if lora_kernels:
                    _teacher_forced(ds, rows, length, rank, dtype, device, train=True, kernels=True)
                if engine:
                    _sample(_weights(ds, dtype, device), rows, prompt, new, sampling, min_new,
                            decoder.fused_layer if compiled else decoder.layer)
                torch.cuda.current_stream().synchronize()
            _RESULT["warmup_s"] = round(time.perf_counter() - t, 4)
        except Exception as e:  # noqa: BLE001  only a head start: the run pays these first calls itself
            _RESULT["warmup_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"

    th = threading.Thread(target=run, name="opd-warmup", daemon=True)
    _RUNNING.append(th)
    th.start()


def wait() -> None:
    """Join the warm-up if one runs and give its memory back: its cached blocks belong to its stream,
    so no later allocation could reuse them. A failed one says so once."""
    if not _RUNNING:
        return
    _RUNNING.pop().join()
    # its cuBLAS workspace (per handle and stream) would stay allocated for the process: cleared, as
    # Inductor's CUDA-graph trees clear them around captures (no graph exists yet: this is the first
    # join, before the run's first capture); the main thread's is made again at its next matmul
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear:
        clear()
    torch.cuda.empty_cache()
    if "warmup_error" in _RESULT:
        print(f"warning: runtime.warmup failed ({_RESULT['warmup_error']}); the first calls are paid in line",
              file=sys.stderr)


def report() -> dict:
    """What the process's warm-up recorded: {"warmup_s": seconds} or {"warmup_error": "..."} ({} if none
    ran), with its children's {"precompile_s": seconds from their start until the thread, its
    teacher-forced calls done, found them all finished (an upper bound)} or {"precompile_error":
    "..."} and {"precompile_parts": [what they compiled, `parts`]} where they ran."""
    return dict(_RESULT)


CHILD_TIMEOUT_S = 300  # children still compiling this long after the thread starts waiting are killed (the
# run compiles what is left in line)


def parts(compiled: bool, sampling: Sampling, cores: int, engine: bool = True, lora: bool = False) -> tuple[str, ...]:
    """What the precompiling children compile, one child per part (`_child`): "draw", the draw's two
    kernels (plain sampling only, draw.serves); "step", the decode step's kernels with the draw off
    (runtime.compile; the eager step launches no Triton kernel); both only where the engine samples;
    "lora", the student's LoRA kernels at the run's widths (lora: runtime.lora_kernels). Disjoint, so
    they compile side by side: on cold caches one child for both was still compiling when the engine's capture began,
    which then waited for it. A child needs a core of its own beside the main thread's, or it slows
    the imports it was meant to overlap: with fewer cores than parts + 1 the parts share one child
    ("all"), with one core no child starts (the thread compiles them, as with runtime.precompile=false)."""
    want = tuple(p for p, needed in (("draw", engine and draw.serves(sampling.greedy, sampling.top_p)),
                                     ("step", engine and compiled), ("lora", lora)) if needed)
    if cores >= len(want) + 1:
        return want
    return ("all",) if want and cores >= 2 else ()


def cpus() -> int:
    """The cores this process may run on (its affinity mask, as a container or taskset limits it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not on Linux)
        return os.cpu_count() or 1


def _markers(spec: dict, which) -> dict:
    """part -> the file a child leaves once it has compiled that part at spec's shapes (`_main`): in
    Triton's cache directory (cleared with it), named by the spec (the model's config.json by its bytes,
    not its path; not the device's index), the part, the torch and Triton versions and the bytes of the
    modules whose kernels it compiles. None for every part where the config cannot be read (the
    thread's `dims` reports it). Not keyed by the GPU, whose model this process has not asked for yet
    (CUDA is not initialised here): on a cache shared by different GPUs the thread compiles in line what
    Triton's own keys then miss."""
    triton = kernels.triton
    try:
        config = Path(spec["config"]).read_bytes()
    except OSError:
        return dict.fromkeys(which)
    knobs = getattr(triton, "knobs", None)  # (Triton before 3.4 has none: its directory is the variable's)
    cache = getattr(getattr(knobs, "cache", None), "dir", None) or os.environ.get("TRITON_CACHE_DIR") \
        or str(Path.home() / ".triton" / "cache")
    here = Path(__file__).resolve().parent
    h = xxhash.xxh64(json.dumps({**spec, "config": None, "device": None, "torch": torch.__version__,
                                 "triton": triton.__version__}, sort_keys=True).encode())
    h.update(config)
    for src in sorted([*here.glob("*.py"), here.parent / "weights" / "lora_kernels.py"]):
        h.update(src.read_bytes())
    marks = {}
    for part in which:
        hp = h.copy()
        hp.update(part.encode())
        marks[part] = Path(cache) / "opd-warmup" / hp.hexdigest()
    return marks


def _spawn(spec: dict) -> subprocess.Popen | None:
    """A child that compiles part of the rollout engine's Triton kernels (`_child`), started now. A cold
    Triton cache made the warm-up thread compile them in this process, where Triton's code generator
    (Python) holds the interpreter against the main thread's imports and its compiler runs (ptxas,
    the C launchers) one after another, and the main thread waited for it at the engine's capture
    (docs/architecture.md, "Startup"); processes of their own compile on other cores."""
    root = Path(__file__).resolve().parents[2]  # the directory holding this `stages` package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    try:
        proc = subprocess.Popen([sys.executable, "-m", "stages.engine.warmup", json.dumps(spec)], env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        _RESULT["precompile_error"] = f"{type(e).__name__}: {e}"
        return None
    proc.started = time.perf_counter()  # (for precompile_s)
    return proc


def _join_children(procs: list) -> None:
    """Wait for the children (the interpreter is free meanwhile) and record how it went: the first
    failure's last line, else the seconds from their start until this found them all finished."""
    errors, deadline = [], time.perf_counter() + CHILD_TIMEOUT_S  # (one deadline for all of them)
    for proc in procs:
        if proc is None:  # (could not be started: _spawn recorded why)
            continue
        try:
            _, err = proc.communicate(timeout=max(0.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            err = f"TimeoutExpired: still compiling after {CHILD_TIMEOUT_S} s"
        if proc.returncode != 0:
            errors.append((err.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:200])
    if errors:
        _RESULT["precompile_error"] = errors[0]
    elif procs and "precompile_error" not in _RESULT:
        _RESULT["precompile_s"] = round(time.perf_counter() - procs[0].started, 4)


def _child(spec: dict) -> bool:
    """In a child: the engine's prefill and decode step at the run's shapes, one layer of constant
    weights (`parts`). part "draw": through the eager layer (no Triton kernel but the draw's); part
    "step": with the draw's kernels off (draw.ON, this process's own) and the layer the engine will
    take (sampler.decode_layer: the Triton kernels, or the compiled layer past kernels.MAX_ROWS rows,
    Inductor's cache then filled too); part "lora": the student's training forward and backward of one
    layer through the LoRA kernels; part "all": the step's layer with the draw on, and the LoRA kernels
    where the run takes them. What it compiles lands in the on-disk caches the parent reads; nothing
    else is kept. True where all of it is in Triton's cache (not where the layer is Inductor's, whose
    cache is another directory, under /tmp by default: no marker then, `_main`)."""
    d, dtype = dims(Path(spec["config"])), getattr(torch, spec["dtype"])
    device = torch.device("cuda", spec["device"])
    torch.cuda.set_device(device)
    if spec["part"] == "lora" or spec["part"] == "all" and spec.get("lora"):
        _teacher_forced(d, spec["rows"], spec["length"], spec["rank"], dtype, device, train=True, kernels=True)
        if spec["part"] == "lora" or not spec.get("engine", True):
            torch.cuda.synchronize(device)
            return True
    W = _weights(d, dtype, device)
    if spec["part"] == "step":
        draw.ON = False
    layer = decoder.layer if spec["part"] == "draw" else sampler.decode_layer(W, spec["rows"], spec["compiled"])
    _sample(W, spec["rows"], spec["prompt"], spec["new"], Sampling(**spec["sampling"]), spec["min_new"], layer)
    torch.cuda.synchronize(device)
    return layer in (decoder.layer, decoder.fused_layer)


def _main(spec: dict) -> None:
    """The child's body: compile its part (`_child`), then leave the part's marker (`_markers`) where all
    it compiled is in Triton's cache, so that later runs at these shapes load it on the thread, no child."""
    if _child(spec) and spec.get("marker"):
        try:
            Path(spec["marker"]).parent.mkdir(parents=True, exist_ok=True)
            Path(spec["marker"]).touch()
        except OSError:  # (a cache Triton could write but this cannot: the next run starts the child again)
            pass


def _full(shape, value, dtype, device, grad=False):
    return torch.full(shape, value, dtype=dtype, device=device, requires_grad=grad)


def _weights(d: dict, dtype, device) -> dict:
    """One decoder layer's sampling weights as decoder.sampling_weights lays them out, constant."""
    H, KV, D, E, I, V = d["H"], d["KV"], d["D"], d["E"], d["I"], d["V"]
    w = lambda *s, v=0.02: _full(s, v, dtype, device)  # noqa: E731
    layer = {"qkv": w((H + 2 * KV) * D, E), "qkv_bias": w((H + 2 * KV) * D) if d["bias"] else None,
             "o_proj": w(E, H * D), "gate_up": w(2 * I, E), "down_proj": w(E, I), "ln1": w(E, v=1.0),
             "ln2": w(E, v=1.0), "q_norm": w(D, v=1.0) if d["qk_norm"] else None,
             "k_norm": w(D, v=1.0) if d["qk_norm"] else None}
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device=device).float() / D))
    return {"layers": [layer], "embed": w(V, E), "norm": w(E, v=1.0), "head": w(V, E), "eps": d["eps"],
            "dtype": dtype, "inv_freq": inv_freq, "rope_scale": 1.0, "n_heads": H, "n_kv": KV, "head_dim": D,
            "n_layers": 1, "act": d["act"]}


@torch.no_grad()
def _sample(W, B, P, N, sampling: Sampling, min_new, layer) -> None:
    """The engine's prefill and one decode step (sampler.prefill / sampler.step) over sampling weights
    W (`_weights`) through `layer`, the EOS blocked as min_new blocks it (the draw's kernels differ
    with and without)."""
    device = W["embed"].device
    inp = {"ids": torch.zeros(B, P, dtype=torch.long, device=device),
           "pad_len": torch.arange(B, device=device) % P, "u": _full((max(N, 2), B), 0.5, torch.float32, device)}
    how = Decode(max(N, 2), sampling, min(min_new, N), 0, 0)
    st = sampler.prefill(W, inp, how)
    sampler.step(W, st, how, layer)


def _teacher_forced(d, B, T, r, dtype, device, train: bool, kernels: bool = False) -> None:
    """One layer as transformers' Llama computes it in the padded layout (graphs.padded's boolean mask,
    kv heads repeated), LoRA as peft adds it (fp32 adapters; kernels: as stages/weights/lora_kernels.py
    does), then an LM-head chunk's log-softmax and top-k; with train, the backward too (autograd's
    device thread)."""
    H, KV, D, E, I, V = d["H"], d["KV"], d["D"], d["E"], d["I"], d["V"]
    w = lambda *s, v=0.02: _full(s, v, dtype, device)  # noqa: E731
    real = (torch.arange(T, device=device)[None] < (T - 8 * torch.arange(B, device=device))[:, None]).long()
    ids, mask = graphs.padded(torch.zeros(B, T, dtype=torch.long, device=device), real, T)  # mask [B, 1, Tb, Tb]
    T = ids.shape[1]  # (a bucket multiple: the run's forward length already is one)
    real = mask[:, 0].diagonal(dim1=-2, dim2=-1)  # [B, T] bool: the real positions

    def rms(x, weight):  # LlamaRMSNorm as the run computes it on CUDA
        return norms.rms(x, weight, d["eps"])

    def proj(x, n_out, n_in):  # base matmul + peft's LoRA branch (adapters in fp32)
        wt = w(n_out, n_in)
        if not r:
            return F.linear(x, wt)
        a, b = _full((r, n_in), 0.01, torch.float32, device, train), _full((n_out, r), 0.01, torch.float32, device, train)
        if kernels:  # (the frozen base inside, as lora_kernels.forward runs it)
            return lora_kernels.LoraLinear.apply(x, wt, None, a, b, 2.0)
        return (F.linear(x, wt) + F.linear(F.linear(x.float(), a), b) * 2.0).to(dtype)

    with torch.set_grad_enabled(train):
        x = F.embedding(ids, w(V, E))  # [B, T, E]
        if train:
            x = x.detach().requires_grad_()
        h = rms(x, w(E, v=1.0))
        q = proj(h, H * D, E).view(B, T, H, D).transpose(1, 2)  # [B, H, T, D]
        k = proj(h, KV * D, E).view(B, T, KV, D).transpose(1, 2)
        v = proj(h, KV * D, E).view(B, T, KV, D).transpose(1, 2)
        cos = sin = w(B, 1, T, D, v=0.5)
        q = q * cos + torch.cat((-q[..., D // 2:], q[..., :D // 2]), dim=-1) * sin
        k = k * cos + torch.cat((-k[..., D // 2:], k[..., :D // 2]), dim=-1) * sin
        k = k[:, :, None].expand(B, KV, H // KV, T, D).reshape(B, H, T, D)
        v = v[:, :, None].expand(B, KV, H // KV, T, D).reshape(B, H, T, D)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=D ** -0.5)
        x = x + proj(o.transpose(1, 2).reshape(B, T, H * D), E, H * D)
        h = rms(x, w(E, v=1.0))
        x = x + proj(F.silu(proj(h, I, E)) * proj(h, I, E), E, I)
        hid = rms(x, w(E, v=1.0))[real][: 256]  # [n, E]: a chunk of response positions
        logp = F.linear(hid, w(V, E)).float().log_softmax(-1)  # [n, V]
        top = logp.topk(32, dim=-1)
        if train:
            (-(top.values.exp() * top.values).sum()).backward()


if __name__ == "__main__":  # the child `_spawn` starts: python -m stages.engine.warmup SPEC_JSON
    _main(json.loads(sys.argv[1]))
