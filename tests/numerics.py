"""Rounding-error bounds for the numerical tests: every tolerance is derived from the arithmetic.

Model (IEEE round to nearest, unit roundoff u; Higham, "Accuracy and Stability of Numerical
Algorithms", 2nd ed., ch. 2-3):
  * + - * / sqrt of two fp32 numbers: the result is the exact one times (1 + d), |d| <= u = 2^-24.
  * exp, log, expm1, log1p in ATen's CPU kernels (SLEEF u10 under AVX2/AVX-512, glibc libm/libmvec
    under the default capability, MKL VML HA): within 1 ulp. We allow 2 ulp, i.e. relative 4u
    (1 ulp of x is at most 2u|x|), so a kernel one ulp worse than documented still passes.
  * a sum of n terms in ANY order, blocking, vector-lane split or with FMAs: |error| <= gamma(n-1) *
    sum|terms| (Higham (3.4)/(4.4)); a dot product of length n: gamma(n) * sum|a_i b_i|. This is why
    these bounds hold on any x86-64 CPU and ISA: they do not assume a summation order.
  * max/min/clamp/where/gather/indexing/views/negation/abs are exact.
  * fused kernels (log_softmax, logsumexp, silu, scaled-dot-product attention) get a rule built from
    these, stated where it is defined (attention's exp: 20 ulp, see FAST_EXP).

`fp32_bound(fn, *inputs)` turns that model into a bound for a whole computation (a first-order
running error analysis, as in Linnainmaa 1976 / the ADAPT tool): fn is traced into its ATen graph
(the forward ops and, through torch.func.grad_and_value, the backward ops autograd runs), the graph
is re-run in float64 (the reference), and each op's worst-case rounding error, c_op * u * |result| or
gamma * sum|terms| for reductions, is carried to every output by the float64 adjoints:

    |fp32 output - exact| <= sum over ops of |d output / d op result| * (that op's rounding bound).

`fp32_bound_through(inner, outer)` computes the same bound for a transformer forward followed by a
per-position LM head without a vocabulary-sized batched backward.

First order: terms in u^2 are dropped; relative to the bound they are about as large as the bound
is relative to the result. That is negligible where bounds are small (objectives: ~1e-6); where they
are not (an LM head's 49152-term log-softmax sum, gamma(49151) = 3e-3; a random tiny transformer's
forward: up to ~0.3 on a log-prob) the bound is a first-order estimate of the worst case, and the
largest error observed is ~1e-3 of it (benchmarks/results/*-numerics-cpu.md). A branch (clamp, max,
where on a computed value) decided differently in fp32 and float64 is not covered: it needs a value
within its own rounding error (~1e-7 relative) of the branch point, which random inputs hit with
probability ~1e-7 per element.

`check(...)` asserts |got - ref| <= bound element-wise and, when OPD_NUMERICS_LOG
names a file, appends the largest error/bound ratio it saw (benchmarks/numerics_sweep.py reads it).
"""
from __future__ import annotations

import json
import math
import operator
import os

import numpy as np
import torch

U32 = 2.0 ** -24  # fp32 unit roundoff
U64 = 2.0 ** -53  # float64 unit roundoff
TRANSCENDENTAL = 4  # exp/log/expm1/log1p/sin/cos: 2 ulp = 4u relative (see above)
# ATen's fused CPU kernels for attention (flash attention) may use Vectorized::exp_u20, a fast exp
# documented as "ULP=20": we allow 20 ulp = 40u there, and in silu.
FAST_EXP = 40


def gamma(n: int, u: float = U32) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error bound of n rounded operations."""
    n = max(int(n), 0)
    assert n * u < 0.5, n
    return n * u / (1 - n * u)


def f32_exact(x: float) -> bool:
    """Whether the Python float x is an fp32 number (if not, using it in fp32 rounds it by <= u|x|)."""
    return math.isinf(x) or math.isnan(x) or float(np.float32(x)) == x


# ---- check and record ---------------------------------------------------------------------------

def _record(label: str, err: float, bound: float, ratio: float, ok: bool) -> None:
    path = os.environ.get("OPD_NUMERICS_LOG")
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
    with open(path, "a") as f:
        f.write(json.dumps({"test": test, "check": label, "err": err, "bound": bound, "ratio": ratio,
                            "ok": ok}) + "\n")


def check(got, ref, bound, label: str) -> float:
    """Element-wise |got - ref| <= bound (bound broadcasts); returns the largest error/bound ratio."""
    got, ref = torch.as_tensor(got).double(), torch.as_tensor(ref).double()
    bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(got)
    assert got.shape == ref.shape, (label, got.shape, ref.shape)
    err = (got - ref).abs()
    same = (got == ref) | (got.isnan() & ref.isnan())  # equal infinities / both NaN: no error
    err = torch.where(same, torch.zeros_like(err), err)
    ratio = torch.where(err == 0, torch.zeros_like(err), err / bound)
    worst = int(ratio.reshape(-1).argmax()) if ratio.numel() else 0
    r = float(ratio.reshape(-1)[worst]) if ratio.numel() else 0.0
    e, b = (float(err.reshape(-1)[worst]), float(bound.reshape(-1)[worst])) if ratio.numel() else (0.0, 0.0)
    ok = bool((err <= bound).all())
    _record(label, e, b, r, ok)
    assert ok, (f"{label}: |got - ref| = {e:.3e} > bound {b:.3e} (ratio {r:.2f}) at flat index {worst}; "
                f"got {float(got.reshape(-1)[worst])!r}, ref {float(ref.reshape(-1)[worst])!r}")
    return r


# ---- log-softmax, stated once (used by the rules below and by hand-derived bounds) -----------------

def logsumexp_err(z: torch.Tensor, dim: int = -1, u: float = U32) -> torch.Tensor:
    """Bound on the error of L = log(sum_v exp(z_v - m)), m = max z, computed in precision u from exact z.

    exp(fl(z_v - m)) carries relative error u|z_v - m| + 4u; the sum of V positive terms adds
    gamma(V-1) relative (S >= 1: the max term is 1); log adds 4u|L|. So
      |dL| <= sum_v e_v (u|z_v - m| + 4u) / S + gamma(V-1) + 4u|L|.   (keepdim shape)"""
    z = z.double()
    m = z.amax(dim, keepdim=True)
    d = z - m
    e = d.exp()
    S = e.sum(dim, keepdim=True)
    term = torch.where(e > 0, e * (u * d.abs() + TRANSCENDENTAL * u), torch.zeros_like(e))
    return term.sum(dim, keepdim=True) / S + gamma(z.shape[dim] - 1, u) + TRANSCENDENTAL * u * S.log().abs()


def log_softmax_err(z: torch.Tensor, dim: int = -1, u: float = U32) -> torch.Tensor:
    """Per-element bound on log_softmax(z) computed in precision u from exact z.

    Implementations compute either fl(fl(z - m) - L) or fl(z - fl(m + L)); the union of both:
      |ds_v| <= u|z_v - m| + u|s_v| + u|m + L| + |dL|   (dL from logsumexp_err)."""
    z = z.double()
    m = z.amax(dim, keepdim=True)
    lse = torch.logsumexp(z, dim, keepdim=True)
    s = z - lse
    fin = torch.isfinite(s)
    d = torch.where(fin, (z - m).abs() + s.abs(), torch.zeros_like(s))
    return u * d + u * lse.abs() + logsumexp_err(z, dim, u)


# ---- first-order running error analysis over an ATen graph -----------------------------------------

A = torch.ops.aten
_EXACT = {A.detach.default, A.alias.default, A.view.default, A._unsafe_view.default, A.reshape.default,
          A.unsqueeze.default, A.squeeze.dim, A.squeeze.dims, A.squeeze.default, A.expand.default,
          A.permute.default, A.t.default, A.transpose.int, A.select.int, A.slice.Tensor, A.index.Tensor,
          A.gather.default, A.scatter.value, A.scatter.src, A.cat.default, A.stack.default, A.clone.default,
          A.where.self, A.maximum.default, A.minimum.default, A.neg.default, A.abs.default, A.sgn.default,
          A.sign.default, A.nan_to_num.default, A.zeros.default, A.zeros_like.default, A.ones.default,
          A.ones_like.default, A.new_zeros.default, A.new_ones.default, A.lift_fresh_copy.default,
          A.argmax.default, A.topk.default, A.eq.Tensor, A.eq.Scalar, A.ne.Scalar, A.ne.Tensor, A.gt.Scalar,
          A.gt.Tensor, A.ge.Scalar, A.ge.Tensor, A.lt.Scalar, A.lt.Tensor, A.le.Scalar, A.le.Tensor,
          A.logical_and.default, A.logical_or.default, A.logical_not.default, A.any.dim, A.any.default,
          A.all.default, A.index_select.default, A.copy.default, A.empty_like.default, A.arange.default,
          A.arange.start, A.masked_fill.Scalar, A.masked_fill.Tensor, A.split.Tensor,
          A.split_with_sizes.default, A.unbind.int, A.diagonal.default, A.clamp.default,
          A.clamp_min.default, A.clamp_max.default, A.scalar_tensor.default, A._to_copy.default,
          A.full.default, A.full_like.default, A.flatten.using_ints, A.embedding.default,
          A.bitwise_and.Tensor, A.bitwise_or.Tensor, A.bitwise_not.default, A.index_copy.default,
          A.repeat_interleave.self_int, A.select_scatter.default, A.slice_scatter.default,
          A.as_strided.default}
_ONE_ROUNDING = {A.add.Tensor, A.sub.Tensor, A.mul.Tensor, A.div.Tensor, A.rsub.Scalar, A.rsub.Tensor,
                 A.add.Scalar, A.sub.Scalar, A.mul.Scalar, A.div.Scalar, A.reciprocal.default,
                 A.sqrt.default, A.scatter_add.default, A.index_add.default, A.square.default,
                 A.index_put.default}  # scatter_add/index_add/index_put: exact unless indices repeat; one u if they do
_TRANSC = {A.exp.default, A.log.default, A.expm1.default, A.log1p.default, A.cos.default, A.sin.default}
# ops whose derivative has a pole (log, 1/x, sqrt at 0): an untaken torch.where branch through them can
# produce 0 * inf = NaN adjoints
_POLES = {A.log.default, A.log1p.default, A.div.Tensor, A.reciprocal.default, A.sqrt.default, A.rsqrt.default,
          A.pow.Tensor_Scalar, A.expm1.default, A.exp.default, A.xlogy.Tensor}
_INPLACE = {A.logical_and_.default: A.logical_and.default, A.masked_fill_.Scalar: A.masked_fill.Scalar,
            A.add_.Tensor: A.add.Tensor, A.mul_.Tensor: A.mul.Tensor}


def _scalars(node) -> list[float]:
    return [a for a in list(node.args) + list(node.kwargs.values()) if isinstance(a, float)]


def _times(lam, mag):
    """|lam| * mag with 0 * inf = 0 (an infinite intermediate nobody depends on carries no error)."""
    return torch.where(lam == 0, torch.zeros_like(lam), lam.abs() * mag)


_ATTENTION = (A._scaled_dot_product_flash_attention_for_cpu.default,)


def _rule(node, out, args, parent=None):
    """This op's rounding error bound, as a tensor shaped like its result (None: exact): the error
    it adds to its own result, which the adjoints then carry to the outputs. parent: the interpreted
    (args, kwargs) of the multi-output op a getitem reads."""
    op = _INPLACE.get(node.target, node.target)
    if op is operator.getitem:
        src = node.args[0].target if isinstance(node.args[0], torch.fx.Node) else None
        if src in _ATTENTION and node.args[1] == 0:  # the attention output (1: its logsumexp, unused)
            (q, k, v, *rest), kw = parent
            return _attention_rule(q, k, v, mask=kw.get("attn_mask"), scale=kw.get("scale"),
                                   is_causal=bool(rest[1]) if len(rest) > 1 else bool(kw.get("is_causal")))
        assert src not in _ATTENTION or node.args[1] != 0, node
        return None
    if op in _EXACT:
        if op in (A.clamp.default, A.clamp_min.default, A.clamp_max.default):
            # a threshold that is not an fp32 number is rounded (<= u) where it is the result
            ths = [b for b in node.args[1:] if isinstance(b, float) and not f32_exact(b)]
            hit = torch.zeros_like(out, dtype=torch.bool)
            for b in ths:
                hit |= out == b
            return torch.where(hit, out.abs() * U32, torch.zeros_like(out)) if ths else None
        if op in (A.scalar_tensor.default, A.full.default, A.full_like.default, A.masked_fill.Scalar):
            if any(not f32_exact(s) for s in _scalars(node)):
                return (out.abs() * U32)
        if op == A._to_copy.default:  # float64 -> fp32 rounds; int/bool -> fp32 and fp32 -> fp32 do not
            src = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
            if src is None or src.dtype == torch.float64:
                return (out.abs() * U32)
        return None
    if op == A.pow.Tensor_Scalar:
        e = node.args[1]
        assert e in (1, 2), node  # x^1 is exact, x^2 one multiplication (the only powers used here)
        return out.abs() * U32 if e == 2 else None
    if op in _ONE_ROUNDING or op in _TRANSC:
        c = TRANSCENDENTAL if op in _TRANSC else 1
        inexact = [s for s in _scalars(node) if not f32_exact(s)]
        if op in (A.mul.Scalar, A.div.Scalar, A.mul.Tensor, A.div.Tensor):
            c += len(inexact)  # a Python float factor is rounded to fp32 first: one more u on the result
            return (out.abs() * c * U32)
        # ... and a Python float addend moves the sum by <= u|s|
        return (out.abs() * c * U32 + sum(abs(s) for s in inexact) * U32)
    if op in (A.sum.default, A.sum.dim_IntList, A.mean.dim):
        x = args[0]
        dims = list(range(x.dim())) if op == A.sum.default or len(node.args) < 2 or node.args[1] is None \
            else [d % x.dim() for d in node.args[1]]
        n = int(np.prod([x.shape[d] for d in dims])) if dims else 1
        mag = (x.abs().sum(dims, keepdim=True) if dims else x.abs()).reshape(out.shape)
        if op == A.mean.dim:
            return (gamma(n - 1) * mag / n + U32 * out.abs())
        return (gamma(n - 1) * mag)
    if op == A._log_softmax.default:
        return (log_softmax_err(args[0], node.args[1]))
    if op == A.logsumexp.default:
        dim = node.args[1][0] if isinstance(node.args[1], (list, tuple)) else node.args[1]
        assert not isinstance(node.args[1], (list, tuple)) or len(node.args[1]) == 1, node
        err = logsumexp_err(args[0], dim) + U32 * torch.logsumexp(args[0], dim, keepdim=True).abs()
        return (err.reshape(out.shape))
    if op == A._log_softmax_backward_data.default:
        # r = g - exp(s) * sum(g): exp 4u, the sum gamma(V-1) sum|g|, the product u, the difference u|r|
        g, s, dim = args[0], args[1], node.args[2]
        p, G = s.exp(), g.sum(dim, keepdim=True)
        eps = p * (G.abs() * (TRANSCENDENTAL + 1) * U32 + gamma(g.shape[dim] - 1) * g.abs().sum(dim, keepdim=True))
        return (eps + U32 * out.abs())
    if op in (A.mm.default, A.bmm.default):
        return (gamma(args[0].shape[-1]) * (args[0].abs() @ args[1].abs()))
    if op == A.addmm.default:  # beta * c + alpha * a @ b: a dot of K terms, alpha (rounded), the sum
        alpha = node.kwargs.get("alpha", 1)
        c = 1 + (0 if f32_exact(float(alpha)) else 1)
        return (gamma(args[1].shape[-1] + c) * abs(alpha) * (args[1].abs() @ args[2].abs()) + U32 * out.abs())
    if op == A.rsqrt.default:  # 1 / sqrt(x): two correctly rounded operations
        return 2 * U32 * out.abs()
    if op == A.silu.default:  # x / (1 + exp(-x)): exp (FAST_EXP) weighted by sigma(-x), +, /
        return U32 * out.abs() * (FAST_EXP * torch.sigmoid(-args[0]) + 2)

    raise NotImplementedError(f"no rounding rule for {op} (add one to tests/numerics.py)")


def _attention_rule(q, k, v, mask=None, scale=None, is_causal=False, **_):
    """Rounding bound of softmax(q k^T scale [masked]) @ v computed in fp32 by any kernel (flash:
    blocked online softmax; math: softmax then matmul), per output element, first order:
      scores s_j: a dot of D terms, the scale (rounded) and the product: gamma(D + 2) scale sum|q k_j|
      weights exp(s_j - m): the difference u|s_j - m|, exp FAST_EXP u, and an online rescaling by
        exp(m_old - m_new) per key block (blocks of >= 32 keys assumed): (FAST_EXP + 2) u each
      normalised: + sum_k p_k (error of k) + gamma(L) for the sum + u for the division
      output: those relative errors times p_j |v_j|, plus gamma(L) sum_j p_j |v_j| for the sum."""
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each kv head serves several q heads
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
    L, D = k.shape[-2], q.shape[-1]
    scale = scale or 1 / math.sqrt(D)
    s = (q @ k.transpose(-1, -2)) * scale  # [B, H, Lq, L]
    ds = gamma(D + 2) * scale * (q.abs() @ k.abs().transpose(-1, -2))
    if is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2], L, dtype=torch.bool).tril(L - s.shape[-2]), -math.inf)
    if mask is not None:
        if mask.dtype == torch.bool:
            s = s.masked_fill(~mask, -math.inf)
        else:  # an additive mask: one more rounding
            s = s + mask
            ds = ds + U32 * s.abs().nan_to_num(posinf=0.0, neginf=0.0)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    m = s.amax(-1, keepdim=True)
    live = p > 0
    blocks = math.ceil(L / 32)
    ew = ds + U32 * (s - m).abs() + FAST_EXP * U32 + blocks * (FAST_EXP + 2) * U32
    ew = torch.where(live, ew, torch.zeros_like(ew))
    ep = ew + (p * ew).sum(-1, keepdim=True) + gamma(L) + U32
    return (p * ep) @ v.abs() + gamma(L) * (p @ v.abs())


def fp32_bound(fn, *inputs, rows: int | None = None, batch: int = 64, rounded_inputs=False):
    """Trace fn(*inputs) (fp32 tensors in, a tuple of fp32 tensors out; it may use
    torch.func.grad_and_value) and return (reference, bound): for each output, the float64
    re-evaluation of the same ATen graph and the first-order bound on |fp32 result - exact| from the
    model in this module's docstring.

    rows=n: the computation is independent per row of its leading dimension n (one row per token
    position: no op mixes positions), so one backward with a cotangent of ones over the rows serves
    all n rows at once and each row's share is read off the intermediates' own leading dimension.
    Every op that rounds must then have that leading dimension (checked).

    rounded_inputs: True when the floating inputs are fp32 roundings of intended reals (math.log(3),
    0.1, ...), each off by <= u|x|; or one multiple of u per input (an input computed in fp32 with
    c roundings: c); by default the inputs are the exact data.

    The results come in fn's output structure (tuples, dicts)."""
    with torch.enable_grad():  # the adjoints need autograd even if the caller is under no_grad
        outs, spec, tracked = _interpret(_trace(fn, inputs), inputs, rounded_inputs)
        refs, bounds = [], []
        for y in outs:
            by_row = rows is not None and y.dim() > 0 and y.shape[0] == rows
            K = y[0].numel() if by_row else y.numel()
            b = torch.zeros(K, rows if by_row else 1, dtype=torch.float64)
            for start in range(0, K if y.requires_grad else 0, batch):  # no grad: no op on its path rounds
                idx = torch.arange(start, min(K, start + batch))
                cot = torch.zeros(len(idx), K, dtype=torch.float64)
                cot[torch.arange(len(idx)), idx] = 1.0
                cot = cot[:, None, :].expand(len(idx), rows, K) if by_row else cot
                b[idx] += _carry(y, tracked, cot.reshape(len(idx), *y.shape), rows if by_row else None)
            refs.append(y.detach())
            # the float64 reference is itself off by the same analysis at u = 2^-53: 2^-29 of the bound
            bounds.append((b.T if by_row else b[:, 0]).reshape(y.shape) * (1 + U64 / U32))
    unflat = torch.utils._pytree.tree_unflatten
    return unflat(refs, spec), unflat(bounds, spec)


def fp32_bound_through(inner, outer, *inputs, batch: int = 32):
    """fp32_bound of y = outer(inner(*inputs)) where inner -> h [n, ...] (a transformer forward:
    positions mix) and outer acts on each row of h alone -> y [n] (LM head + log-softmax per
    position), computed cheaply: outer's own rounding with rows=n, plus inner's rounding carried to
    y_i through d y_i / d h_i (one cotangent per output row, through inner's small graph only). The
    same first-order bound as tracing the composition; returns (exact y, bound)."""
    with torch.no_grad():
        h32 = inner(*inputs)
    with torch.enable_grad():
        (h,), _, tracked_in = _interpret(_trace(inner, inputs), inputs, False)
        n = h.shape[0]
        leaf = h.detach().requires_grad_(True)
        (y,), _, tracked_out = _interpret(_trace(outer, (h32,)), (leaf,), False)
        assert y.shape == (n,), y.shape
        b = _carry(y, tracked_out, torch.ones(1, n, dtype=torch.float64), n)[0]  # outer's own, per row
        (J,) = torch.autograd.grad(y.sum(), leaf, retain_graph=True)  # row i: d y_i / d h_i
        for start in range(0, n if h.requires_grad else 0, batch):
            idx = torch.arange(start, min(n, start + batch))
            cot = torch.zeros(len(idx), *h.shape, dtype=torch.float64)
            cot[torch.arange(len(idx)), idx] = J[idx]
            b[idx] += _carry(h, tracked_in, cot, None)[:, 0]
    return y.detach(), b * (1 + U64 / U32)


def _trace(fn, inputs):
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.func import functionalize

    return make_fx(functionalize(fn))(*inputs)


def _carry(y, tracked, cot, rows):
    """sum over the rounding ops of |d (cot . y) / d op result| * (its rounding bound), for a batch of
    cotangents cot [k, *y.shape] -> [k, rows] (rows given: split by the ops' leading dimension) or [k, 1]."""
    lams = torch.autograd.grad([y], [t for _, t, _ in tracked], grad_outputs=[cot], is_grads_batched=True,
                               allow_unused=True, retain_graph=True)
    out = torch.zeros(cot.shape[0], rows or 1, dtype=torch.float64)
    with torch.no_grad():
        for (node, t, mag), lam in zip(tracked, lams):
            if lam is None:
                continue
            k, lead = lam.shape[0], (mag.shape[0] if mag.dim() else 1)
            lam, m = lam.abs().reshape(k, lead, -1), mag.reshape(lead, -1)
            part = torch.einsum("kre,re->kr", lam, m)  # [k, leading dim or 1]
            if part.isnan().any():  # 0 * inf: an infinite intermediate nobody depends on
                part = _times(lam, m).sum(2)
            if rows is None:
                out += part.sum(1, keepdim=True)
            elif part.shape[1] == rows:
                out += part
            else:
                assert not part.any(), f"{node.target} rounds but has no row dimension: rows= is invalid"
    return out


def _interpret(gm, inputs, rounded_inputs):
    """Run the traced graph in float64 under autograd: (flat outputs, their pytree spec, tracked)."""
    env, tracked, interp = {}, [], {}  # tracked: (node, float64 result, its rounding bound) of the ops that round
    feed = iter(inputs)
    ulps = iter(rounded_inputs if isinstance(rounded_inputs, (list, tuple)) else [float(rounded_inputs)] * len(inputs))

    def up(x):  # fp32 value -> the same number in float64 (a float64 leaf that wants its gradient: kept)
        if isinstance(x, torch.Tensor) and x.dtype == torch.float64 and x.requires_grad:
            return x
        return x.detach().double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    def arg(a):
        if isinstance(a, torch.fx.Node):
            return env[a]
        if isinstance(a, (list, tuple)):
            return type(a)(arg(x) for x in a)
        if isinstance(a, dict):
            return {k: arg(v) for k, v in a.items()}
        return torch.float64 if a is torch.float32 else a

    def plain(x):
        if isinstance(x, (list, tuple)):
            return type(x)(plain(y) for y in x)
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return x.detach() if isinstance(x, torch.Tensor) else x

    def zero_nan(g):  # such a NaN does not reach the output: zero it
        return torch.nan_to_num(g, nan=0.0, posinf=math.inf, neginf=-math.inf)

    # Only ops that round get an adjoint (autograd leaves where all their inputs are constants: their
    # inputs are then exact data); exact ops on constants (weight transposes, embeddings) stay constant.
    outs = ()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node], c = up(next(feed)), next(ulps)
            if c and isinstance(env[node], torch.Tensor) and env[node].is_floating_point():
                env[node].requires_grad_(True)
                tracked.append((node, env[node], env[node].detach().abs() * c * U32))
        elif node.op == "get_attr":
            env[node] = up(getattr(gm, node.target))
        elif node.op == "call_function":
            args, kwargs = arg(node.args), {k: arg(v) for k, v in node.kwargs.items()}
            op = _INPLACE.get(node.target, node.target)
            if op is operator.getitem:
                out = args[0][args[1]]
            elif op in (A.detach.default, A.lift_fresh_copy.default) and isinstance(args[0], torch.Tensor) \
                    and args[0].requires_grad:
                out = args[0].view_as(args[0])  # same value; rounding errors flow through a detach
            elif op in (A.view.default, A._unsafe_view.default):  # values only: any layout will do
                out = args[0].reshape(args[1])
            else:
                out = op(*args, **kwargs)
                if isinstance(out, torch.Tensor) and out.dtype == torch.float32:  # a factory's default dtype
                    out = out.double()
            env[node] = out
            interp[node] = (args, kwargs)
            if not (isinstance(out, torch.Tensor) and out.is_floating_point()):
                continue
            with torch.no_grad():
                parent = plain(interp.get(node.args[0])) if node.target is operator.getitem else None
                mag = _rule(node, out.detach(), plain(args), parent)
            if op in _POLES:  # log1p(-1), 1/0: its backward may turn the zero adjoint of an untaken
                for x in args:  # where-branch into NaN; the hook sits on what receives that gradient
                    if isinstance(x, torch.Tensor) and x.requires_grad:
                        x.register_hook(zero_nan)
            if mag is None:
                continue
            if not out.requires_grad:
                out.requires_grad_(True)
            tracked.append((node, out, mag))
        elif node.op == "output":
            outs = arg(node.args[0])
    outs, spec = torch.utils._pytree.tree_flatten(outs)
    return outs, spec, tracked
