"""Teacher-forced backbone forwards on CUDA in a fixed layout, replayed from captured CUDA graphs
(docs/architecture.md, "CUDA graphs of the teacher-forced forwards").

Eager, these forwards are bound by the host: each kernel is a few microseconds of GPU work behind
Python, dispatcher and autograd: replayed, a seed-workload step launches about an eighth of the
kernels from the host that it launches with them eager (docs/performance.md).

On CUDA every teacher-forced forward (score, update, evaluate, SFT) of a Llama-family model on SDPA
attention (`layout_ok`) runs right-padded to the run's length (a multiple of BUCKET positions) with
an explicit boolean [B, 1, T, T] mask (causal, pads never attended as keys), whether a graph
replays it or not. Real positions never attend the pads (causal, right
padding), so the values are those of the unpadded forward up to the matmuls' shape-dependent
rounding. A replay launches the kernels its capture recorded; cuBLAS may choose another algorithm
under capture than eager, so which roles replay graphs is part of the CUDA digests
(identity.runtime_slice), like the layout.

Graphs are kept per (mode, train flag, batch, padded length), a few per model (least recently
used dropped), and captured again when the model's parameters moved: placement swap drops a role's
graphs when it moves (memory.move), so a swapped role pays a capture per phase and computes what a
resident one does; the shared backbone's teacher view keeps its own graphs. The training
graph (`torch.cuda.make_graphed_callables`) holds its saved activations in its own pool between
updates: the update's activation memory stays allocated while rollout and score run. Its static
buffers hold one forward's activations: a training forward's backward runs before the next training
forward of that model (as update and SFT do; a retry after an OOM replays the same graph, whose
earlier autograd graph was dropped with the failed attempt). A run pads every forward to its longest
prompt + response (Resident.forward_length), so it replays one graph per (mode, batch size).
"""
from __future__ import annotations

import gc

import torch
import torch.nn.functional as F

from ..weights.state import peek, state

# CUDA: teacher-forced forwards run right-padded to a multiple of this many positions (lengths within
# one bucket share a graph; the memory plan pads the same way)
BUCKET = 64
KEEP = 4  # graphs per model: a run's training batch, its scoring batch, evaluation's; older ones are dropped


# the layout's explicit mask is what transformers' SDPA attention takes as it is (an eager attention
# would add a boolean mask as 0/1; a sliding window would be lost): these architectures, SDPA only
LAYOUT_TYPES = {"llama", "qwen2", "qwen3"}


def bucket(n: int) -> int:
    return -(-n // BUCKET) * BUCKET


def layout_ok(base) -> bool:
    """The padded layout runs this model: a Llama-family architecture on SDPA attention, no sliding window."""
    c = base.config
    return c.model_type in LAYOUT_TYPES and getattr(c, "_attn_implementation", None) == "sdpa" \
        and not getattr(c, "use_sliding_window", False)


def padded(ids: torch.Tensor, attn: torch.Tensor, length: int = 0, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """ids/attn [B, T] (right-padded) -> ids [B, Tb] and the boolean mask [B, 1, Tb, Tb] (True = attend):
    key j is visible from query i when j <= i and j is a real token. Tb: `length` (the run's, a
    bucket multiple), or the next multiple of the bucket when T is longer."""
    B, T = ids.shape
    Tb = max(length, bucket(T))
    ids = F.pad(ids, (0, Tb - T), value=pad)
    real = F.pad(attn, (0, Tb - T)).bool()  # [B, Tb]
    causal = torch.ones(Tb, Tb, dtype=torch.bool, device=ids.device).tril_()
    return ids, (causal[None] & real[:, None, :])[:, None]  # [B, 1, Tb, Tb]


class _Backbone(torch.nn.Module):
    """The transformers backbone as a function of tensors only (what make_graphed_callables takes)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, ids, mask):
        return self.inner(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state  # [B, Tb, H]


def params_at(inner) -> tuple:
    """Where a model's parameters live: captured graphs read these addresses. Asked before every
    replay, so the module list is walked once per model (`Module.parameters()` walks the tree each
    time, several times slower for a LoRA'd model: docs/performance.md); a Parameter replaced or
    moved still shows here. A model's modules are fixed once it runs graphs (adapters are added
    before its first forward); `drop` forgets the list with the graphs."""
    st = state(inner)
    if st.modules is None:
        st.modules = list(inner.modules())
    mods = st.modules
    return tuple(p.data_ptr() for m in mods for p in m._parameters.values() if p is not None)


def _capture_inference(inner, ids, mask):
    """A no-grad forward captured once: static ids/mask in, static hidden states out."""
    ids, mask = ids.clone(), mask.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        inner(input_ids=ids, attention_mask=mask, use_cache=False)  # warm-up off the capture: cuBLAS handles
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g):
        out = inner(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state

    def run(i, m):
        ids.copy_(i)
        mask.copy_(m)
        g.replay()
        return out  # the graph's own buffer: the caller gathers from it before the next replay

    return run


def _capture_training(inner, ids, mask):
    """Forward and backward captured as a pair (make_graphed_callables): an autograd-aware callable
    whose backward replays the captured backward and hands the trainable parameters their grads."""
    # The parameters' grad accumulators are made on the capture's side stream, and every replayed
    # backward hands them grads on the training stream: torch warns (once, into the user's output)
    # of the stream wait this costs, which is intended here; off for the process once graphs exist.
    quiet = getattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", None)
    if quiet:
        quiet(False)
    # one warm-up pass, not torch's default three: it runs what is initialised lazily (cuBLAS
    # workspaces, autograd's accumulators) before the capture, and each further pass is an eager
    # forward and backward on the first update's main thread (docs/performance.md)
    return torch.cuda.make_graphed_callables(_Backbone(inner), (ids.clone(), mask.clone()), num_warmup_iters=1)


def hidden(model, inner, ids: torch.Tensor, attn: torch.Tensor, use_graphs: bool, length: int = 0) -> torch.Tensor:
    """The backbone's last hidden states [B, Tb, H] in the padded layout (`padded`), from a replayed
    graph when `use_graphs` (and the call is a training forward with grad, or a no-grad forward), else eager."""
    ids, mask = padded(ids, attn, length)
    training = torch.is_grad_enabled()
    if training and not model.training:
        use_graphs = False  # an eval-mode forward with grad (nothing of ours): eager
    if not use_graphs:
        return inner(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    st = state(model)
    graphs = st.graphs
    where = params_at(inner)
    if graphs.get("params") != where:  # moved (or first use): captured addresses are stale
        if graphs:
            _release(graphs)
        graphs["params"] = where
    key = ("train" if training else "infer", bool(model.training), *ids.shape)
    g = graphs.pop(key, None)
    if g is None:
        shapes = [k for k in graphs if k != "params"]
        if len(shapes) >= KEEP:
            _release({shapes[0]: graphs.pop(shapes[0])})  # least recently used (dict order: re-inserted on use)
        if st.before_capture:  # another thread's device work (a publish's sync, the warm-up) would invalidate it
            st.before_capture()
        g = (_capture_training if training else _capture_inference)(inner, ids, mask)
    graphs[key] = g
    return g(ids, mask)


def _release(held: dict) -> None:
    """Free graphs and their pools now: a make_graphed_callables module refers to itself (its forward
    is a closure over it), so only the cycle collector frees it, and until then its pool keeps the
    saved activations on the device."""
    held.clear()
    gc.collect()


def drop(model) -> None:
    """Release a model's graphs and their memory pools (memory.move, before a role leaves the device)."""
    for m in model.modules():  # (the inner model whose module list params_at keeps)
        if (st := peek(m)) is not None:
            st.modules = None
    st = peek(model)
    if st is not None and st.graphs:
        _release(st.graphs)
