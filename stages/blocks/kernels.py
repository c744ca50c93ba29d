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
WARPS = None  # warps per program; None: one, and one more per 4,096 elements past that (wide K)


def usable(x: torch.Tensor, act) -> bool:
    """Whether `project` serves this decode layer input x [B, T, hidden] (decided at trace time)."""
    return (triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and x.shape[0] * x.shape[1] <= MAX_ROWS and act is torch.nn.functional.silu)


if triton is not None:
    @triton.jit
    def _project(X, NW, W, BIAS, R, Y, M, N, K, eps, sx, sy, sr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KP: tl.constexpr,
                 NORM: tl.constexpr, GLU: tl.constexpr, HAS_BIAS: tl.constexpr, RESID: tl.constexpr):
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
        for m in tl.static_range(BLOCK_M):
            if m < M:
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


def _launch(x, w, norm_w, bias, resid, eps, glu, out):
    M, K = x.shape
    N = w.shape[0] // 2 if glu else w.shape[0]
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
        num_warps=WARPS or max(1, block_n * KP * (2 if glu else 1) // 4096))


@torch.library.custom_op("opd::project", mutates_args=())
def project(x: torch.Tensor, w: torch.Tensor, norm_w: torch.Tensor | None, bias: torch.Tensor | None,
            resid: torch.Tensor | None, eps: float, glu: bool) -> torch.Tensor:
    """y [M, N] = resid + epilogue(rmsnorm(x) @ w.T + bias), x [M, K] contiguous rows, w [N or 2N, K]
    contiguous. norm_w: RMSNorm weight [K] applied to x first (None: x as it is); glu: w is gate|up
    stacked, y = silu(gate) * up; resid [M, N] added last (None: nothing)."""
    M = x.shape[0]
    N = w.shape[0] // 2 if glu else w.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    _launch(x.contiguous(), w, norm_w, bias, None if resid is None else resid.contiguous(), eps, glu, out)
    return out


@project.register_fake
def _(x, w, norm_w, bias, resid, eps, glu):
    return x.new_empty((x.shape[0], w.shape[0] // 2 if glu else w.shape[0]))
