"""Fused projection kernels (Triton) for the decode step of small batches (docs/architecture.md,
"Rollout engine: fused decode projections").

A decode step multiplies B <= 16 rows by each weight matrix: the work is reading the weights once,
and at these sizes cuBLAS launches tiles that read them far below the memory's rate. `project`
issues every load of a CTA's whole slab of weight rows at once (all of the matrix is in flight
together) and folds into the same kernel what otherwise costs kernels of its own around the matmul:

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
# one row) measured fastest at SmolLM2-360M's decode step, ahead of four warps with 4,096 or 8,192
# and of cuBLAS (docs/performance.md): one warp reduces its rows with shuffles alone, no shared
# memory or barrier, and many small programs keep more loads in flight.
SLAB = 2048
# Triton's FP fusion (mul + add as one FMA) changes bytes, and its default is to flip in Triton 3.10
# (TRITON_DEFAULT_FP_FUSION changes it today): pinned, as every measurement so far ran it (on).
FP_FUSION = True
WARPS = None  # warps per program; None: one, and one more per 4,096 elements past that (wide K)
# Programmatic dependent launch (Hopper and later, `pdl`): each kernel of the decode layer is launched
# while the one before it still runs, issues the loads that do not depend on it (the weights: nothing
# in a decode step writes them), then waits for it (griddepcontrol.wait) before reading activations.
# False: plain launches (benchmarks/decode_kernels.py ':nopdl').
PDL = True


def cache_key_soon():
    """Start computing Triton's cache key on a daemon thread. Triton keys its kernel cache on a hash of
    its own sources and its ~500 MB libtriton.so, computed (once per process, cached) at the first
    kernel launch, on the launching thread, where it held up the first rollout (docs/performance.md).
    Reading and sha256 release the
    interpreter, so it runs beside the models' loads; the launch then finds it cached (or, still
    running, computes it as before). Returns the thread (None without Triton)."""
    if triton is None:
        return None
    import threading

    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # (a Triton that keys its cache otherwise)
        return None

    def run() -> None:
        try:
            triton_key()
        except Exception:  # noqa: BLE001  only a head start: the first launch computes it itself
            pass

    t = threading.Thread(target=run, name="opd-triton-key", daemon=True)
    t.start()
    return t


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
        # front as one tile and taking rows out of it by masked sums across lanes (docs/performance.md)
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

else:  # (decode_attention.py imports the name whether or not Triton is there)
    _rotate = None


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
