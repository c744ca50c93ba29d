"""The update's AdamW on CUDA (adapters.make_optimizer): one fused kernel over the LoRA tensors.
Resumed from optimizer.safetensors it continues bit for bit as if never stopped (GPU replay and
resume depend on it), and it steps where the CPU's foreach AdamW steps, to fp32 rounding."""
from __future__ import annotations

import pytest
import torch
from engine_models import tiny, with_trained_lora

from stages.run.config import OptimCfg
from stages.weights import adapters

pytestmark = pytest.mark.gpu


def _grads(named, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    for _, p in named:
        p.grad = torch.randn(p.shape, device="cuda", generator=g) * 1e-2


def test_fused_adamw_resumes_bit_for_bit(tmp_path):
    o = OptimCfg(lr=1e-3, weight_decay=0.01)
    a = with_trained_lora(tiny(seed=3).cuda())
    b = with_trained_lora(tiny(seed=3).cuda())
    opt_a, na = adapters.make_optimizer(o, a, None)
    assert opt_a.defaults["fused"] and not opt_a.defaults["foreach"]
    for s in range(3):  # uninterrupted
        _grads(na, s)
        opt_a.step()
    opt_b, nb = adapters.make_optimizer(o, b, None)
    _grads(nb, 0)
    opt_b.step()
    adapters.save_tensors(tmp_path / "opt.safetensors", adapters.host_copy(adapters.optimizer_state(opt_b, nb))())
    opt_b, nb = adapters.make_optimizer(o, b, tmp_path / "opt.safetensors")  # resumed after step 1
    for s in (1, 2):
        _grads(nb, s)
        opt_b.step()
    for (name, p), (_, q) in zip(na, nb):
        assert torch.equal(p, q), name
        sa, sb = opt_a.state[p], opt_b.state[q]
        assert torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"]) and float(sa["step"]) == float(sb["step"]) == 3.0


def test_fused_adamw_steps_where_foreach_does():
    """Same maths, other kernels: each parameter's change agrees with foreach AdamW's to a few fp32
    ulps of the step size lr (Adam's update is lr * m / (sqrt(v) + eps), |m / sqrt(v)| <= ~1)."""
    o = OptimCfg(lr=1e-3)
    m = with_trained_lora(tiny(seed=4).cuda())
    named = adapters.make_optimizer(o, m, None)[1]
    start = {n: p.detach().clone() for n, p in named}
    fused = adapters.make_optimizer(o, m, None)[0]
    ref = torch.optim.AdamW([p for _, p in named], lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay, foreach=True)  # (torch's default decay is not ours)
    moved = {}
    for opt in (fused, ref):
        with torch.no_grad():
            for n, p in named:
                p.copy_(start[n])
        _grads(named, 11)
        opt.step()
        moved[opt is fused] = {n: (p.detach() - start[n]) for n, p in named}
    for n, _ in named:
        # the values themselves round to their own ulp: |p| * 2^-23 per operand, a few operations
        bound = 8 * (o.lr + start[n].abs().max().item()) * 2.0 ** -23
        assert (moved[True][n] - moved[False][n]).abs().max().item() <= bound, n
