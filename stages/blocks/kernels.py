"""Fused projection kernels (Triton) for the decode step of small batches (docs/architecture.md,
"Rollout engine: fused decode projections").

A decode step multiplies B <= 16 rows by each weight matrix: the work is reading the weights once,
and at these sizes cuBLAS launches tiles that read them far below the memory's rate (~6 us for a
3 MB matrix on the H200, where 4.8 TB/s would take 0.6). `project` issues every load of a CTA's
whole slab of weight rows at once (all of the matrix is in flight together) and folds into the
same kernel what otherwise costs kernels of its own around the matmul:

- the RMSNorm before it (`norm_w`): the row statistics are computed from the rows it loads anyway;
- the SiLU gate after gate|up (`glu`): the CTA reads a gate row block and the matching up rows;
- the residual add after o_proj and down_proj (`resid`), and a bias.

Rounding follows the eager decode layer (decoder.layer): RMSNorm in fp32 rounded to the compute
dtype, then scaled by its weight in that dtype; the matmul accumulates in fp32 and is rounded once;
silu(gate) and its product with up are rounded as eager rounds them; the residual add is done on the
rounded product (except with glu and resid together, which the decoder never asks for: Triton's FP
fusion makes product and add one bf16 FMA there, one rounding; tests/kernel_cases.py). Each output
element is reduced by one program in a fixed order: deterministic.

A torch custom op (`opd::project`), so that torch.compile keeps it whole inside the compiled decode
layer and CUDA graph capture records its launch. Without Triton (CPU builds of torch) `usable` is
false and the decoder keeps its cuBLAS path.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch ship no Triton
    triton = None

MAX_ROWS = 16  # rows (batch x new tokens) up to which the decode step takes these kernels
# One warp per program holding 2,048 weight elements (a row block of SLAB // padded K rows, at least
# one row) measured fastest on the H200 at SmolLM2-360M's decode step: 1.268 ms against 1.324 with
# four warps and 4,096, 1.368 with four and 8,192, and cuBLAS's 1.352 (benchmarks/results/
# 2026-12-02-h200-0a4faaf-decode-kernels-sweep.md): one warp reduces its rows with shuffles alone,
# no shared memory or barrier, and many small programs keep more loads in flight.
SLAB = 2048
# Triton's FP fusion (mul + add as one FMA) changes bytes, and its default is to flip in Triton 3.10
# (TRITON_DEFAULT_FP_FUSION changes it today): pinned, as every measurement so far ran it (on).
FP_FUSION = True
ATTENTION = True  # rope_attention for the decode step's attention; False: rope_cache + SDPA (decode_kernels ':sdpa')
# Cache positions x head dim that one rope_attention program holds per block (K and V each): the
# seed's whole cache (256 x 64) in one block, Qwen3's 128-dim heads 128 positions at a time.
ATTN_TILE = 16384
# Past this many rows, rope_attention runs a program per row and kv head instead (_rope_attention_kv:
# its query heads together, tensor-core products, the cache read once), ATTN_KV_BLOCK positions at a
# time: at workload b's 64 rows the per-query-head kernel took 150 us per layer where cuDNN's SDPA
# took 45 over the whole cache (results/2026-12-02-h200-387c904-decode-profile-b.md).
ATTN_KV_ROWS = 16
ATTN_KV_BLOCK = 64
ATTN_KV_STAGES = 3  # blocks of the cache in flight per program (Triton's software pipelining of the loop)
WARPS = None  # warps per program; None: one, and one more per 4,096 elements past that (wide K)
# Programmatic dependent launch (Hopper and later, `pdl`): each kernel of the decode layer is launched
# while the one before it still runs, issues the loads that do not depend on it (the weights: nothing
# in a decode step writes them), then waits for it (griddepcontrol.wait) before reading activations.
# False: plain launches (benchmarks/decode_kernels.py ':nopdl').
PDL = True


def pdl(device) -> bool:
    """Whether launches on `device` take programmatic dependent launch: PDL on and compute capability
    9.0 or later (griddepcontrol is a Hopper instruction; older GPUs launch plainly).

    Safe because every kernel of ours launched so waits (gdc_wait) before it reads anything the
    kernel before it writes, and before it writes anything, and lets its successor launch only after
    that wait: a kernel then starts only once everything before its predecessor has completed, and
    its own stores land after its predecessor's. So before its wait a kernel may read what was
    written before its predecessor: the weights, the KV cache's earlier rows, the step's mask and
    rotary tables (tensors alive for the whole step, so the graph's pool never hands their memory
    to a predecessor's output). Torch's kernels between ours launch plainly (they wait for full
    completion, as always)."""
    return PDL and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def usable(rows: int, dtype, device, act) -> bool:
    """Whether these kernels serve a decode layer over `rows` rows (batch x new tokens)."""
    return (triton is not None and torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and rows <= MAX_ROWS and act is torch.nn.functional.silu)


if triton is not None:
    @triton.jit
    def _project(X, NW, W, BIAS, R, Y, M, N, K, eps, sx, sy, sr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KP: tl.constexpr,
                 NORM: tl.constexpr, GLU: tl.constexpr, HAS_BIAS: tl.constexpr, RESID: tl.constexpr,
                 PDL: tl.constexpr):
        # program: output columns [n0, n0 + BLOCK_N) of every row; W [N (x2 with GLU), K] row-major
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        rk = tl.arange(0, KP)  # [KP], K padded to a power of two (masked lanes fetch nothing)
        nm, km = rn < N, rk < K
        wm = nm[:, None] & km[None, :]
        w = tl.load(W + rn[:, None] * K + rk[None, :], mask=wm, other=0.0).to(tl.float32)  # [BLOCK_N, KP]
        if GLU:  # the up rows matching these gate rows
            w2 = tl.load(W + (rn + N)[:, None] * K + rk[None, :], mask=wm, other=0.0).to(tl.float32)
        if NORM:
            nw = tl.load(NW + rk, mask=km, other=0.0).to(tl.float32)
        if HAS_BIAS:
            b = tl.load(BIAS + rn, mask=nm, other=0.0).to(tl.float32)
            if GLU:
                b2 = tl.load(BIAS + N + rn, mask=nm, other=0.0).to(tl.float32)
        if PDL:  # the weights above are loaded while the kernel before still runs; x and resid after it
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        # each row loaded, reduced and stored in turn: this measured faster than loading every row up
        # front as one tile and taking rows out of it by masked sums across lanes (1.207 ms per decode
        # step against 1.240 on the H200, results/2026-12-02-h200-438257d-decode-kernels.log)
        for m in tl.static_range(BLOCK_M):
            if m < M:  # (BLOCK_M: M rounded up to a power of two)
                xr = tl.load(X + m * sx + rk, mask=km, other=0.0)  # [KP], the compute dtype
                dt = xr.dtype
                if NORM:  # w * rms_norm(x): fp32 statistics, normalised row rounded, scaled in dtype
                    xf = xr.to(tl.float32)
                    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / K + eps)
                    xr = ((xf * rstd).to(dt).to(tl.float32) * nw).to(dt)
                xf = xr.to(tl.float32)
                y = tl.sum(w * xf[None, :], 1)  # [BLOCK_N] fp32
                if HAS_BIAS:
                    y += b
                y = y.to(dt)
                if GLU:
                    u = tl.sum(w2 * xf[None, :], 1)
                    if HAS_BIAS:
                        u += b2
                    g = y.to(tl.float32)
                    s = (g / (1.0 + tl.exp(-g))).to(dt)  # silu(gate), rounded as eager rounds it
                    y = (s.to(tl.float32) * u.to(dt).to(tl.float32)).to(dt)
                if RESID:
                    r = tl.load(R + m * sr + rn, mask=nm, other=0.0)
                    y = (r.to(tl.float32) + y.to(tl.float32)).to(dt)
                tl.store(Y + m * sy + rn, y, mask=nm)


    @triton.jit
    def _rotate(x1, x2, NW, c, s, d, eps, D: tl.constexpr, NORM: tl.constexpr):
        """One head's halves x1, x2 [D // 2] (compute dtype; or several heads', [G, D // 2]): Qwen3's
        RMSNorm with weight NW (fp32 statistics, normalised row rounded, scaled in the dtype), then
        rotary with c, s [D // 2] (fp32) in fp32, rounded once (as compiled)."""
        dt = x1.dtype
        if NORM:
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            rstd = tl.rsqrt((tl.sum(f1 * f1, -1, keep_dims=True) + tl.sum(f2 * f2, -1, keep_dims=True)) / D + eps)
            x1 = ((f1 * rstd).to(dt).to(tl.float32) * tl.load(NW + d).to(tl.float32)).to(dt)
            x2 = ((f2 * rstd).to(dt).to(tl.float32) * tl.load(NW + D // 2 + d).to(tl.float32)).to(dt)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        return (f1 * c - f2 * s).to(dt), (f2 * c + f1 * s).to(dt)


    @triton.jit
    def _rope_cache(QKV, COS, SIN, QN, KN, Q, KV, SLOT, eps, s_qkv, s_cos, s_kvc, s_kvb, s_kvh, s_kvl,
                    H: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
        # program (b, j): head j of row b's q|k|v [B, (H + 2 NKV) * D]; q heads -> Q [B, H, D],
        # k and v heads -> KV [2, B, NKV, L, D] at the slot SLOT holds (a device scalar: no sync)
        b, j = tl.program_id(0), tl.program_id(1)
        d = tl.arange(0, D // 2)
        if PDL:  # (everything it reads may come from the kernel before: nothing to load ahead)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        src = QKV + b * s_qkv + j * D
        x1, x2 = tl.load(src + d), tl.load(src + D // 2 + d)  # the head's two halves
        slot = tl.load(SLOT)
        if j < H + NKV:  # q or k
            c = tl.load(COS + b * s_cos + d).to(tl.float32)  # cos/sin [B, D]: both halves alike
            s = tl.load(SIN + b * s_cos + d).to(tl.float32)
            y1, y2 = _rotate(x1, x2, QN if j < H else KN, c, s, d, eps, D, NORM)
            if j < H:
                tl.store(Q + (b * H + j) * D + d, y1)
                tl.store(Q + (b * H + j) * D + D // 2 + d, y2)
            else:
                dst = KV + b * s_kvb + (j - H) * s_kvh + slot * s_kvl
                tl.store(dst + d, y1)
                tl.store(dst + D // 2 + d, y2)
        else:  # v: into the cache as it is
            dst = KV + s_kvc + b * s_kvb + (j - H - NKV) * s_kvh + slot * s_kvl
            tl.store(dst + d, x1)
            tl.store(dst + D // 2 + d, x2)


    @triton.jit
    def _rope_attention(QKV, COS, SIN, QN, KN, KV, SLOT, MASK, O, scale, eps, L, s_qkv, s_cos, s_kvc, s_kvb,
                        s_kvh, s_kvl, s_mb, H: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr,
                        BL: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
        # program (b, h): query head h of row b and the kv head g it reads (one program per query head:
        # 0.909 ms per seed decode step against 1.019 with one per kv head looping over its query heads,
        # results/2026-12-02-h200-7abd5a7-decode-kernels.md). The new key (normed,
        # rotated) and value stand in for that row of the cache block read here (so no store has to
        # be visible to a load), and the first program of each kv head writes them into
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


@torch.library.custom_op("opd::project", mutates_args=())
def project(x: torch.Tensor, w: torch.Tensor, norm_w: torch.Tensor | None, bias: torch.Tensor | None,
            resid: torch.Tensor | None, eps: float, glu: bool) -> torch.Tensor:
    """y [M, N] = resid + epilogue(rmsnorm(x) @ w.T + bias), x [M, K] contiguous rows, w [N or 2N, K]
    contiguous. norm_w: RMSNorm weight [K] applied to x first (None: x as it is); glu: w is gate|up
    stacked, y = silu(gate) * up; resid [M, N] added last (None: nothing)."""
    M, K = x.shape
    N = w.shape[0] // 2 if glu else w.shape[0]
    # the kernel reads w, bias and norm_w as dense rows (in a CUDA graph these run at capture only)
    torch._check(w.dim() == 2 and w.shape[1] == K and w.is_contiguous(), lambda: "project: w must be [N, K], contiguous")
    for t, n in ((norm_w, K), (bias, w.shape[0])):
        torch._check(t is None or (t.shape == (n,) and t.is_contiguous()), lambda: "project: norm_w [K] / bias [w rows]")
    torch._check(resid is None or tuple(resid.shape) == (M, N), lambda: "project: resid must be [M, N]")
    x = x.contiguous()
    resid = None if resid is None else resid.contiguous()
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    KP = triton.next_power_of_2(K)
    per = SLAB // (2 if glu else 1)  # (read at each launch: benchmarks/decode_kernels.py varies it)
    block_n = max(1, min(64, per // KP))
    block_n = 1 << (block_n.bit_length() - 1)  # a power of two
    dummy = x  # (pointer arguments a flag leaves unread)
    _project[(triton.cdiv(N, block_n),)](
        x, norm_w if norm_w is not None else dummy, w, bias if bias is not None else dummy,
        resid if resid is not None else dummy, out, M, N, K, eps,
        x.stride(0), out.stride(0), resid.stride(0) if resid is not None else 0,
        BLOCK_M=triton.next_power_of_2(M), BLOCK_N=block_n, KP=KP,
        NORM=norm_w is not None, GLU=glu, HAS_BIAS=bias is not None, RESID=resid is not None,
        PDL=(p := pdl(x.device)), num_warps=WARPS or max(1, block_n * KP * (2 if glu else 1) // 4096),
        enable_fp_fusion=FP_FUSION, launch_pdl=p)
    return out


@project.register_fake
def _(x, w, norm_w, bias, resid, eps, glu):
    return x.new_empty((x.shape[0], w.shape[0] // 2 if glu else w.shape[0]))


@torch.library.custom_op("opd::rope_cache", mutates_args=("kv",))
def rope_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor | None,
               k_norm: torch.Tensor | None, kv: torch.Tensor, slots: torch.Tensor, n_heads: int, n_kv: int,
               eps: float) -> torch.Tensor:
    """A decode step's attention inputs, one new token per row: qkv [B, (H + 2 KV) * D] contiguous
    (the q|k|v projection), cos/sin [B, D] (rotary tables of the rows' positions), q_norm/k_norm [D]
    or None (Qwen3's per-head RMSNorm, before rotary); writes the rotated k and the v of every row
    into kv [2, B, KV, L, D] (one layer's cache, contiguous in D) at slots [1] (the slot, on the
    device) and returns the rotated q [B, H, 1, D]. What `decoder.attend` does before SDPA, in one kernel."""
    B = qkv.shape[0]
    D = qkv.shape[1] // (n_heads + 2 * n_kv)
    q = torch.empty((B, n_heads, 1, D), dtype=qkv.dtype, device=qkv.device)
    cos, sin = cos.reshape(B, D), sin.reshape(B, D)
    _rope_cache[(B, n_heads + 2 * n_kv)](
        qkv, cos, sin, q_norm if q_norm is not None else qkv, k_norm if k_norm is not None else qkv, q, kv, slots,
        eps, qkv.stride(0), cos.stride(0), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        H=n_heads, NKV=n_kv, D=D, NORM=q_norm is not None, PDL=(p := pdl(qkv.device)), num_warps=1,
        enable_fp_fusion=FP_FUSION, launch_pdl=p)
    return q


@rope_cache.register_fake
def _(qkv, cos, sin, q_norm, k_norm, kv, slots, n_heads, n_kv, eps):
    return qkv.new_empty((qkv.shape[0], n_heads, 1, qkv.shape[1] // (n_heads + 2 * n_kv)))


def attention_usable(dtype, device, D: int) -> bool:
    """Whether `rope_attention` serves a decode step's attention: Triton on CUDA, a 16-bit dtype and a
    power-of-two head dim (any cache length: it loops over the cache in blocks)."""
    return (ATTENTION and triton is not None and torch.device(device).type == "cuda"
            and dtype in (torch.bfloat16, torch.float16) and D & (D - 1) == 0)


@torch.library.custom_op("opd::rope_attention", mutates_args=("kv",))
def rope_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor | None,
                   k_norm: torch.Tensor | None, kv: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor,
                   n_heads: int, n_kv: int, eps: float) -> torch.Tensor:
    """`rope_cache` and SDPA for one new token per row in one kernel: the inputs of `rope_cache`
    plus mask [B, 1, 1, L], additive (0 attended, -inf not; every row attends at least its new
    position, and no row any position after it: the decode step's causal mask, so the kernel reads
    the cache only up to the slot). Writes the new K and V into kv as `rope_cache` does and returns
    the attention output [B, H * D]. SDPA (cuDNN) took ~6 us per layer at batch 4 on the H200
    (2026-12-01 profile), and the rotary a kernel of its own. Up to ATTN_KV_ROWS rows a program per
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
