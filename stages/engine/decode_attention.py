"""The decode step's attention as Triton kernels (docs/architecture.md, "Fused decode projections"):
for one new token per row, Qwen3's per-head norms, rotary, the cache writes and attention over the
cache up to the slot, in one kernel (`rope_attention`, a torch custom op). Up to ATTN_KV_ROWS rows a
program per row and query head; past them a program per row and kv head with tensor-core products.
Shares the rotary code and the launch settings of stages/engine/kernels.py.
"""
from __future__ import annotations

import torch

from .kernels import FP_FUSION, _rotate, pdl, triton

if triton is not None:
    import triton.language as tl

ATTENTION = True  # rope_attention for the decode step's attention; False: rope_cache + SDPA (decode_kernels ':sdpa')
# Cache positions x head dim that one rope_attention program holds per block (K and V each): the
# seed's whole cache (256 x 64) in one block, Qwen3's 128-dim heads 128 positions at a time.
ATTN_TILE = 16384
# Past this many rows, rope_attention runs a program per row and kv head instead (_rope_attention_kv:
# its query heads together, tensor-core products, the cache read once), ATTN_KV_BLOCK positions at a
# time: at workload b's 64 rows the per-query-head kernel was three times slower than cuDNN's SDPA
# over the whole cache (docs/performance.md, "Evidence for the constants in the code").
ATTN_KV_ROWS = 16
ATTN_KV_BLOCK = 64
ATTN_KV_STAGES = 3  # blocks of the cache in flight per program (Triton's software pipelining of the loop)


if triton is not None:
    @triton.jit
    def _rope_attention(QKV, COS, SIN, QN, KN, KV, SLOT, MASK, O, scale, eps, L, s_qkv, s_cos, s_kvc, s_kvb,
                        s_kvh, s_kvl, s_mb, H: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr,
                        BL: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
        # program (b, h): query head h of row b and the kv head g it reads (one program per query head:
        # a faster seed decode step than one per kv head looping over its query heads,
        # docs/performance.md). The new key (normed, rotated) and value stand in for that row of the
        # cache block read here (so no store has to be visible to a load), and the first program of
        # each kv head writes them into
        # KV [2, B, NKV, L, D] at the slot SLOT holds; then attention over the positions up to the
        # slot (every later one is masked: the decode step's mask is causal, and they are not read),
        # BL at a time (K and V [BL, D] held whole: every load of a block in flight together) with
        # the running max and sum of an online softmax, fp32, into O [B, H * D]
        b, h = tl.program_id(0), tl.program_id(1)
        g = h // (H // NKV)
        d, rl, rd = tl.arange(0, D // 2), tl.arange(0, BL), tl.arange(0, D)
        # first what the kernel before (the q|k|v projection) does not write, so that under PDL these
        # loads, the cache's first block among them, overlap it: the slot, rotary tables and mask
        # (made before the layers) and the cache's rows but the new one (written by earlier steps)
        slot = tl.load(SLOT)
        n = tl.minimum(slot + 1, L)  # positions read
        c = tl.load(COS + b * s_cos + d).to(tl.float32)  # cos/sin [B, D]: both halves alike
        s = tl.load(SIN + b * s_cos + d).to(tl.float32)
        base = KV + b * s_kvb + g * s_kvh + rd[None, :]
        pos = rl
        old = ((pos < n) & (pos != slot))[:, None]  # [BL, 1]
        k = tl.load(base + pos[:, None] * s_kvl, mask=old, other=0.0)  # [BL, D], the compute dtype (registers)
        v = tl.load(base + s_kvc + pos[:, None] * s_kvl, mask=old, other=0.0)
        bias = tl.load(MASK + b * s_mb + pos, mask=pos < n, other=float("-inf")).to(tl.float32)  # 0 or -inf
        if PDL:  # q|k|v comes from the kernel before
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        src = QKV + b * s_qkv
        k1, k2 = _rotate(tl.load(src + (H + g) * D + d), tl.load(src + (H + g) * D + D // 2 + d), KN, c, s, d, eps, D, NORM)
        v1, v2 = tl.load(src + (H + NKV + g) * D + d), tl.load(src + (H + NKV + g) * D + D // 2 + d)
        if h % (H // NKV) == 0:
            dst = KV + b * s_kvb + g * s_kvh + slot * s_kvl
            tl.store(dst + d, k1)
            tl.store(dst + D // 2 + d, k2)
            tl.store(dst + s_kvc + d, v1)
            tl.store(dst + s_kvc + D // 2 + d, v2)
        k_new = tl.reshape(tl.permute(tl.join(k1, k2), (1, 0)), (D,))[None, :]  # halves joined: [1, D]
        v_new = tl.reshape(tl.permute(tl.join(v1, v2), (1, 0)), (D,))[None, :]
        q1, q2 = _rotate(tl.load(src + h * D + d), tl.load(src + h * D + D // 2 + d), QN, c, s, d, eps, D, NORM)
        q = tl.reshape(tl.permute(tl.join(q1, q2), (1, 0)), (D,)).to(tl.float32)  # [D]
        m = tl.full((), float("-inf"), tl.float32)  # running max of the scores
        den = tl.full((), 0.0, tl.float32)  # running sum of exp(score - m)
        acc = tl.zeros((D,), tl.float32)  # running sum of exp(score - m) v
        for _ in range(0, n, BL):
            new = (pos == slot)[:, None]
            sc = tl.sum(tl.where(new, k_new, k).to(tl.float32) * q[None, :], 1) * scale + bias  # [BL]
            m_new = tl.maximum(m, tl.max(sc, 0))
            ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # (a block the row masks whole: no -inf - -inf)
            # one block (the seed's cache): alpha 0, den and acc that block's sums, exactly
            alpha = tl.exp(m - ref)
            p = tl.exp(sc - ref)
            den = den * alpha + tl.sum(p, 0)
            acc = acc * alpha + tl.sum(p[:, None] * tl.where(new, v_new, v).to(tl.float32), 0)
            m = m_new
            pos += BL  # the next block
            old = ((pos < n) & (pos != slot))[:, None]
            k = tl.load(base + pos[:, None] * s_kvl, mask=old, other=0.0)
            v = tl.load(base + s_kvc + pos[:, None] * s_kvl, mask=old, other=0.0)
            bias = tl.load(MASK + b * s_mb + pos, mask=pos < n, other=float("-inf")).to(tl.float32)
        tl.store(O + b * H * D + h * D + rd, (acc / den).to(O.dtype.element_ty))


    @triton.jit
    def _rope_attention_kv(QKV, COS, SIN, QN, KN, KV, SLOT, MASK, O, scale, eps, L, s_qkv, s_cos, s_kvc, s_kvb,
                           s_kvh, s_kvl, s_mb, H: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr,
                           BL: tl.constexpr, GP: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
        # program (b, g): kv head g of row b and its G = H // NKV query heads, the rows of a [GP, D]
        # tile (G padded to tl.dot's 16): what _rope_attention does, with the scores and the weighted
        # sum of V as tensor-core products, so each kv head's cache is read once (many rows: the
        # cache, not the launch, is the cost). Q K^T from the compute dtype into fp32, P rounded to
        # the compute dtype for P V (as flash attention rounds it); the new position's score and
        # value from registers, outside the products
        b, g = tl.program_id(0), tl.program_id(1)
        G: tl.constexpr = H // NKV
        d, rl, rd, rg = tl.arange(0, D // 2), tl.arange(0, BL), tl.arange(0, D), tl.arange(0, GP)
        slot = tl.load(SLOT)  # (the loads that need nothing from the kernel before, as in _rope_attention;
        n = tl.minimum(slot + 1, L)  # the cache's blocks come in the loop, where Triton pipelines them)
        c = tl.load(COS + b * s_cos + d).to(tl.float32)
        s = tl.load(SIN + b * s_cos + d).to(tl.float32)
        base = KV + b * s_kvb + g * s_kvh + rd[None, :]
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        src = QKV + b * s_qkv
        k1, k2 = _rotate(tl.load(src + (H + g) * D + d), tl.load(src + (H + g) * D + D // 2 + d), KN, c, s, d, eps, D, NORM)
        v1, v2 = tl.load(src + (H + NKV + g) * D + d), tl.load(src + (H + NKV + g) * D + D // 2 + d)
        dst = KV + b * s_kvb + g * s_kvh + slot * s_kvl
        tl.store(dst + d, k1)
        tl.store(dst + D // 2 + d, k2)
        tl.store(dst + s_kvc + d, v1)
        tl.store(dst + s_kvc + D // 2 + d, v2)
        k_new = tl.reshape(tl.permute(tl.join(k1, k2), (1, 0)), (D,))[None, :]  # [1, D]
        v_new = tl.reshape(tl.permute(tl.join(v1, v2), (1, 0)), (D,))[None, :]
        qm = (rg < G)[:, None]  # [GP, 1]
        qh = src + (g * G + rg)[:, None] * D + d[None, :]  # [GP, D // 2]: the first halves of the group's heads
        q1, q2 = _rotate(tl.load(qh, mask=qm, other=0.0), tl.load(qh + D // 2, mask=qm, other=0.0), QN,
                         c[None, :], s[None, :], d, eps, D, NORM)
        q = tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), (GP, D))  # [GP, D], the compute dtype
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * scale  # [GP] the new position's scores
        m = tl.full((GP,), float("-inf"), tl.float32)
        den = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, D), tl.float32)
        for start in range(0, n, BL):  # (the loads feed the products directly, so that Triton pipelines them)
            pos = start + rl
            old = (pos < n) & (pos != slot)
            k = tl.load(base + pos[:, None] * s_kvl, mask=old[:, None], other=0.0)  # [BL, D]
            v = tl.load(base + s_kvc + pos[:, None] * s_kvl, mask=old[:, None], other=0.0)
            bias = tl.load(MASK + b * s_mb + pos, mask=pos < n, other=float("-inf")).to(tl.float32)
            new = (pos == slot)[None, :]  # [1, BL]
            sc = tl.where(new, s_new[:, None], tl.dot(q, tl.trans(k)) * scale) + bias[None, :]  # [GP, BL] fp32
            m_new = tl.maximum(m, tl.max(sc, 1))
            ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - ref)
            p = tl.exp(sc - ref[:, None])
            den = den * alpha + tl.sum(p, 1)
            pv = tl.dot(p.to(v.dtype), v) + tl.sum(tl.where(new, p, 0.0), 1)[:, None] * v_new.to(tl.float32)
            acc = acc * alpha[:, None] + pv
            m = m_new
        tl.store(O + b * H * D + (g * G + rg)[:, None] * D + rd[None, :], (acc / den[:, None]).to(O.dtype.element_ty),
                 mask=qm)


def usable(T: int, mask: torch.Tensor, dtype, device, D: int) -> bool:
    """Whether `rope_attention` serves this attention: one new token per row (T == 1), the additive
    float mask decoder.forward makes on CUDA, Triton on CUDA, a 16-bit dtype and a power-of-two head
    dim (any cache length: it loops over the cache in blocks)."""
    return (ATTENTION and T == 1 and mask.is_floating_point() and triton is not None
            and torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16) and D & (D - 1) == 0)


@torch.library.custom_op("opd::rope_attention", mutates_args=("kv",))
def rope_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor | None,
                   k_norm: torch.Tensor | None, kv: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor,
                   n_heads: int, n_kv: int, eps: float) -> torch.Tensor:
    """`rope_cache` and SDPA for one new token per row in one kernel: the inputs of `rope_cache`
    plus mask [B, 1, 1, L], additive (0 attended, -inf not; every row attends at least its new
    position, and no row any position after it: the decode step's causal mask, so the kernel reads
    the cache only up to the slot). Writes the new K and V into kv as `rope_cache` does and returns
    the attention output [B, H * D], where SDPA (cuDNN) and the rotary took a kernel each, SDPA's
    far longer per layer at batch 4 than its bytes need. Up to ATTN_KV_ROWS rows a program per
    query head (_rope_attention); past them a program per kv head with tensor-core products
    (_rope_attention_kv; docs/architecture.md, "Fused decode projections")."""
    B = qkv.shape[0]
    D = qkv.shape[1] // (n_heads + 2 * n_kv)
    L = kv.shape[3]
    torch._check(mask.dtype.is_floating_point and mask.shape[-1] == L, lambda: "rope_attention: additive mask [B, 1, 1, L]")
    # read as dense rows, before the PDL wait: a copy made here would be a kernel launched right
    # before this one, whose output it would read before waiting for it
    torch._check(mask.is_contiguous() and cos.is_contiguous() and sin.is_contiguous() and kv.stride(-1) == 1,
                 lambda: "rope_attention: mask [B, 1, 1, L], cos/sin [B, ..., D] and kv's rows must be contiguous")
    m, cos, sin = mask.reshape(B, L), cos.reshape(B, D), sin.reshape(B, D)
    qkv = qkv.contiguous()  # (read after the wait)
    out = torch.empty((B, n_heads * D), dtype=qkv.dtype, device=qkv.device)
    args = (qkv, cos, sin, q_norm if q_norm is not None else qkv, k_norm if k_norm is not None else qkv, kv, slots, m,
            out, D ** -0.5, eps, L, qkv.stride(0), cos.stride(0), kv.stride(0), kv.stride(1), kv.stride(2),
            kv.stride(3), m.stride(0))
    p = pdl(qkv.device)
    if B > ATTN_KV_ROWS:  # a program per kv head, tensor-core products
        BL = min(max(16, triton.next_power_of_2(L)), ATTN_KV_BLOCK)
        _rope_attention_kv[(B, n_kv)](*args, H=n_heads, NKV=n_kv, D=D, BL=BL,
                                      GP=max(16, triton.next_power_of_2(n_heads // n_kv)), NORM=q_norm is not None,
                                      PDL=p, num_warps=4, num_stages=ATTN_KV_STAGES, enable_fp_fusion=FP_FUSION,
                                      launch_pdl=p)
        return out
    BL = min(triton.next_power_of_2(L), max(16, ATTN_TILE // D))  # cache positions per block
    _rope_attention[(B, n_heads)](*args, H=n_heads, NKV=n_kv, D=D, BL=BL, NORM=q_norm is not None, PDL=p,
                                  num_warps=4 if BL * D <= 8192 else 8, enable_fp_fusion=FP_FUSION, launch_pdl=p)
    return out


@rope_attention.register_fake
def _(qkv, cos, sin, q_norm, k_norm, kv, slots, mask, n_heads, n_kv, eps):
    return qkv.new_empty((qkv.shape[0], qkv.shape[1] // (n_heads + 2 * n_kv) * n_heads))
