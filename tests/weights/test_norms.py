"""stages/weights/norms.py: transformers' Llama-family RMSNorm through torch's fused rms_norm computes
what transformers computes, up to one rounding of the normalised row, forward and backward."""
from __future__ import annotations

import importlib

import pytest
import torch
from support import seeds

from stages.weights import norms
from engine_models import tiny

CLASSES = [("llama", "LlamaRMSNorm"), ("qwen2", "Qwen2RMSNorm"), ("qwen3", "Qwen3RMSNorm"), ("mistral", "MistralRMSNorm")]


MANTISSA = {torch.bfloat16: 7, torch.float32: 23}  # explicit mantissa bits


def _ulp(x: torch.Tensor, dtype) -> torch.Tensor:
    """The spacing of `dtype` at |x| (its smallest normal's below that)."""
    e = torch.floor(torch.log2(x.abs().float().clamp_min(torch.finfo(dtype).tiny)))
    return torch.exp2(e - MANTISSA[dtype])


def _bound(y: torch.Tensor, w: torch.Tensor, dtype) -> torch.Tensor:
    """One rounding of the normalised row (y / w: transformers rounds it to `dtype` before the weight's
    multiply, and the fused kernel's row statistic may differ from transformers' in its last fp32 bit,
    which moves that rounding by at most one step), times |w|, plus the multiply's own rounding of
    each side: 1 ulp of the normalised row scaled, and 1 ulp of the output."""
    n = (y.float() / w.float()).abs()
    return _ulp(n, dtype) * w.float().abs() + _ulp(y.float(), dtype)


@pytest.mark.parametrize("seed", seeds(3))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("module,cls", CLASSES)
def test_fused_norm_is_transformers_up_to_one_rounding(module, cls, dtype, seed):
    C = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls)
    assert cls in norms.FORMULA
    g = torch.Generator().manual_seed(seed)
    E = 256
    m = C(E, eps=1e-6).to(dtype)
    with torch.no_grad():
        m.weight.copy_(1 + 0.5 * torch.randn(E, generator=g))
    x = (3 * torch.randn(64, E, generator=g)).to(dtype).requires_grad_()
    dy = torch.randn(64, E, generator=g).to(dtype)
    want = m(x)
    (gw,) = torch.autograd.grad(want, x, dy)
    got = norms.fused(m, x)
    (gg,) = torch.autograd.grad(got, x, dy)
    assert got.dtype == want.dtype == dtype
    assert ((got.float() - want.float()).abs() <= _bound(want, m.weight, dtype)).all()
    # the backward: the same formula in fp32, summed in another order, rounded once to `dtype`: within a
    # few roundings of the row's largest gradient (the sum over E products carries E fp32 roundings)
    scale = gw.float().abs().amax(-1, keepdim=True)
    tol = 4 * _ulp(scale, dtype) + E * torch.finfo(torch.float32).eps * scale
    assert ((gg.float() - gw.float()).abs() <= tol).all(), ((gg.float() - gw.float()).abs() / tol).max()


def test_install_routes_every_norm_of_a_model_through_the_fused_kernel(monkeypatch):
    m = tiny("tiny-qwen3", initializer_range=0.05)  # qk-norm: two norms per attention besides the layer's
    L = m.config.num_hidden_layers
    ids = torch.randint(3, 4000, (2, 9), generator=torch.Generator().manual_seed(0))
    want = m(input_ids=ids).logits
    assert norms.install(m) == 4 * L + 1  # input, post-attention, q and k per layer; the final norm
    calls = []
    real = torch.nn.functional.rms_norm
    monkeypatch.setattr(torch.nn.functional, "rms_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = m(input_ids=ids).logits
    assert len(calls) == 4 * L + 1
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)  # fp32: one rounding of fp32 rows apart
