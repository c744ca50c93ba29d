"""The functional Llama-family decoder the rollout engine samples with (stages/engine/sampler.py):
a compact re-statement of the transformers forward (Llama, SmolLM2, Qwen2, Qwen3) over plain weight
tensors, mirroring its numerics (fp32 RMSNorm, fp32 rotary tables cast to the compute dtype), and
the weights it reads: LoRA merged (fp32 math, one rounding), q/k/v and gate/up concatenated, an NF4
base dequantized exactly as its own forward dequantizes it (bitsandbytes `dequantize_4bit`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import decode_attention, draw, kernels
from ..weights import models
from ..weights.state import state

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _plain(lin):
    """A Linear without its PEFT LoRA wrapper (the same module when there is none)."""
    return getattr(lin, "base_layer", lin)


def is_nf4(lin) -> bool:
    """A bitsandbytes 4-bit Linear (its weight carries a quant_state), or a PEFT LoRA around one."""
    return getattr(_plain(lin).weight, "quant_state", None) is not None


def dense(lin) -> torch.Tensor:
    """A Linear's base weight [out, in] as a dense tensor: bitsandbytes NF4 dequantized the way its
    own forward dequantizes it (the quant state's compute dtype), anything else as it is."""
    w = lin.weight
    if getattr(w, "quant_state", None) is not None:
        import bitsandbytes.functional as bnbf  # (only an NF4 base gets here: bitsandbytes is installed)

        return bnbf.dequantize_4bit(w.data, w.quant_state)
    return w


def merged_weight(lin, dtype) -> torch.Tensor:
    """Weight of a Linear, with any active PEFT LoRA delta merged in (fp32 math, one rounding)."""
    if hasattr(lin, "base_layer"):
        w = dense(lin.base_layer).float()
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
    return dense(lin).to(dtype)


def bias_of(lin):
    return _plain(lin).bias


@torch.no_grad()
def fuse_projections(model) -> None:
    """Re-home the base weights of every decoder layer's projections into one flat buffer, in the
    order the decode step reads them (per layer q|k|v, o, gate|up, down), so that the fused q/k/v
    and gate/up matrices it multiplies by are views of the model's own weights, and keep a pristine
    copy of that buffer in host memory (pinned on CUDA). The rollout engine then merges the LoRA
    into the weights themselves for a rollout and copies the pristine bytes back after it
    (memory.merge_in_place; sampler.Engine, docs/architecture.md "Rollout engine"): no second copy
    of the student on the device. The model computes what it computed: each weight keeps its shape
    and values as a contiguous view. Call before any forward is captured (the views are new addresses)."""
    base = models.base_of(model)
    groups = []  # (whether the group is a fused matrix the decode step reads, the projections in order)
    for layer in base.model.layers:
        a, m = layer.self_attn, layer.mlp
        groups += [(True, (a.q_proj, a.k_proj, a.v_proj)), (False, (a.o_proj,)),
                   (True, (m.gate_proj, m.up_proj)), (False, (m.down_proj,))]
    ALIGN = 128  # elements: each group starts 256-byte aligned, as a fresh allocation would for cuBLAS
    starts, n = [], 0
    for _, lins in groups:
        starts.append(n)
        n += -(-sum(_plain(x).weight.numel() for x in lins) // ALIGN) * ALIGN
    w0 = _plain(groups[0][1][0]).weight
    flat = torch.empty(n, dtype=w0.dtype, device=w0.device)
    views = []  # per layer q|k|v, then gate|up: [rows of all its projections, in_features]
    for (keep, lins), off in zip(groups, starts):
        start = off
        for lin in lins:
            w = _plain(lin).weight
            view = flat[off:off + w.numel()].view(w.shape)
            view.copy_(w)
            w.data = view  # the Parameter now lives in the flat buffer; its old storage is freed
            off += w.numel()
        if keep:
            views.append(flat[start:off].view(-1, w0.shape[1]))
    pristine = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=flat.device.type == "cuda")
    st = state(base)
    st.flat, st.pristine, st.fused = flat, pristine.copy_(flat), list(zip(views[::2], views[1::2]))


def is_fused(model) -> bool:
    """`fuse_projections` ran on this model (memory.merge_in_place): the engine samples from its weights."""
    return state(model).flat is not None


def base_ready(model) -> None:
    """Before a forward reads the student's base weights: pristine. A merge enqueued ahead of the next
    rollout (sampler.Engine.premerge) that something else reaches first is undone in the current
    stream's order; the copy back after an in-place merged rollout is waited for on the device (the
    host goes on)."""
    st = state(model)
    if st.merged:
        st.merged = False
        restore(model)
    if st.restored is not None:
        torch.cuda.current_stream().wait_event(st.restored)


@torch.no_grad()
def restore(model, side: torch.cuda.Stream | None = None) -> None:
    """The student's base weights back from their pristine host copy (`fuse_projections`): in the
    current stream's order, or (CUDA) on stream `side` without blocking, the event `base_ready` waits
    for recorded after it."""
    st = state(model)
    flat, pristine = st.flat, st.pristine
    if side is None or flat.device.type != "cuda":
        flat.copy_(pristine)
        return
    side.wait_stream(torch.cuda.current_stream())  # after the last read of the merged weights
    with torch.cuda.stream(side):
        flat.copy_(pristine, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
    st.restored = ev


@torch.no_grad()
def sampling_weights(model, in_place: bool = False) -> dict:
    """Plain tensors for the functional decoder, LoRA merged, q/k/v and gate/up concatenated so a
    decode step launches one matmul for each (fewer, larger kernels). Built once per policy version.
    in_place: the model's own base weights after `fuse_projections` (nothing copied; the engine
    merges the LoRA into them for each rollout)."""
    base = models.base_of(model)
    inner, cfg = base.model, base.config
    dtype = inner.embed_tokens.weight.dtype
    layers = []
    fused = state(model).fused
    for i, layer in enumerate(inner.layers):
        a, m = layer.self_attn, layer.mlp
        biases = [bias_of(getattr(a, p)) for p in PROJ[:3]]
        if in_place:
            own = {"qkv": fused[i][0], "o_proj": _plain(a.o_proj).weight,
                   "gate_up": fused[i][1], "down_proj": _plain(m.down_proj).weight}
        else:
            own = {"qkv": torch.cat([merged_weight(getattr(a, p), dtype) for p in PROJ[:3]]),
                   "o_proj": merged_weight(a.o_proj, dtype),
                   "gate_up": torch.cat([merged_weight(m.gate_proj, dtype), merged_weight(m.up_proj, dtype)]),
                   "down_proj": merged_weight(m.down_proj, dtype)}
        layers.append({
            **own, "qkv_bias": None if biases[0] is None else torch.cat(biases),
            "ln1": layer.input_layernorm.weight, "ln2": layer.post_attention_layernorm.weight,
            "q_norm": getattr(getattr(a, "q_norm", None), "weight", None),
            "k_norm": getattr(getattr(a, "k_norm", None), "weight", None),
        })
    rot = inner.rotary_emb
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return {
        "layers": layers, "embed": inner.embed_tokens.weight, "norm": inner.norm.weight,
        "head": merged_weight(base.lm_head, dtype), "eps": cfg.rms_norm_eps, "dtype": dtype,
        "inv_freq": rot.inv_freq.float(), "rope_scale": float(getattr(rot, "attention_scaling", 1.0)),
        "n_heads": cfg.num_attention_heads, "n_kv": cfg.num_key_value_heads, "head_dim": head_dim,
        "n_layers": len(layers), "act": cfg.hidden_act,
    }


def rms(x, w, eps):
    # transformers: normalise in fp32, round once to the compute dtype, then scale by the weight.
    # F.rms_norm is one fused kernel on CUDA and computes in fp32 internally for bf16 inputs.
    if x.dtype == torch.float32 or x.device.type != "cuda":
        dt = x.dtype
        x = x.float()
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dt)
    return w * F.rms_norm(x, (x.shape[-1],), eps=eps)


def rope(x, cos, sin):
    # x [B, H, T, D]; cos/sin [B, 1, T, D]
    h = x.shape[-1] // 2
    rot = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return x * cos + rot * sin


def attend(qkv, w, kv, cos, sin, mask, slots, H, KV, D, eps):
    """Attention of one layer from its q|k|v projection qkv [B, T, H + 2 KV, D]: Qwen3's per-head
    norms, rotary, the new K and V written into kv [2, B, n_kv, L, D] at `slots` with one
    index_copy_ (one kernel, compiled), SDPA over the cache. Returns [B, T, H * D]."""
    B, T = qkv.shape[:2]
    if w["q_norm"] is not None:  # Qwen3 normalises each head before rotary
        q, k, v = qkv.split((H, KV, KV), dim=2)
        qk = torch.cat((rms(q, w["q_norm"], eps), rms(k, w["k_norm"], eps)), dim=2)
    else:
        qk, v = qkv[:, :, :H + KV], qkv[:, :, H + KV:]
    qk = rope(qk.transpose(1, 2), cos, sin)  # q and k rotated together: [B, H+KV, T, D]
    q, k = qk[:, :H], qk[:, H:]
    kv.index_copy_(3, slots, torch.stack((k, v.transpose(1, 2))))  # [2, B, KV, T, D]
    o = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask, enable_gqa=KV != H)
    return o.transpose(1, 2).reshape(B, T, H * D)


def kernel_attend(qkv, w, kv, cos, sin, mask, slots, H, KV, D, eps):
    """`attend` through `decode_attention.rope_attention` where it serves (one new token per row, the float
    mask `forward` makes on CUDA, decode_attention.usable): per-head norms, rotary, the cache writes
    and attention over the live positions in one kernel. Otherwise `attend`."""
    B, T = qkv.shape[:2]
    if decode_attention.usable(T, mask, qkv.dtype, qkv.device, D):
        return decode_attention.rope_attention(qkv.reshape(B, -1), cos, sin, w["q_norm"], w["k_norm"], kv, slots, mask,
                                      H, KV, eps).view(B, 1, H * D)
    return attend(qkv, w, kv, cos, sin, mask, slots, H, KV, D, eps)


def layer(x, r, w, kv, cos, sin, mask, slots, H, KV, D, eps, act, attention=attend):
    """One decoder layer over the residual stream x [B, T, hidden] plus the previous layer's MLP
    output r (added here, so that compiled the add fuses into this layer's first RMSNorm instead of
    costing a kernel at the end of the previous call); writes its new K and V into kv
    [2, B, n_kv, L, D] at `slots`. Returns (x, this layer's MLP output). A plain function of tensors
    and constants, so torch.compile can fuse it (`compiled_layer`). attention: `attend` (the
    reference) or `kernel_attend` (fused_layer's, past kernels.MAX_ROWS rows)."""
    B, T = x.shape[:2]
    x = x + r
    h = rms(x, w["ln1"], eps)
    qkv = F.linear(h, w["qkv"], w["qkv_bias"]).view(B, T, H + 2 * KV, D)
    x = x + F.linear(attention(qkv, w, kv, cos, sin, mask, slots, H, KV, D, eps), w["o_proj"])
    h = rms(x, w["ln2"], eps)
    gate, up = F.linear(h, w["gate_up"]).chunk(2, dim=-1)
    return x, F.linear(act(gate) * up, w["down_proj"])


def fused_layer(x, r, w, kv, cos, sin, mask, slots, H, KV, D, eps, act):
    """`layer` for a decode step of at most kernels.MAX_ROWS rows on CUDA (kernels.usable): four
    `kernels.project` launches do the projections with the RMSNorms, the SiLU gate and the residual
    adds folded in, and for one new token per row `kernel_attend` does what `attend` does (per-head
    norms, rotary, the cache writes, SDPA's work; with decode_attention.ATTENTION off, `kernels.rope_cache`
    all of it before SDPA): no kernel is left for Inductor, so the engine runs it uncompiled
    (docs/architecture.md, "fused decode projections"). Past MAX_ROWS rows (workload b's 64) it is
    `layer` with `kernel_attend`, for the engine to compile around cuBLAS. Every residual add
    happens inside a projection, so it reads no r (forward's zeros at the first layer) and returns
    None for it (the choice is by shape and dtype, the same for every layer of a forward). Other
    inputs: `layer`."""
    B, T, E = x.shape
    if not kernels.usable(B * T, x.dtype, x.device, act):  # many rows: cuBLAS's matmuls (compiled)
        return layer(x, r, w, kv, cos, sin, mask, slots, H, KV, D, eps, act, attention=kernel_attend)
    x = x.view(B * T, E)
    qkv = kernels.project(x, w["qkv"], w["ln1"], w["qkv_bias"], None, eps, False)  # [B*T, (H+2KV)*D]
    # (decode_kernels ':sdpa'; rope_cache, like rope_attention, needs a power-of-two head dim: else `attend`)
    if T == 1 and D & (D - 1) == 0 and not decode_attention.usable(T, mask, x.dtype, x.device, D):
        q = kernels.rope_cache(qkv, cos, sin, w["q_norm"], w["k_norm"], kv, slots, H, KV, eps)  # [B, H, 1, D]
        o = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask, enable_gqa=KV != H)
        o = o.transpose(1, 2).reshape(B * T, H * D)
    else:
        o = kernel_attend(qkv.view(B, T, H + 2 * KV, D), w, kv, cos, sin, mask, slots, H, KV, D, eps).reshape(B * T, H * D)
    x = kernels.project(o, w["o_proj"], None, None, x, eps, False)  # x + o @ Wo.T
    a = kernels.project(x, w["gate_up"], w["ln2"], None, None, eps, True)  # silu(gate) * up [B*T, I]
    return kernels.project(a, w["down_proj"], None, None, x, eps, False).view(B, T, E), None


_COMPILED = None


def compiled_layer():
    """`fused_layer` through torch.compile (Inductor): rotary and the cache writes fuse into a few
    Triton kernels (and, past kernels.MAX_ROWS rows, RMSNorm and the residual adds around cuBLAS's
    matmuls), where eager launches ~20 small ones per layer.
    One compilation serves every layer (same shapes); the decode step calls it inside the
    captured CUDA graph. Compiled once per process and shape (docs/architecture.md, rollout engine)."""
    global _COMPILED
    if _COMPILED is None:
        models.compile_settings()  # deterministic kernel choices; shapes are static (one compilation
        _COMPILED = torch.compile(fused_layer, fullgraph=True, dynamic=False)  # per batch and cache length)
    return _COMPILED


def activation(W):
    """The MLP's activation function for these sampling weights."""
    return getattr(F, W["act"]) if W["act"] != "swish" else F.silu


def new_cache(W, B: int, L: int, device) -> torch.Tensor:
    """The static KV cache: [n_layers, 2 (K, V), B, n_kv, L, head_dim], zeros."""
    return torch.zeros((W["n_layers"], 2, B, W["n_kv"], L, W["head_dim"]), dtype=W["dtype"], device=device)


def forward(W, ids, pos, cache, slots, key_valid, layer=layer):
    """One forward over T new tokens per sequence, writing their K/V into the static cache.

    ids [B, T]; pos [B, T] rotary positions; cache [n_layers, 2, B, n_kv, L, D] (`new_cache`);
    slots [T] cache slots for the new tokens; key_valid [B, T, L] bool (on CUDA made into the additive
    mask SDPA would make of it, once for every layer) or such a mask. Returns hidden [B, T, H].
    """
    dt = W["dtype"]
    x = F.embedding(ids, W["embed"])
    freqs = pos.float()[..., None] * W["inv_freq"]  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * W["rope_scale"]).to(dt)[:, None]  # [B, 1, T, D]
    sin = (emb.sin() * W["rope_scale"]).to(dt)[:, None]
    mask = key_valid[:, None]  # [B, 1, T, L]
    if mask.dtype == torch.bool and mask.is_cuda:  # made once, not per layer
        mask = additive_mask(mask, dt)
    act = activation(W)
    r = torch.zeros_like(x)
    for i, w in enumerate(W["layers"]):
        x, r = layer(x, r, w, cache[i], cos, sin, mask, slots, W["n_heads"], W["n_kv"], W["head_dim"], W["eps"], act)
    return rms(x if r is None else x + r, W["norm"], W["eps"])  # (fused_layer: no MLP output left to add)


def additive_mask(valid, dtype):
    """The additive mask SDPA makes of a bool one: 0 where valid, -inf elsewhere, in `dtype`."""
    return torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill_(~valid, float("-inf"))


def _cumsum(p, chunk: int = 1024):
    """p.cumsum(-1) for p [B, V] >= 0. CUDA scans a few long rows one thread block per row (most of a
    decode step's draw at the seed's 4 rows): there, `chunked_cumsum`. CPU: one scan."""
    if not p.is_cuda or p.shape[-1] <= chunk:
        return p.cumsum(-1)
    return chunked_cumsum(p, chunk)


def chunked_cumsum(p, chunk: int):
    """p.cumsum(-1) as chunks of `chunk` scanned side by side, each adding the sum of the chunks
    before it (rounding differs from one long scan in the last bits; the same inputs give the same
    bits). Any device (tests run it on CPU)."""
    B, V = p.shape
    n = -(-V // chunk)
    c = F.pad(p, (0, n * chunk - V)).view(B, n, chunk).cumsum(-1)  # [B, n, chunk]
    before = F.pad(c[..., -1].cumsum(-1)[:, :-1], (1, 0))  # [B, n] sum of the chunks before each
    return (c + before[..., None]).view(B, n * chunk)[:, :V].contiguous()


def pick(logits, u, temperature, top_p, greedy, block_eos, eos):
    """logits [B, V] -> (token [B], log-prob under the tempered distribution [B]). On CUDA plain
    sampling (no top-p, not greedy) is stages/engine/draw.py's two kernels."""
    if draw.usable(logits, greedy, top_p):
        return draw.sample(logits, u, temperature, block_eos, eos)
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
            keep = (_cumsum(sp) - sp) < top_p  # always keeps the first
            sp = sp * keep
            cdf = _cumsum(sp)
            j = torch.searchsorted(cdf, (u * cdf[:, -1:].squeeze(-1))[:, None]).clamp_max(sp.shape[-1] - 1)
            tok = si.gather(-1, j).squeeze(-1)
        else:
            cdf = _cumsum(probs)
            tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp_max(probs.shape[-1] - 1).squeeze(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
