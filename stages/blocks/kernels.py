"""Hand-written Triton kernels for the rollout engine's decode step (docs/architecture.md, rollout
engine). Imported only where Triton is (CUDA); `available()` says whether it is.

skinny_linear: y [M, N] = x [M, K] @ w [N, K]^T (+ bias) for the few rows of a decode step
(M = the batch, <= 16). cuBLAS picks tensor-core tiles sized for many rows there and reads the
weight at a fraction of the bandwidth (H200, seed shapes: 4.5-6.4 us per projection,
benchmarks/results/2026-12-01-h200-decode-kernels*.md). Here each program owns BN output columns
and reads their weight rows once, K in BK-wide slices: partial products accumulate elementwise in
fp32 registers [M, BN, BK] and are summed over BK once at the end. The summation order is fixed by
(BN, BK, K) alone, so every call sums the same way (no split-K atomics, no autotuning).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU wheels of torch carry no Triton: the engine keeps F.linear
    triton = None

MAX_ROWS = 16  # above this a cuBLAS tile is full enough


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


def config(M: int, N: int, K: int) -> tuple[int, int, int]:
    """(BM, BN, BK) for a problem: BM the rows padded to a power of two; BN small enough
    that the programs (N / BN) cover the GPU's SMs twice over at these widths; BK one slice."""
    BM = max(1, triton.next_power_of_2(M))
    BN = 8 if N <= 2048 else 16
    BK = 128 if BM <= 4 else 64  # registers: BM * BN * BK fp32 partials per program
    return BM, BN, BK


if triton is not None:
    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, sxm, swn, sym,
                       HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        rn = tl.program_id(0) * BN + tl.arange(0, BN)  # [BN] output columns = weight rows
        rm = tl.arange(0, BM)  # [BM]
        rk = tl.arange(0, BK)  # [BK]
        acc = tl.zeros((BM, BN, BK), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            x = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                        other=0.0).to(tl.float32)  # [BM, BK]
            w = tl.load(w_ptr + rn[:, None] * swn + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K),
                        other=0.0).to(tl.float32)  # [BN, BK]
            acc += x[:, None, :] * w[None, :, :]
        y = tl.sum(acc, axis=2)  # [BM, BN]
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * sym + rn[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    def launch(x, w, bias, y, BN: int | None = None, BK: int | None = None, warps: int = 4, wrap=False) -> None:
        """The kernel on 2-D x [M, K] (rows contiguous), w [N, K], y [M, N]; BN/BK override `config`
        (benchmarks/decode_kernels.py tries others); wrap: through torch.library.wrap_triton (inside
        the custom op, so that Inductor emits the kernel into a compiled graph)."""
        M, K = x.shape
        N = w.shape[0]
        BM, bn, bk = config(M, N, K)
        BN, BK = BN or bn, BK or bk
        kernel = torch.library.wrap_triton(_skinny_kernel) if wrap else _skinny_kernel
        kernel[(triton.cdiv(N, BN),)](x, w, bias if bias is not None else w, y, M, N, K, x.stride(0), w.stride(0),
                                      y.stride(0), HAS_BIAS=bias is not None, BM=BM, BN=BN, BK=BK, num_warps=warps)

    @torch.library.triton_op("opd::skinny_linear", mutates_args=())
    def _skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = x.new_empty((x.shape[0], w.shape[0]))
        launch(x, w, bias, y, wrap=True)
        return y


def skinny_linear(x, w, bias=None):
    """F.linear for a decode step's few rows: x [..., K] with prod(...) <= MAX_ROWS, w [N, K] contiguous."""
    lead = x.shape[:-1]
    y = torch.ops.opd.skinny_linear(x.reshape(-1, x.shape[-1]).contiguous(), w, bias)
    return y.view(*lead, w.shape[0])
