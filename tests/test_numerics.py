"""The error-bound machinery the numerical tests rely on (tests/numerics.py): its rules give the
textbook bounds, the bounds hold on adversarial inputs, and a check fails past its bound."""
from __future__ import annotations

import pytest
import torch

import numerics
from numerics import U32, gamma


def test_sum_and_dot_get_the_textbook_bounds():
    x = torch.tensor([3.0, -1.5, 0.25, 8.0, -2.0])
    _, b = numerics.fp32_bound(lambda t: t.sum(), x)
    assert float(b) == pytest.approx(gamma(4) * float(x.abs().sum()) * (1 + numerics.U64 / U32), rel=1e-12)
    a, w = torch.randn(7, 16), torch.randn(16, 3)
    _, b = numerics.fp32_bound(lambda p: p @ w, a)
    assert torch.allclose(b, gamma(16) * (a.abs() @ w.abs()).double() * (1 + numerics.U64 / U32), rtol=1e-12)


def test_the_bound_holds_under_cancellation_in_any_order():
    # 1e8 + 1 - 1e8: fp32 gives 0 in this order (the 1 is lost), the exact sum is 1
    x = torch.tensor([1e8, 1.0, -1e8])
    ref, b = numerics.fp32_bound(lambda t: t.sum(), x)
    for order in ([0, 1, 2], [0, 2, 1], [1, 0, 2]):
        acc = torch.zeros((), dtype=torch.float32)
        for i in order:
            acc = acc + x[i]
        numerics.check(acc, ref, b, f"order {order}")
    assert float(ref) == 1.0


@pytest.mark.parametrize("seed", range(3))
def test_log_softmax_bound_covers_fp32_on_a_wide_row(seed):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(4, 50_000, generator=g) * 8  # wide spread: many terms underflow, a few dominate
    numerics.check(torch.log_softmax(z, -1), torch.log_softmax(z.double(), -1), numerics.log_softmax_err(z),
                   "log_softmax, 50k wide")
    small = z[:2, :40]  # the traced rule is that bound
    ref, b = numerics.fp32_bound(lambda t: torch.log_softmax(t, -1), small)
    assert torch.allclose(b, numerics.log_softmax_err(small) * (1 + numerics.U64 / U32), rtol=1e-12)


def test_a_check_fails_past_its_bound():
    x = torch.randn(100)
    ref, b = numerics.fp32_bound(lambda t: t.exp().sum(), x)
    got = x.exp().sum()
    numerics.check(got, ref, b, "within")
    with pytest.raises(AssertionError, match="> bound"):
        numerics.check(ref + 2 * b, ref, b, "twice the bound off")


def test_rounded_inputs_and_python_constants_count():
    # 0.1 is not an fp32 number: as an input it is off by <= u * 0.1; as a factor, one more rounding
    x = torch.tensor([0.1])
    _, exact_in = numerics.fp32_bound(lambda t: t * 3.0, x)
    _, rounded_in = numerics.fp32_bound(lambda t: t * 3.0, x, rounded_inputs=True)
    _, inexact_factor = numerics.fp32_bound(lambda t: t * 0.1, torch.tensor([3.0]))
    assert float(rounded_in) > float(exact_in) > 0 and float(inexact_factor) == pytest.approx(2 * U32 * 0.3 * (1 + 2**-29), rel=1e-6)
