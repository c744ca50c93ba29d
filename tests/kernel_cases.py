"""Cases for stages/engine/kernels.py's `project`, shared by the CPU test (Triton's interpreter, fp16,
tests/engine/test_kernels.py) and the GPU test (bf16, tests/gpu/test_gpu_kernels.py).

The reference takes the kernel's own rounding steps (normalised row, its product with the norm
weight, the matmul's one rounding, silu(gate), its product with up, the residual add) with the
matmul in fp64. What is left to differ, per output, bounded from first principles (eps = one ulp at
1.0 of the compute dtype: 2**-7 bf16, 2**-10 fp16; S = |h| @ |w|.T, the sum of absolute terms):
- the kernel's fp32 accumulation order: at most K * 2**-24 * S before rounding;
- with a norm, the row statistic: both sides sum K positive squares in fp32 by a tree (the
  kernel's tl.sum, torch's reduction; each within log2(K) * 2**-24 of the exact sum, relatively) and
  take an approximate reciprocal square root (within 2**-22 each): the kernel's rstd is within
  delta = log2(K) * 2**-24 + 2**-21 of the reference's, relatively (the square root halves the sum's
  error). The normalised row is monotone in rstd, so it lies between the rows made with
  rstd * (1 - delta) and rstd * (1 + delta): their difference |h_hi - h_lo| @ |w|.T bounds the sum;
- the sum's rounding may then land one ulp away (eps * |y|), and silu(gate) * up and the residual
  add propagate those (their own roundings add one ulp each), plus one subnormal step.
Most outputs must come out identical: a kernel that indexes or rounds wrongly differs almost
everywhere, while a sum flips a rounding with a probability of about its typical order error over
an ulp, sqrt(K) * 2**-24 * S / (eps * |y|) (~3% at K = 2,560 in bf16, where S ~ 40 |y|), and a row
statistic a few fp32 ulps away moves a normalised element across a rounding boundary rarely (but
then every output of that row by a little): at most 5% of a case's outputs may differ without a
norm, 5% over all cases with one. The exception is glu+bias+resid, which the decoder never uses: on
the H200 it differed more often (device run at 0a4faaf) because Triton's default FP fusion makes
silu(gate) * up, rounded, plus the residual one `fma.rn.bf16`, one rounding where eager rounds twice
(read in the PTX Triton 3.9 compiles for sm_90 here, without a GPU; no bf16 FMA without GLU or
without a residual). It stays within the bound, which covers either rounding.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

GPU_SHAPES = [(1, 96, 40), (3, 960, 1600), (4, 960, 960), (4, 2560, 960), (16, 1024, 3072), (5, 3072, 1024)]
CPU_SHAPES = [(1, 96, 40), (4, 1000, 40), (5, 300, 24), (2, 2600, 24)]  # (the interpreter: small, several programs each)


def reference(x, w, norm_w, bias, resid, eps, glu):
    """(the kernel's output computed with an fp64 matmul, the per-element bound on the difference)."""
    dt, K = x.dtype, x.shape[1]
    ulp = torch.finfo(dt).eps
    h, En = x, 0.0
    if norm_w is not None:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)

        def normed(r):
            return ((xf * r).to(dt).float() * norm_w.float()).to(dt)
        h = normed(rstd)
        delta = math.log2(K) * 2.0 ** -24 + 2.0 ** -21
        En = (normed(rstd * (1 + delta)).double() - normed(rstd * (1 - delta)).double()).abs() @ w.double().abs().T
    y = h.double() @ w.double().T
    S = h.double().abs() @ w.double().abs().T
    E = K * 2.0 ** -24 * S + En  # before rounding
    if bias is not None:
        y = y + bias.double()
    y = y.to(dt).double()
    E = E + ulp * y.abs()  # the rounding, one ulp either way
    if glu:
        (g, u), (Eg, Eu) = y.chunk(2, dim=-1), E.chunk(2, dim=-1)
        s = F.silu(g.float()).to(dt).double()
        Es = 1.1 * Eg + ulp * s.abs()  # |silu'| <= 1.1
        y = (s * u).to(dt).double()
        E = u.abs() * Es + s.abs() * Eu + ulp * y.abs()
    if resid is not None:
        y = (resid.double() + y).to(dt).double()
        E = E + ulp * y.abs()
    return y, E + torch.finfo(dt).smallest_normal * ulp


def cases(device: str, dtype, shapes, seed: int = 0):
    """(label, args of project) over the shapes and every flag combination the decoder uses."""
    g = torch.Generator().manual_seed(seed)

    def t(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    for M, K, N in shapes:
        x = t(M, K)
        w = t(2 * N, K, scale=K ** -0.5)
        nw = (1 + 0.5 * torch.randn(K, generator=g)).to(device, dtype)
        b = t(2 * N, scale=0.1)
        r = t(M, N)
        yield f"{M}x{K}x{N} plain", (x, w[:N].contiguous(), None, None, None, 1e-5, False)
        yield f"{M}x{K}x{N} norm+bias", (x, w[:N].contiguous(), nw, b[:N].contiguous(), None, 1e-6, False)
        yield f"{M}x{K}x{N} resid", (x, w[:N].contiguous(), None, None, r, 1e-5, False)
        yield f"{M}x{K}x{N} norm+glu", (x, w, nw, None, None, 1e-5, True)
        yield f"{M}x{K}x{N} glu+bias+resid", (x, w, None, b, r, 1e-5, True)


def check(project, device: str, dtype, shapes, seed: int = 0) -> dict:
    """Every case through `project` against `reference`: {label: (largest difference over its bound,
    share of elements that differ at all)}, the share over every case but glu+bias+resid, and the
    labels of the cases that fail: over the bound, or (without a norm) more than 5% differing."""
    out, bad, n, differing = {}, [], 0, 0
    for label, args in cases(device, dtype, shapes, seed):
        got = project(*args).double()
        ref, bound = reference(*args)
        excess = float(((got - ref).abs() - bound).max())
        differ = float((got != ref).double().mean())
        out[label] = (excess, differ)
        fma = args[6] and args[4] is not None  # glu with a residual: the fused bf16 FMA (above)
        if not fma:
            n, differing = n + got.numel(), differing + int((got != ref).sum())
        if excess > 0 or (differ > 0.05 and args[2] is None and not fma) or not torch.isfinite(got).all():
            bad.append(label)
    return {"cases": out, "share": differing / n, "bad": bad}
