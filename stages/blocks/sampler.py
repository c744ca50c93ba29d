"""The rollout engine: batched sampling with a static KV cache and, on CUDA, a captured CUDA graph
of the decode step, so no per-token Python dispatch remains. The same code runs on CPU (eager).

The decoder below is a compact functional re-statement of the Llama-family forward (Llama,
SmolLM2, Qwen2, Qwen3) over plain weight tensors, mirroring transformers' numerics (fp32 RMSNorm,
fp32 rotary tables cast to the compute dtype). The LoRA is merged into these sampling weights once
per policy version. An NF4 base (QLoRA) is sampled from a dense copy of its weights, dequantized
exactly as its own forward dequantizes them (bitsandbytes `dequantize_4bit`), LoRA merged: the
engine's speed for the cost of one dense copy of the student. An int8 base (LLM.int8 quantizes the
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

from . import models
from .lmhead import to_host as _to_host

SUPPORTED = {"llama", "qwen2", "qwen3", "mistral"}
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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
    if (getattr(base, "is_quantized", False) or getattr(base, "hf_quantizer", None) is not None) and \
            not all(_nf4(m) for n, m in base.model.layers.named_modules()
                    if isinstance(m, torch.nn.Linear) and "lora_" not in n):
        return "int8 base (LLM.int8 quantizes activations too; LoRA runs unmerged through transformers)"
    return None


def _nf4(lin) -> bool:
    """A bitsandbytes 4-bit Linear (its weight carries a quant_state), or a PEFT LoRA around one."""
    lin = getattr(lin, "base_layer", lin)
    return getattr(lin.weight, "quant_state", None) is not None


def _dense(lin) -> torch.Tensor:
    """A Linear's base weight [out, in] as a dense tensor: bitsandbytes NF4 dequantized the way its
    own forward dequantizes it (the quant state's compute dtype), anything else as it is."""
    w = lin.weight
    if getattr(w, "quant_state", None) is not None:
        import bitsandbytes.functional as bnbf  # (only an NF4 base gets here: bitsandbytes is installed)

        return bnbf.dequantize_4bit(w.data, w.quant_state)
    return w


def _weight(lin, dtype) -> torch.Tensor:
    """Weight of a Linear, with any active PEFT LoRA delta merged in (fp32 math, one rounding)."""
    if hasattr(lin, "base_layer"):
        w = _dense(lin.base_layer).float()
        if not getattr(lin, "disable_adapters", False):
            for name in lin.active_adapters:
                if name not in lin.lora_A:
                    continue
                if getattr(lin, "fan_in_fan_out", False) or lin.use_dora.get(name, False):
                    w = w + lin.get_delta_weight(name).float()  # PEFT's general path
                else:  # plain LoRA: W + s * B @ A in one fused kernel
                    w = torch.addmm(w, lin.lora_B[name].weight.float(), lin.lora_A[name].weight.float(),
                                    alpha=lin.scaling[name])
        return w.to(dtype).contiguous()
    return _dense(lin).to(dtype)


def _bias(lin):
    lin = getattr(lin, "base_layer", lin)
    return lin.bias


@torch.no_grad()
def sampling_weights(model) -> dict:
    """Plain tensors for the functional decoder, LoRA merged, q/k/v and gate/up concatenated so a
    decode step launches one matmul for each (fewer, larger kernels). Built once per policy version."""
    base = models.base_of(model)
    inner, cfg = base.model, base.config
    dtype = inner.embed_tokens.weight.dtype
    layers = []
    for layer in inner.layers:
        a, m = layer.self_attn, layer.mlp
        biases = [_bias(getattr(a, p)) for p in PROJ[:3]]
        layers.append({
            "qkv": torch.cat([_weight(getattr(a, p), dtype) for p in PROJ[:3]]),
            "qkv_bias": None if biases[0] is None else torch.cat(biases),
            "o_proj": _weight(a.o_proj, dtype),
            "gate_up": torch.cat([_weight(m.gate_proj, dtype), _weight(m.up_proj, dtype)]),
            "down_proj": _weight(m.down_proj, dtype),
            "ln1": layer.input_layernorm.weight, "ln2": layer.post_attention_layernorm.weight,
            "q_norm": getattr(getattr(a, "q_norm", None), "weight", None),
            "k_norm": getattr(getattr(a, "k_norm", None), "weight", None),
        })
    rot = inner.rotary_emb
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return {
        "layers": layers, "embed": inner.embed_tokens.weight, "norm": inner.norm.weight,
        "head": _weight(base.lm_head, dtype), "eps": cfg.rms_norm_eps, "dtype": dtype,
        "inv_freq": rot.inv_freq.float(), "rope_scale": float(getattr(rot, "attention_scaling", 1.0)),
        "n_heads": cfg.num_attention_heads, "n_kv": cfg.num_key_value_heads, "head_dim": head_dim,
        "n_layers": len(layers), "act": cfg.hidden_act,
    }


def _rms(x, w, eps):
    # transformers: normalise in fp32, round once to the compute dtype, then scale by the weight.
    # F.rms_norm is one fused kernel on CUDA and computes in fp32 internally for bf16 inputs.
    if x.dtype == torch.float32 or x.device.type != "cuda":
        dt = x.dtype
        x = x.float()
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dt)
    return w * F.rms_norm(x, (x.shape[-1],), eps=eps)


def _rope(x, cos, sin):
    # x [B, H, T, D]; cos/sin [B, 1, T, D]
    h = x.shape[-1] // 2
    rot = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return x * cos + rot * sin


def _layer(x, w, ck, cv, cos, sin, mask, slots, H, KV, D, eps, act):
    """One decoder layer over x [B, T, hidden]; writes its new K/V into ck/cv [B, n_kv, L, D] at
    `slots`. A plain function of tensors and constants, so torch.compile can fuse it (`_compiled`)."""
    B, T = x.shape[:2]
    h = _rms(x, w["ln1"], eps)
    qkv = F.linear(h, w["qkv"], w["qkv_bias"]).view(B, T, H + 2 * KV, D)
    if w["q_norm"] is not None:  # Qwen3 normalises each head before rotary
        q, k, v = qkv.split((H, KV, KV), dim=2)
        qk = torch.cat((_rms(q, w["q_norm"], eps), _rms(k, w["k_norm"], eps)), dim=2)
    else:
        qk, v = qkv[:, :, :H + KV], qkv[:, :, H + KV:]
    qk = _rope(qk.transpose(1, 2), cos, sin)  # q and k rotated together: [B, H+KV, T, D]
    q, k = qk[:, :H], qk[:, H:]
    ck.index_copy_(2, slots, k)
    cv.index_copy_(2, slots, v.transpose(1, 2))
    o = F.scaled_dot_product_attention(q, ck, cv, attn_mask=mask, enable_gqa=KV != H)
    x = x + F.linear(o.transpose(1, 2).reshape(B, T, H * D), w["o_proj"])
    h = _rms(x, w["ln2"], eps)
    gate, up = F.linear(h, w["gate_up"]).chunk(2, dim=-1)
    return x + F.linear(act(gate) * up, w["down_proj"])


_COMPILED = None


def _compiled():
    """`_layer` through torch.compile (Inductor): RMSNorm, rotary, the cache writes and the
    residual adds fuse into a few Triton kernels, where eager launches ~20 small ones per layer.
    One compilation serves every layer (same shapes); the decode step calls it inside the
    captured CUDA graph. Compiled once per process and shape (docs/architecture.md, rollout engine)."""
    global _COMPILED
    if _COMPILED is None:
        models.compile_settings()  # deterministic kernel choices; shapes are static (one compilation
        _COMPILED = torch.compile(_layer, fullgraph=True, dynamic=False)  # per batch and cache length)
    return _COMPILED


def _forward(W, ids, pos, cache_k, cache_v, slots, key_valid, layer=_layer):
    """One forward over T new tokens per sequence, writing their K/V into the static cache.

    ids [B, T]; pos [B, T] rotary positions; cache_k/v [n_layers, B, n_kv, L, D];
    slots [T] cache slots for the new tokens; key_valid [B, T, L] bool. Returns hidden [B, T, H].
    """
    dt = W["dtype"]
    x = F.embedding(ids, W["embed"])
    freqs = pos.float()[..., None] * W["inv_freq"]  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * W["rope_scale"]).to(dt)[:, None]  # [B, 1, T, D]
    sin = (emb.sin() * W["rope_scale"]).to(dt)[:, None]
    mask = key_valid[:, None]  # [B, 1, T, L]
    act = getattr(F, W["act"]) if W["act"] != "swish" else F.silu
    for i, w in enumerate(W["layers"]):
        x = layer(x, w, cache_k[i], cache_v[i], cos, sin, mask, slots, W["n_heads"], W["n_kv"], W["head_dim"],
                  W["eps"], act)
    return _rms(x, W["norm"], W["eps"])


def _pick(logits, u, temperature, top_p, greedy, block_eos, eos):
    """logits [B, V] -> (token [B], log-prob under the tempered distribution [B])."""
    logits = logits.float()
    if block_eos is not None:  # min_new_tokens: EOS impossible before then (benchmarks)
        logits[:, eos] = torch.where(block_eos, float("-inf"), logits[:, eos])
    logp = torch.log_softmax(logits / temperature, dim=-1)
    if greedy:
        tok = logp.argmax(-1)
    else:
        probs = logp.exp()
        if top_p < 1.0:
            sp, si = probs.sort(-1, descending=True)
            keep = (sp.cumsum(-1) - sp) < top_p  # always keeps the first
            sp = sp * keep
            cdf = sp.cumsum(-1)
            j = torch.searchsorted(cdf, (u * cdf[:, -1:].squeeze(-1))[:, None]).clamp_max(sp.shape[-1] - 1)
            tok = si.gather(-1, j).squeeze(-1)
        else:
            cdf = probs.cumsum(-1)
            tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp_max(probs.shape[-1] - 1).squeeze(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


class Engine:
    """Sampling for one policy version: weights, static KV cache and captured graphs per bucket."""

    def __init__(self, model, use_graphs: bool = True, compile: bool = False):
        self.model = model
        self.W = sampling_weights(model)
        self.device = self.W["embed"].device
        self.use_graphs = use_graphs and self.device.type == "cuda"
        # the compiled decode layer runs inside the captured graph only (CPU and eager CUDA: `_layer`)
        self.compile = compile and self.use_graphs
        self.graphs: dict[tuple, dict] = {}

    @torch.no_grad()
    def refresh(self, model=None) -> None:
        """New policy version: re-merge the LoRA into the sampling weights in place, one matrix at a
        time (no second copy of the weights; captured graphs keep reading the same buffers)."""
        inner = models.base_of(model or self.model).model
        dt = self.W["dtype"]
        for layer, w in zip(inner.layers, self.W["layers"]):
            a, m = layer.self_attn, layer.mlp
            for name, mods in (("qkv", (a.q_proj, a.k_proj, a.v_proj)), ("o_proj", (a.o_proj,)),
                               ("gate_up", (m.gate_proj, m.up_proj)), ("down_proj", (m.down_proj,))):
                if not any(hasattr(mod, "base_layer") for mod in mods):
                    continue  # no adapter on these projections: nothing changes between versions
                row = 0
                for mod in mods:
                    merged = _weight(mod, dt)
                    w[name][row:row + merged.shape[0]].copy_(merged)
                    row += merged.shape[0]
                    del merged

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new: int, *, eos: int, pad: int, seed: int,
                 temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False,
                 min_new: int = 0) -> Rollout:
        W, dev = self.W, self.device
        B = len(prompts)
        P = max(len(p) for p in prompts)
        if self.use_graphs:
            P = -(-P // 16) * 16  # bucket the prompt length so graphs are reused across batches
        L = P + max_new
        # inputs are built on the host and sent without blocking (a blocking copy per prompt row
        # would wait for the device each time)
        pad_len = torch.tensor([P - len(p) for p in prompts]).to(dev, non_blocking=True)  # left padding
        ids = torch.full((B, P), pad, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, P - len(p):] = torch.tensor(p)
        ids = ids.to(dev, non_blocking=True)
        g = torch.Generator(device="cpu").manual_seed(seed)
        u = torch.rand(max_new, B, generator=g).to(dev, non_blocking=True)  # [N, B] one uniform per draw

        shape = (W["n_layers"], B, W["n_kv"], L, W["head_dim"])
        ck = torch.zeros(shape, dtype=W["dtype"], device=dev)
        cv = torch.zeros_like(ck)
        keys = torch.arange(L, device=dev)
        # prefill: causal over the padded block, pads never attended
        qpos = torch.arange(P, device=dev)
        valid = (keys[None, None, :] <= qpos[None, :, None]) & (keys[None, None, :] >= pad_len[:, None, None])
        valid |= (qpos[None, :, None] < pad_len[:, None, None]) & (keys[None, None, :] == qpos[None, :, None])
        pos = (qpos[None, :] - pad_len[:, None]).clamp_min(0)
        h = _forward(W, ids, pos, ck, cv, qpos, valid)[:, -1]  # [B, H]
        logits = F.linear(h, W["head"])
        block = torch.full((B,), min_new > 0, device=dev)
        tok, lp = _pick(logits, u[0], temperature, top_p, greedy, block if min_new > 0 else None, eos)

        st = {  # static state the decode step reads and updates in place
            "tok": tok.clone(), "slot": torch.full((1,), P, device=dev), "step": torch.full((1,), 1, device=dev),
            "done": tok == eos, "out": torch.full((B, max_new), pad, dtype=torch.long, device=dev),
            "lp": torch.zeros(B, max_new, device=dev), "u": u, "ck": ck, "cv": cv, "pad_len": pad_len,
            "keys": keys,
        }
        st["out"][:, 0], st["lp"][:, 0] = tok, lp

        def step():
            slot, k = st["slot"], st["step"]
            valid = ((st["keys"][None, :] >= st["pad_len"][:, None]) & (st["keys"][None, :] <= slot))[:, None]
            h = _forward(W, st["tok"][:, None], (slot - st["pad_len"])[:, None], st["ck"], st["cv"], slot, valid,
                         _compiled() if self.compile else _layer)
            logits = F.linear(h[:, 0], W["head"])
            blk = (k < min_new).expand(B) if min_new > 0 else None
            t, l = _pick(logits, st["u"].index_select(0, k.clamp_max(max_new - 1))[0], temperature, top_p,
                         greedy, blk, eos)
            t = torch.where(st["done"], torch.full_like(t, pad), t)
            l = torch.where(st["done"], torch.zeros_like(l), l)
            st["out"].index_copy_(1, k, t[:, None])
            st["lp"].index_copy_(1, k, l[:, None])
            st["done"] |= t == eos
            st["tok"].copy_(t)
            slot.add_(1)
            k.add_(1)

        run = self._graph(step, st, (B, P, max_new, temperature, top_p, greedy, min_new)) \
            if self.use_graphs else step
        for i in range(1, max_new):
            # one host sync per 8 steps, and none while min_new keeps every sequence going
            if i % 8 == 0 and i > min_new and bool(st["done"].all()):
                break
            run()
        done = st["done"]
        out, lps = st["out"], st["lp"]
        is_eos = out == eos
        first = torch.where(is_eos.any(1), is_eos.float().argmax(1), torch.full((B,), max_new, device=dev))
        lengths = torch.where(done, first + 1, torch.full_like(first, max_new))
        return Rollout(*_to_host(out, lps.float(), lengths, done))  # one sync for all four

    def _graph(self, step, st, key):
        """Capture `step` once per (batch, prompt bucket, length, sampling settings); replay after."""
        g = self.graphs.get(key)
        if g is None:
            snap = {k: v.clone() for k, v in st.items() if torch.is_tensor(v)}
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                try:
                    for _ in range(2):
                        step()  # warm-up: compilation, kernel selection and allocator pools before capture
                except Exception as e:  # noqa: BLE001  no working compiler (Triton) here: the eager decode step
                    if not self.compile:
                        raise
                    print(f"warning: runtime.compile: the compiled decode step failed ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:160]}); sampling with the eager step "
                          "(runtime.compile=false skips the attempt)", file=sys.stderr)
                    self.compile = False
                    for k, v in snap.items():
                        st[k].copy_(v)
                    for _ in range(2):
                        step()
            torch.cuda.current_stream().wait_stream(s)
            for k, v in snap.items():
                st[k].copy_(v)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            for k, v in snap.items():
                st[k].copy_(v)
            g = {"graph": graph, "st": st}
            self.graphs[key] = g
            return graph.replay
        # a cached graph reads its own static tensors: load this call's state into them
        for k, v in st.items():
            if torch.is_tensor(v):
                g["st"][k].copy_(v)
        st.clear()
        st.update(g["st"])
        return g["graph"].replay


def _cache_kwarg(model) -> str:
    """The forward's KV-cache argument (and output field): `cache` in transformers 5 (its old name
    `past_key_values` warns and goes in 5.40), `past_key_values` in the 4.x releases pyproject allows."""
    import inspect

    return "cache" if "cache" in inspect.signature(models.base_of(model).forward).parameters else "past_key_values"


def hf_generate(model, prompts, max_new, *, eos, pad, seed, temperature=1.0, top_p=1.0, greedy=False,
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
            t, l = _pick(o.logits[:, -1], u[i], temperature, top_p, greedy, blk, eos)
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


def make(model, use_graphs: bool, compile: bool = False):
    """Engine for `model`, or None (with a one-line warning) when the fast path cannot run it."""
    why = supported(model)
    if why:
        print(f"warning: rollout uses the transformers fallback: {why}", file=sys.stderr)
        return None
    return Engine(model, use_graphs, compile)
