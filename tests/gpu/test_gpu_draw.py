"""stages/blocks/draw.py on the GPU at the decode step's real widths (SmolLM2's 49,152 and Qwen3's
151,936 logits, bf16): each token drawn is the inverse fp64 CDF at its u (up to the fp32 rounding of
a CDF of V terms), its log-probability fp64's to fp32 rounding, and the bytes repeat."""
from __future__ import annotations

import pytest
import torch

from stages.blocks import decoder, draw

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("B,V,scale", [(4, 49152, 3.0), (64, 151936, 1.0), (64, 151936, 6.0)])
def test_kernel_draw_is_the_inverse_cdf_at_u(B, V, scale):
    g = torch.Generator(device="cuda").manual_seed(V + B)
    logits = (torch.randn(B, V, generator=g, device="cuda") * scale).to(torch.bfloat16)
    u = torch.rand(B, generator=g, device="cuda")
    assert draw.usable(logits, False, 1.0)
    tok, lp = decoder.pick(logits, u, 1.0, 1.0, False, None, 0)
    tok2, lp2 = decoder.pick(logits, u, 1.0, 1.0, False, None, 0)
    assert torch.equal(tok, tok2) and torch.equal(lp, lp2)
    logp = torch.log_softmax(logits.double(), -1)
    cdf = logp.exp().cumsum(-1)
    hi = cdf.gather(1, tok[:, None])[:, 0]
    lo = hi - logp.gather(1, tok[:, None])[:, 0].exp()
    tol = V * 2.0 ** -24
    ud = u.double()
    assert bool(((lo - tol <= ud) & (ud <= hi + tol)).all()), (tok, u)
    assert float((lp.double() - logp.gather(1, tok[:, None])[:, 0]).abs().max()) < 1e-4
