"""stages/engine/draw.py on the GPU at the decode step's real widths (SmolLM2's 49,152 and Qwen3's
151,936 logits, bf16), where its sums and scans run in parallel: each token drawn is the inverse
fp64 CDF at its u, its log-probability fp64's, the bytes repeat, and away from a CDF boundary the
token is the one torch's passes draw (draw.ON off).

Tolerance, derived: the kernel's CDF at a token sums exp terms (each within a few ulps) by a tree
over a 2,048-logit chunk (11 levels), a parallel scan over <= 128 chunks (7) and one over the chunk
(11): <= ~32 roundings of 2**-24 relative on a CDF <= 1, so TOL = 64 * 2**-24 (3.8e-6), below one
token's width at scale 1 (~1/V = 6.6e-6), so a neighbouring token fails it."""
from __future__ import annotations

import pytest
import torch

from stages.engine import decoder, draw

pytestmark = pytest.mark.gpu
TOL = 64 * 2.0 ** -24


@pytest.mark.parametrize("B,V,scale,T,blocked", [(4, 49152, 3.0, 1.0, False), (64, 151936, 1.0, 1.0, False),
                                                 (64, 151936, 6.0, 0.7, True)])
def test_kernel_draw_is_the_inverse_cdf_at_u(B, V, scale, T, blocked):
    g = torch.Generator(device="cuda").manual_seed(V + B)
    logits = (torch.randn(B, V, generator=g, device="cuda") * scale).to(torch.bfloat16)
    u = torch.rand(B, generator=g, device="cuda")
    eos = int(logits[0].float().argmax())
    block = (torch.arange(B, device="cuda") % 2 == 0) if blocked else None
    assert draw.usable(logits, False, 1.0)
    tok, lp = decoder.pick(logits, u, T, 1.0, False, block, eos)
    tok2, lp2 = decoder.pick(logits, u, T, 1.0, False, block, eos)
    assert torch.equal(tok, tok2) and torch.equal(lp, lp2)
    x = logits.double() / T
    if blocked:
        x[block, eos] = float("-inf")
        assert not bool((tok[block] == eos).any())
    logp = torch.log_softmax(x, -1)
    cdf = logp.exp().cumsum(-1)
    hi = cdf.gather(1, tok[:, None])[:, 0]
    lo = hi - logp.gather(1, tok[:, None])[:, 0].exp()
    ud = u.double()
    assert bool(((lo - TOL <= ud) & (ud <= hi + TOL)).all()), (tok, u)
    assert float((lp.double() - logp.gather(1, tok[:, None])[:, 0]).abs().max()) < 1e-4
    draw.ON = False
    try:
        ref, _ = decoder.pick(logits, u, T, 1.0, False, block, eos)  # torch's passes
    finally:
        draw.ON = True
    near = (ud - lo < 2 * TOL) | (hi - ud < 2 * TOL)
    assert bool(((tok == ref) | near).all()), (tok, ref)
