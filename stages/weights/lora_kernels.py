"""PEFT's LoRA branch as a few Triton kernels over the bf16 activations (docs/architecture.md, "The
student's LoRA on CUDA").

PEFT (0.21) adds its fp32 adapter to a bf16 projection in passes of their own, each a sweep over the
activations in fp32: `x.float()`, `lora_A`, `lora_B`, `* scaling`, `+ result`, `.to(bf16)`, and as many
again in the backward, where it also keeps the fp32 copy of x for lora_A's weight gradient. At
workload b's update that traffic is 1.34 TB more than one kernel per projection would move
(benchmarks/update_bytes.py; docs/performance.md). Here the same arithmetic, each value rounded where
PEFT rounds it:

    forward   xa = f32(x) @ A.T                         [N, r]    one read of x
              y  = dtype(f32(result) + (xa @ B.T) * s)  [N, out]  one read of result, one write
    backward  gs = f32(g) * s; gB = gs.T @ xa; gxa = gs @ B; gA = gxa.T @ f32(x); gx = dtype(gxa @ A)

(gresult = g, as PEFT's casts give it). The matmuls are fp32 (IEEE, no TF32, as PEFT's cuBLAS SGEMMs
run); only the order of their sums differs from cuBLAS's, so the values differ from PEFT's within
fp32's bounds for sums of that length (tests/weights/test_lora_kernels.py derives and checks them).
Each output element is summed in a fixed order: the products over the input width (into rank r) and the
weight gradients' sums over the rows in chunks fixed by the shapes alone (enough programs for the GPU at
a few hundred rows), the chunks' partial sums then added by torch in a fixed order: deterministic.
Triton's FP fusion is off in every launch (pinned: its default flips in Triton 3.10), so a multiply
and an add round separately, as PEFT's do.

Torch custom ops, so that CUDA graphs record their launches and meta tensors count their traffic.
Installed on CUDA only (`install`); without Triton (CPU builds of torch) `usable` is false.
"""
from __future__ import annotations

import functools

import torch

from ..run.config import LORA_KERNELS_MAX_RANK

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch ship no Triton
    triton = None

BLOCK = 64  # rows and columns per program's tile
SPLIT = 1024  # the most rows per program in the weight gradients' sums over the rows (a multiple of BLOCK)
# Programs a launch aims for: a sum is cut into chunks (each a program, partial sums added by torch) until
# there are this many. With one program per 64 rows, workload a's 768 rows made launches of 12 programs
# on the GPU's 132 SMs, and the kernels ran slower than PEFT's (docs/performance.md).
PROGRAMS = 256


def usable(layer) -> bool:
    """Whether `layer` (a PEFT LoRA Linear) computes through `forward` here: on CUDA, and `fits`."""
    return triton is not None and layer.get_base_layer().weight.is_cuda and fits(layer)


def fits(layer) -> bool:
    """A plain Linear base in half precision, one plain LoRA adapter in fp32 of rank up to
    LORA_KERNELS_MAX_RANK without dropout or bias, not merged (the kernels' arithmetic; the CPU tests
    run it through Triton's interpreter)."""
    base, names = layer.get_base_layer(), list(layer.lora_A)
    return (type(base) is torch.nn.Linear and base.weight.dtype in (torch.bfloat16, torch.float16)
            and len(names) == 1 and layer.r[names[0]] <= LORA_KERNELS_MAX_RANK and not layer.lora_variant
            and not layer.merged
            and isinstance(layer.lora_dropout[names[0]], torch.nn.Identity)
            and layer.lora_A[names[0]].weight.dtype == torch.float32 and layer.lora_B[names[0]].bias is None)


def install(model) -> int:
    """Every LoRA Linear of `model` that is `usable` computes through `forward` (bound to the module, as
    stages/weights/norms.py binds its norms). Returns how many."""
    from peft.tuners.lora.layer import Linear

    n = 0
    for m in model.modules():
        if type(m) is Linear and usable(m):
            m.forward = functools.partial(forward, m)
            n += 1
    return n


def forward(layer, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """What PEFT's `Linear.forward(x)` computes, its LoRA branch through the kernels: x [..., in] ->
    [..., out]. Adapters off or merged, a base being trained, or PEFT's extra arguments: PEFT's forward."""
    base, names = layer.get_base_layer(), layer.active_adapters
    if (layer.disable_adapters or layer.merged or not names or names[0] not in layer.lora_A or args or kwargs
            or any(p.requires_grad for p in base.parameters())):
        return type(layer).forward(layer, x, *args, **kwargs)
    name = names[0]
    return LoraLinear.apply(x, base.weight, base.bias, layer.lora_A[name].weight, layer.lora_B[name].weight,
                            float(layer.scaling[name]))


class LoraLinear(torch.autograd.Function):
    """The base Linear (frozen) and its LoRA branch through the kernels; the base's input gradient and the
    branch's are added in the branch's last kernel (rounded as autograd adds two bf16 gradients)."""
    @staticmethod
    def forward(ctx, x, w, bias, a, b, s):  # w [O, K], bias [O] or None: the base Linear's, frozen
        result = torch.nn.functional.linear(x, w, bias)  # (what the base layer computes, the same call)
        x2 = x.reshape(-1, x.shape[-1])  # [N, K]
        xa = down(x2, a)  # [N, r] f32
        y = tail(result.reshape(-1, result.shape[-1]), xa, b, s)  # [N, O]
        ctx.save_for_backward(x2, xa, a, b, w)
        ctx.s, ctx.shape = s, x.shape
        return y.view(result.shape)

    @staticmethod
    def backward(ctx, g):
        x2, xa, a, b, w = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        gx, ga, gb = grads(g2, x2, xa, a, b, ctx.s, g2 @ w)  # (g2 @ w: the base's input gradient [N, K])
        return gx.view(ctx.shape), None, None, ga, gb, None


@torch.library.custom_op("opd::lora_down", mutates_args=())
def down(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """xa [N, r] f32 = f32(x) @ a.T; x [N, K] half precision, a [r, K] f32."""
    x, a = x.contiguous(), a.contiguous()
    return _rank(x, a, 1.0, 1, x.shape[1], False)


@down.register_fake
def _(x, a):
    return x.new_empty((x.shape[0], a.shape[0]), dtype=torch.float32)


@torch.library.custom_op("opd::lora_tail", mutates_args=())
def tail(result: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, s: float) -> torch.Tensor:
    """y [N, O] = result's dtype(f32(result) + (xa @ b.T) * s); result [N, O], xa [N, r] f32, b [O, r] f32."""
    result, xa, b = result.contiguous(), xa.contiguous(), b.contiguous()
    (N, O), r = result.shape, b.shape[1]
    y = torch.empty_like(result)  # (result is contiguous here, so y is)
    _tail[(triton.cdiv(N, BLOCK), triton.cdiv(O, BLOCK))](result, xa, b, y, N, O, r, s, R=_pad(r), B=BLOCK,
                                                          enable_fp_fusion=False)
    return y


@tail.register_fake
def _(result, xa, b, s):
    return torch.empty_like(result, memory_format=torch.contiguous_format)


@torch.library.custom_op("opd::lora_grads", mutates_args=())
def grads(g: torch.Tensor, x: torch.Tensor, xa: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
          s: float, base: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The LoRA branch's backward, g [N, O] the output's gradient: (gx [N, K] in x's dtype, ga [r, K] f32,
    gb [O, r] f32); x [N, K], xa [N, r] f32 (the forward's), a [r, K] f32, b [O, r] f32; base [N, K] in
    x's dtype or None: a gradient gx adds to (dtype(f32(base) + f32(dtype(gxa @ a))), as autograd adds two)."""
    g, x, xa, a, b = (t.contiguous() for t in (g, x, xa, a, b))
    (N, O), K, r = g.shape, x.shape[1], a.shape[0]
    gxa = _rank(g, b, s, r, 1, True)  # [N, r]: (f32(g) * s) @ b
    gb = _wgrad(g, xa, s)  # [O, r]
    ga = _wgrad(x, gxa, 1.0, transposed=True)  # [r, K]
    gx = torch.empty_like(x)  # x's dtype(gxa @ a) [+ base]
    _from_rank[(triton.cdiv(N, BLOCK), triton.cdiv(K, BLOCK))](
        gxa, a, gx, gx if base is None else base.contiguous(), N, K, r, HAS_BASE=base is not None, R=_pad(r), B=BLOCK,
        enable_fp_fusion=False)
    return gx, ga, gb


@grads.register_fake
def _(g, x, xa, a, b, s, base=None):
    return torch.empty_like(x, memory_format=torch.contiguous_format), a.new_empty(a.shape), b.new_empty(b.shape)


def _rank(p: torch.Tensor, w: torch.Tensor, s: float, sw_k: int, sw_r: int, scale: bool) -> torch.Tensor:
    """[N, r] f32 = (f32(p) [* s]) @ w for p [N, K] (w's element (k, j) at k * sw_k + j * sw_r, r = w.numel() // K):
    each program sums one chunk of the K products of B rows, torch adds the chunks."""
    (N, K), r = p.shape, w.numel() // p.shape[1]
    chunk = _rank_chunk(N, K)
    chunks = triton.cdiv(K, chunk)
    part = torch.empty((chunks, N, r), dtype=torch.float32, device=p.device)
    _to_rank[(triton.cdiv(N, BLOCK), chunks)](p, w, part, N, K, r, s, sw_k, sw_r, chunk, SCALE=scale, R=_pad(r),
                                               B=BLOCK, enable_fp_fusion=False)
    return part[0] if chunks == 1 else part.sum(0)


def _wgrad(m: torch.Tensor, v: torch.Tensor, s: float, transposed: bool = False) -> torch.Tensor:
    """[P, r] f32 = (f32(m) * s).T @ v for m [N, P], v [N, r] f32 (transposed: its transpose [r, P],
    stored so): each program sums one chunk of the rows (at most SPLIT) of one column block, torch adds
    the chunks."""
    (N, P), r = m.shape, v.shape[1]
    split = _wgrad_chunk(N, P)
    splits = triton.cdiv(N, split)
    part = torch.empty((splits, r, P) if transposed else (splits, P, r), dtype=torch.float32, device=m.device)
    _wgrad_kernel[(triton.cdiv(P, BLOCK), splits)](m, v, part, N, P, r, s, *((1, P) if transposed else (r, 1)),
                                                   split, R=_pad(r), B=BLOCK, enable_fp_fusion=False)
    return part[0] if splits == 1 else part.sum(0)


def _rank_chunk(N: int, K: int) -> int:
    """Products over K per program of a rank-r product of N rows (`_to_rank`)."""
    return _chunk(triton.cdiv(N, BLOCK), K, BLOCK * _pow2(triton.cdiv(K, BLOCK)))


def _wgrad_chunk(N: int, P: int) -> int:
    """Rows per program of a weight gradient's sum over N rows, P columns (`_wgrad_kernel`)."""
    return _chunk(triton.cdiv(P, BLOCK), N, SPLIT)


def launches(N: int, K: int, O: int) -> dict[str, int]:
    """Kernels each op launches for one projection x [N, K] -> [N, O]: the Triton kernels and torch's sums
    of chunked partial sums (benchmarks/update_bytes.py counts them; shapes alone decide)."""
    summed = lambda length, chunk: int(triton.cdiv(length, chunk) > 1)  # noqa: E731
    return {"lora_down": 1 + summed(K, _rank_chunk(N, K)), "lora_tail": 1,
            "lora_grads": 4 + summed(O, _rank_chunk(N, O)) + summed(N, _wgrad_chunk(N, O))
            + summed(N, _wgrad_chunk(N, K))}


def _chunk(outer: int, length: int, most: int) -> int:
    """How many of a sum's `length` terms one program adds: the largest power-of-two multiple of BLOCK up to
    `most` with which `outer` programs per chunk make PROGRAMS programs (else BLOCK). Shapes alone decide it."""
    c = most
    while c > BLOCK and outer * triton.cdiv(length, c) < PROGRAMS:
        c //= 2
    return c


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _pad(r: int) -> int:
    """The adapter's rank as a tile dimension: a power of two, at least tl.dot's 16."""
    return max(16, _pow2(r))


if triton is not None:
    @triton.jit
    def _to_rank(p, w, out, N, K, Rt, s, sw_k, sw_r, KC, SCALE: tl.constexpr, R: tl.constexpr, B: tl.constexpr):
        """out[chunk] [N, Rt] f32 = (f32(p) [* s]) @ w over the chunk's KC of p's K columns, p [N, K]; w's element
        (k, j) at k * sw_k + j * sw_r: a.T (a [r, K]: sw_k = 1, sw_r = K) or b (b [O, r]: sw_k = r, sw_r = 1).
        One program per B rows and chunk."""
        rows = (tl.program_id(0) * B + tl.arange(0, B)).to(tl.int64)
        rs = tl.arange(0, R)
        acc = tl.zeros((B, R), dtype=tl.float32)
        for k0 in range(tl.program_id(1) * KC, tl.program_id(1) * KC + KC, B):
            ks = k0 + tl.arange(0, B)
            pt = tl.load(p + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < N) & (ks[None, :] < K),
                         other=0.0).to(tl.float32)
            if SCALE:
                pt = pt * s  # (rounded before the product, as PEFT's `* scaling` backward is)
            wt = tl.load(w + ks[:, None] * sw_k + rs[None, :] * sw_r, mask=(ks[:, None] < K) & (rs[None, :] < Rt),
                         other=0.0)  # [B, R]
            acc += tl.dot(pt, wt, input_precision="ieee")
        out = out + tl.program_id(1).to(tl.int64) * N * Rt
        tl.store(out + rows[:, None] * Rt + rs[None, :], acc, mask=(rows[:, None] < N) & (rs[None, :] < Rt))

    @triton.jit
    def _from_rank(gxa, a, gx, base, N, K, Rt, HAS_BASE: tl.constexpr, R: tl.constexpr, B: tl.constexpr):
        """gx [N, K] = gx's dtype(gxa [N, Rt] @ a [Rt, K]) (HAS_BASE: then added to base [N, K] in fp32 and
        rounded again, autograd's sum of two gradients), one [B, B] tile per program."""
        rows = (tl.program_id(0) * B + tl.arange(0, B)).to(tl.int64)
        cols = tl.program_id(1) * B + tl.arange(0, B)
        rs = tl.arange(0, R)
        gt = tl.load(gxa + rows[:, None] * Rt + rs[None, :], mask=(rows[:, None] < N) & (rs[None, :] < Rt), other=0.0)
        at = tl.load(a + rs[:, None] * K + cols[None, :], mask=(rs[:, None] < Rt) & (cols[None, :] < K), other=0.0)
        acc = tl.dot(gt, at, input_precision="ieee")  # [B, B]
        m = (rows[:, None] < N) & (cols[None, :] < K)
        out = acc.to(gx.dtype.element_ty)
        if HAS_BASE:
            out = (tl.load(base + rows[:, None] * K + cols[None, :], mask=m, other=0.0).to(tl.float32)
                   + out.to(tl.float32)).to(gx.dtype.element_ty)
        tl.store(gx + rows[:, None] * K + cols[None, :], out, mask=m)

    @triton.jit
    def _tail(res, xa, b, y, N, O, Rt, s, R: tl.constexpr, B: tl.constexpr):
        """y [N, O] = y's dtype(f32(res) + (xa @ b.T) * s), one [B, B] tile per program."""
        rows = (tl.program_id(0) * B + tl.arange(0, B)).to(tl.int64)
        cols = tl.program_id(1) * B + tl.arange(0, B)
        rs = tl.arange(0, R)
        xt = tl.load(xa + rows[:, None] * Rt + rs[None, :], mask=(rows[:, None] < N) & (rs[None, :] < Rt), other=0.0)
        bt = tl.load(b + cols[None, :] * Rt + rs[:, None], mask=(cols[None, :] < O) & (rs[:, None] < Rt), other=0.0)
        lora = tl.dot(xt, bt, input_precision="ieee") * s  # [B, B] f32, rounded, then added (fp fusion off)
        m = (rows[:, None] < N) & (cols[None, :] < O)
        r = tl.load(res + rows[:, None] * O + cols[None, :], mask=m, other=0.0)
        tl.store(y + rows[:, None] * O + cols[None, :], (r.to(tl.float32) + lora).to(y.dtype.element_ty), mask=m)

    @triton.jit
    def _wgrad_kernel(m, v, part, N, P, Rt, s, sp, sr, SPLIT, R: tl.constexpr, B: tl.constexpr):
        """part[split] (element (p, j) at p * sp + j * sr) = sum over the split's SPLIT rows n of
        (f32(m[n, P block]) * s).T @ v[n, :]."""
        cols = tl.program_id(0) * B + tl.arange(0, B)
        rs = tl.arange(0, R)
        acc = tl.zeros((B, R), dtype=tl.float32)
        for n0 in range(tl.program_id(1) * SPLIT, tl.program_id(1) * SPLIT + SPLIT, B):
            ns = (n0 + tl.arange(0, B)).to(tl.int64)
            mt = tl.load(m + ns[:, None] * P + cols[None, :], mask=(ns[:, None] < N) & (cols[None, :] < P),
                         other=0.0).to(tl.float32) * s  # [B rows, B cols]
            vt = tl.load(v + ns[:, None] * Rt + rs[None, :], mask=(ns[:, None] < N) & (rs[None, :] < Rt), other=0.0)
            acc += tl.dot(tl.trans(mt), vt, input_precision="ieee")  # [B cols, R]
        out = part + tl.program_id(1).to(tl.int64) * P * Rt
        tl.store(out + cols[:, None] * sp + rs[None, :] * sr, acc, mask=(cols[:, None] < P) & (rs[None, :] < Rt))
