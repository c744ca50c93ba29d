"""The rollout engine: batched sampling with a static KV cache and, on CUDA, captured CUDA graphs of
the prefill and of the decode step, so no per-token (or per-layer) Python dispatch remains. The same
code runs on CPU (eager).

It runs the functional decoder of `decoder.py` over weights with the LoRA merged once per policy
version: a merged copy the engine keeps, or (memory.merge_in_place) the student's own base weights,
the LoRA merged into them for each rollout and the pristine bytes copied back from host memory
after it (`decoder.fuse_projections`). An NF4 base (QLoRA) is sampled from a dense copy of its weights, LoRA merged: the
engine's speed for the cost of one dense copy of the student (with `dense_copy=false` through `hf_generate`
instead: the least memory). An int8 base (LLM.int8 quantizes the
activations too, so dequantized weights would not sample what its forward computes) or an
unsupported architecture uses `hf_generate` (transformers forward, LoRA unmerged) with a one-line
warning.

Sampling draws one uniform per (step, sequence) up front from a generator seeded by the stage
digest and inverts the CDF of the tempered distribution, so sampling is reproducible exactly and
the random draw lives inside the captured graph. The recorded log-prob of a sampled token is
under the full tempered distribution (what the update's teacher-forced forward recomputes).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import decoder, graphs, kernels
from .sampling import Decode, Sampling
from ..weights import models
from ..weights.state import state
from .lmhead import to_host as _to_host

SUPPORTED = {"llama", "qwen2", "qwen3", "mistral"}


@dataclass
class Rollout:
    tokens: torch.Tensor  # [B, N] int64 (positions after a sequence finished hold pad)
    logprobs: torch.Tensor  # [B, N] float32
    lengths: torch.Tensor  # [B] int64, response length including the EOS token when one was emitted
    finished: torch.Tensor  # [B] bool, True when the sequence emitted EOS


def supported(model) -> str | None:
    """None if the fast path can run this model, else the reason."""
    base = models.base_of(model)
    mtype = getattr(base.config, "model_type", "?")
    if mtype not in SUPPORTED:
        return f"architecture {mtype!r} has no fast decode path"
    # the functional decoder adds the q/k/v biases (Qwen2's) only: an o_proj or MLP bias (attention_bias
    # of Llama and Qwen3, mlp_bias) would be dropped, sampling another model than the student
    if any(decoder.bias_of(p) is not None for layer in base.model.layers
           for p in (layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)):
        return "a bias on o_proj or the MLP projections (attention_bias / mlp_bias): the fast path adds q/k/v biases only"
    if (getattr(base, "is_quantized", False) or getattr(base, "hf_quantizer", None) is not None) and \
            not all(decoder.is_nf4(m) for n, m in base.model.layers.named_modules()
                    if isinstance(m, torch.nn.Linear) and "lora_" not in n):
        return "int8 base (LLM.int8 quantizes activations too; LoRA runs unmerged through transformers)"
    return None


class Engine:
    """Sampling for one policy version: weights, static KV cache and captured graphs per bucket."""

    def __init__(self, model, use_graphs: bool = True, compile: bool = False, before_capture=None):
        self.model = model
        # called before each capture: another thread's device work (a background publish's sync, the
        # warm-up's kernels) would invalidate it (Resident.before_capture joins both)
        self.before_capture = before_capture or (lambda: None)
        # the student's own weights (memory.merge_in_place: fused at load), merged for each generate
        self.in_place = decoder.is_fused(model)
        self.W = decoder.sampling_weights(model, in_place=self.in_place)
        self.device = self.W["embed"].device
        self.use_graphs = use_graphs and self.device.type == "cuda"
        # the compiled decode layer runs inside the captured graph only (CPU and eager CUDA: `layer`)
        self.compile = compile and self.use_graphs
        self.graphs: dict[tuple, dict] = {}
        base = models.base_of(model)
        self.nf4 = any(decoder.is_nf4(m) for m in base.model.layers.modules() if isinstance(m, torch.nn.Linear))
        self._refresh = None  # (parameter addresses, the captured LoRA re-merge)
        self._side = None  # in place, CUDA: the stream that copies the pristine weights back
        if self.use_graphs and not self.in_place and any(_adapted(base)):
            self.refresh()  # the weights as every later version gets them: from the captured merge

    def refresh(self, model=None) -> None:
        """New policy version. In place there is nothing to do now (each generate merges, or `premerge`
        ahead of it) but undo a merge of the previous version enqueued ahead."""
        if self.in_place:
            decoder.base_ready(self.model)
        else:
            self._remerge(model)

    @torch.no_grad()
    def _remerge(self, model=None) -> None:
        """Re-merge the LoRA into the sampling weights in place, one matrix at a time (no second copy
        of the weights; captured graphs keep reading the same buffers). On CUDA the merge (a few small
        kernels per adapted projection: hundreds of launches, bound by the host when eager) is
        captured once and replayed, and a new engine's weights come from that replay too (cuBLAS may
        choose another algorithm under capture than eager): a resumed process samples from the bytes
        an uninterrupted one refreshed to. An NF4 base's merge dequantizes each projection inside the
        captured graph too (identity.runtime_slice's `nf4_merge` key: it once ran eager)."""
        base = models.base_of(model or self.model)
        if not self.use_graphs or not any(_adapted(base)):  # (nothing to capture without LoRA)
            return self._merge(base)
        where = graphs.params_at(base)
        if self._refresh is not None and self._refresh[0] == where:
            return self._refresh[1].replay()
        self.before_capture()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            self._merge(base)  # warm-up before the capture (cuBLAS handles and workspaces)
        torch.cuda.current_stream().wait_stream(s)
        if self.in_place:  # the warm-up merged into the weights themselves: pristine again before the replay
            self._restore(blocking=True)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self._merge(base)  # (captured, not run)
        self._refresh = (where, g)
        g.replay()

    def _merge(self, base) -> None:
        dt = self.W["dtype"]
        for i, name, mods in _adapted(base):
            w = self.W["head"] if i is None else self.W["layers"][i][name]
            row = 0
            for mod in mods:
                merged = decoder.merged_weight(mod, dt)
                w[row:row + merged.shape[0]].copy_(merged)
                row += merged.shape[0]
                del merged

    @torch.no_grad()
    def premerge(self) -> bool:
        """In place, CUDA: the current policy's merge into the student's weights enqueued now, where the
        GPU would idle while the host publishes the update, instead of at the start of the next
        rollout (generate then samples at once). A replay of the captured merge only (a first merge,
        or one at new addresses, captures and is left to generate). Anything else that reads the
        base first undoes it (decoder.base_ready), as does a new adapter (`refresh`). True when it
        was enqueued."""
        base, st = models.base_of(self.model), state(self.model)
        if not (self.in_place and self.use_graphs) or self._refresh is None or st.merged \
                or self._refresh[0] != graphs.params_at(base):
            return False
        decoder.base_ready(self.model)  # (the last rollout's copy back, on the device)
        self._refresh[1].replay()
        st.merged = True
        return True

    def _restore(self, blocking: bool = False) -> None:
        """In place, after a rollout: the student's base weights back from their pristine host copy.
        On CUDA on a side stream, without blocking: the teacher's scoring overlaps the copy, and the
        student's next forward (or merge) waits for it on the device (decoder.base_ready).
        blocking: in the current stream's order (CPU always)."""
        if blocking or self.device.type != "cuda":
            return decoder.restore(self.model)
        self._side = self._side or torch.cuda.Stream(self.device)
        decoder.restore(self.model, self._side)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new: int, **kw) -> Rollout:
        if not self.in_place:
            return self._generate(prompts, max_new, **kw)
        st = state(self.model)
        premerged, st.merged = st.merged, False  # (`premerge`: this generate samples from that merge)
        try:  # (a merge that fails partway is undone too)
            if not premerged:
                decoder.base_ready(self.model)  # the previous rollout's copy back has landed
                self._remerge()
            return self._generate(prompts, max_new, **kw)
        finally:
            self._restore()

    def _generate(self, prompts: list[list[int]], max_new: int, *, eos: int, pad: int, seed: int,
                  sampling: Sampling = Sampling(), min_new: int = 0) -> Rollout:
        B = len(prompts)
        P = max(len(p) for p in prompts)
        if self.use_graphs:
            P = -(-P // 16) * 16  # bucket the prompt length so graphs are reused across batches
        # inputs are built on the host and sent without blocking (a blocking copy per prompt row
        # would wait for the device each time)
        ids = torch.full((B, P), pad, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, P - len(p):] = torch.tensor(p)  # left padding
        g = torch.Generator(device="cpu").manual_seed(seed)
        inp = {"ids": ids, "pad_len": torch.tensor([P - len(p) for p in prompts]),
               "u": torch.rand(max_new, B, generator=g)}  # u [N, B]: one uniform per draw
        how = Decode(max_new, sampling, min_new, eos, pad)
        if self.use_graphs and max_new > 1:  # (one new token: prefill only, nothing to replay)
            st, run = self._graphed(inp, how)
        else:
            st = self._prefill({k: v.to(self.device, non_blocking=True) for k, v in inp.items()}, how)
            run = lambda: self._step(st, how)  # noqa: E731
        for i in range(1, max_new):
            # one host sync per 8 steps, and none while min_new keeps every sequence going
            if i % 8 == 0 and i > min_new and bool(st["done"].all()):
                break
            run()
        done, out, lps = st["done"], st["out"], st["lp"]
        is_eos = out == eos
        first = torch.where(is_eos.any(1), is_eos.float().argmax(1), torch.full((B,), max_new, device=self.device))
        lengths = torch.where(done, first + 1, torch.full_like(first, max_new))
        return Rollout(*_to_host(out, lps.float(), lengths, done))  # one sync for all four

    def _prefill(self, inp: dict, how: Decode) -> dict:
        return prefill(self.W, inp, how)

    def _step(self, st: dict, how: Decode) -> None:
        step(self.W, st, how, decode_layer(self.W, st["tok"].shape[0], self.compile))

    def _graphed(self, inp: dict, how: Decode):
        """This call's inputs into the captured graphs' static buffers, the prefill replayed: (the
        static state, the decode step's replay). Captured once per (batch, prompt bucket, sampling
        settings): the prefill and the decode step, sharing one memory pool (the prefill's scratch
        is dead by the time a step runs; the state both use stays allocated). The KV cache lives
        in that pool: no per-call cache, no copy of one."""
        key = (*inp["ids"].shape, how)
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self._capture(inp, how)
        for k, v in inp.items():
            g["inp"][k].copy_(v, non_blocking=True)
        g["prefill"].replay()
        return g["st"], g["step"].replay

    def _capture(self, inp: dict, how: Decode) -> dict:
        self.before_capture()
        static = {k: v.to(self.device) for k, v in inp.items()}  # the graphs' input buffers
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up off the capture: compilation, kernel choices, cuBLAS workspaces
            warm = min(2, how.max_new - 1)  # (steps past max_new would index outside the output buffers)
            try:
                st = self._prefill(static, how)
                for _ in range(warm):
                    self._step(st, how)
            except Exception as e:  # noqa: BLE001  no working compiler (Triton) here: the eager decode step
                if not self.compile:
                    raise
                print(f"warning: runtime.compile: the compiled decode step failed ({type(e).__name__}: "
                      f"{str(e).splitlines()[0][:160]}); sampling with the eager step "
                      "(runtime.compile=false skips the attempt)", file=sys.stderr)
                self.compile = False
                st = self._prefill(static, how)
                for _ in range(warm):
                    self._step(st, how)
            del st
        torch.cuda.current_stream().wait_stream(s)
        prefill, step = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(prefill):
            st = self._prefill(static, how)  # (captured, not run: its tensors are the static state)
        with torch.cuda.graph(step, pool=prefill.pool()):  # replayed after the prefill, never alongside
            self._step(st, how)
        return {"inp": static, "st": st, "prefill": prefill, "step": step}


def decode_layer(W: dict, rows: int, compile: bool):
    """The decode step's layer for these sampling weights: with runtime.compile, the Triton kernels
    alone where they serve these rows (kernels.usable: nothing is left for Inductor, so nothing
    compiles), else the compiled layer; without it, eager."""
    if not compile:
        return decoder.layer
    if kernels.usable(rows, W["dtype"], W["embed"].device, decoder.activation(W)):
        return decoder.fused_layer
    return decoder.compiled_layer()


def prefill(W: dict, inp: dict, how: Decode) -> dict:
    """The prompts' forward into a fresh static KV cache and the first draw: the state the
    decode step reads and updates in place. inp: ids [B, P] (left-padded), pad_len [B], u [N, B]."""
    dev = W["embed"].device
    max_new, min_new, eos, s = how.max_new, how.min_new, how.eos, how.sampling
    ids, pad_len, u = inp["ids"], inp["pad_len"], inp["u"]
    B, P = ids.shape
    L = P + max_new
    kv = decoder.new_cache(W, B, L, dev)
    keys = torch.arange(L, device=dev)
    # causal over the padded block, pads never attended
    qpos = torch.arange(P, device=dev)
    valid = (keys[None, None, :] <= qpos[None, :, None]) & (keys[None, None, :] >= pad_len[:, None, None])
    valid |= (qpos[None, :, None] < pad_len[:, None, None]) & (keys[None, None, :] == qpos[None, :, None])
    pos = (qpos[None, :] - pad_len[:, None]).clamp_min(0)
    h = decoder.forward(W, ids, pos, kv, qpos, valid)[:, -1]  # [B, H]
    logits = F.linear(h, W["head"])
    block = torch.full((B,), min_new > 0, device=dev) if min_new > 0 else None
    tok, lp = decoder.pick(logits, u[0], s.temperature, s.top_p, s.greedy, block, eos)
    out = torch.full((B, max_new), how.pad, dtype=torch.long, device=dev)
    lps = torch.zeros(B, max_new, device=dev)
    out[:, 0], lps[:, 0] = tok, lp
    return {"tok": tok.clone(), "slot": torch.full((1,), P, device=dev), "step": torch.full((1,), 1, device=dev),
            "done": tok == eos, "out": out, "lp": lps, "u": u, "kv": kv, "pad_len": pad_len,
            "keys": keys}


def step(W: dict, st: dict, how: Decode, layer) -> None:
    """One decode step: the next token of every sequence, written into the state in place.
    layer: the decoder layer to run (`decode_layer`'s choice)."""
    min_new, eos, pad, s = how.min_new, how.eos, how.pad, how.sampling
    B = st["tok"].shape[0]
    slot, k = st["slot"], st["step"]
    valid = ((st["keys"][None, :] >= st["pad_len"][:, None]) & (st["keys"][None, :] <= slot))[:, None]
    h = decoder.forward(W, st["tok"][:, None], (slot - st["pad_len"])[:, None], st["kv"], slot, valid, layer)
    logits = F.linear(h[:, 0], W["head"])
    blk = (k < min_new).expand(B) if min_new > 0 else None
    t, l = decoder.pick(logits, st["u"].index_select(0, k)[0], s.temperature, s.top_p, s.greedy, blk, eos)
    t = torch.where(st["done"], torch.full_like(t, pad), t)
    l = torch.where(st["done"], torch.zeros_like(l), l)
    st["out"].index_copy_(1, k, t[:, None])
    st["lp"].index_copy_(1, k, l[:, None])
    st["done"] |= t == eos
    st["tok"].copy_(t)
    slot.add_(1)
    k.add_(1)


def _adapted(base):
    """(layer index, sampling-weight name, its projections) wherever a LoRA adapter sits: only those
    change between policy versions; (None, "head", (lm_head,)) for a LoRA on the LM head (the engine's
    head is then a merged copy). Nothing for a model without LoRA (the teacher, a shared teacher's view)."""
    if hasattr(base.lm_head, "base_layer"):
        yield None, "head", (base.lm_head,)
    for i, layer in enumerate(base.model.layers):
        a, m = layer.self_attn, layer.mlp
        for name, mods in (("qkv", (a.q_proj, a.k_proj, a.v_proj)), ("o_proj", (a.o_proj,)),
                           ("gate_up", (m.gate_proj, m.up_proj)), ("down_proj", (m.down_proj,))):
            if any(hasattr(mod, "base_layer") for mod in mods):
                yield i, name, mods


def _cache_kwarg(model) -> str:
    """The forward's KV-cache argument (and output field): `cache` in transformers 5 (its old name
    `past_key_values` warns and goes in 5.40), `past_key_values` in the 4.x releases pyproject allows."""
    import inspect

    return "cache" if "cache" in inspect.signature(models.base_of(model).forward).parameters else "past_key_values"


def hf_generate(model, prompts, max_new, *, eos, pad, seed, sampling: Sampling = Sampling(),
                min_new=0) -> Rollout:
    """Fallback: transformers forward with a dynamic cache (quantized bases, other architectures)."""
    dev = next(model.parameters()).device
    B, P = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, P), pad, dtype=torch.long, device=dev)
    am = torch.zeros(B, P, dtype=torch.long, device=dev)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(p, device=dev)
        am[b, P - len(p):] = 1
    g = torch.Generator(device="cpu").manual_seed(seed)
    u = torch.rand(max_new, B, generator=g).to(dev)
    # tokens and log-probs stay on the device (one transfer at the end); the all-finished check
    # syncs once per 8 steps: steps after every row finished write pad / 0, what the buffers hold
    out = torch.full((B, max_new), pad, dtype=torch.long, device=dev)
    lps = torch.zeros(B, max_new, device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    past, cur, pos = None, ids, (am.cumsum(-1) - 1).clamp_min(0)
    key = _cache_kwarg(model)
    with torch.no_grad():
        for i in range(max_new):
            o = model(input_ids=cur, attention_mask=am, position_ids=pos, use_cache=True, **{key: past})
            past = getattr(o, key)
            blk = torch.full((B,), i < min_new, device=dev) if min_new > 0 else None
            t, l = decoder.pick(o.logits[:, -1], u[i], sampling.temperature, sampling.top_p, sampling.greedy,
                                blk, eos)
            t = torch.where(done, torch.full_like(t, pad), t)
            l = torch.where(done, torch.zeros_like(l), l)
            out[:, i], lps[:, i] = t, l.float()
            done |= t == eos
            if (i + 1) % 8 == 0 and i + 1 > min_new and bool(done.all()):
                break
            cur = t[:, None]
            am = torch.cat([am, torch.ones(B, 1, dtype=am.dtype, device=dev)], 1)
            pos = pos[:, -1:] + 1
    out, lps, done = _to_host(out, lps, done)
    is_eos = out == eos
    first = torch.where(is_eos.any(1), is_eos.float().argmax(1), torch.full((B,), max_new))
    lengths = torch.where(done, first + 1, torch.full_like(first, max_new))
    return Rollout(out, lps, lengths, done)


def make(model, use_graphs: bool, compile: bool = False, before_capture=None):
    """Engine for `model`, or None: where the user chose transformers' sampling (an NF4 model with
    dense_copy=false, models.mark_sampling), or with a one-line warning where the fast path cannot run it."""
    if state(model).quantized_sampling:
        return None
    why = supported(model)
    if why:
        print(f"warning: rollout uses the transformers fallback: {why}", file=sys.stderr)
        return None
    return Engine(model, use_graphs, compile, before_capture)
