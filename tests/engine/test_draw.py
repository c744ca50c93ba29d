"""stages/engine/draw.py on CPU through Triton's interpreter (TRITON_INTERPRET=1, read when the kernel
is defined, hence a fresh process), 64-logit chunks so that each row spans several: the token drawn
is the one whose interval of the fp64 CDF holds u (up to the fp32 rounding of the CDF), its
log-probability is fp64's log-softmax to fp32 rounding, a blocked EOS is never drawn (also where it
would hold nearly all of its chunk's mass), nor a token of probability 0 (u = 0 after leading chunks
of probability 0; a row of five possible tokens), one chunk or several, and the bytes repeat."""
from __future__ import annotations

import pytest

import interpreter  # (tests/)

SCRIPT = """
import json, torch
from stages.engine import draw
draw.CHUNK = 64
g = torch.Generator().manual_seed(0)
rows = []
for V, T, scale in ((1000, 1.0, 3.0), (4096, 0.7, 1.0), (777, 1.3, 8.0), (50, 1.0, 2.0)):  # (V = 50: one chunk)
    B = 8
    cut = min(70, V - 10)
    logits = (torch.randn(B, V, generator=g) * scale).to(torch.bfloat16)
    logits[1, 5:] = float("-inf")  # row 1: only tokens 0-4 possible (chunks of probability 0 after)
    logits[6, :cut] = float("-inf")  # row 6: leading chunks of probability 0, drawn at u = 0
    u = torch.rand(B, generator=g)
    u[0], u[2], u[6] = 0.0, 1.0 - 2 ** -24, 0.0  # the ends of the unit interval
    block = torch.tensor([False, False, False, True, True, False, False, True])
    eos = int(logits[3].float().argmax())  # row 3's likeliest token, blocked there
    logits[7, eos] = 30.0  # row 7: the blocked EOS would carry nearly all the mass of its chunk
    tok, lp = draw.sample(logits, u, T, block, eos)
    tok2, lp2 = draw.sample(logits, u, T, block, eos)
    x = logits.double() / T
    x[block, eos] = float("-inf")
    logp = torch.log_softmax(x, -1)
    cdf = logp.exp().cumsum(-1)
    for b in range(B):
        t = int(tok[b])
        lo = float(cdf[b, t - 1]) if t > 0 else 0.0
        rows.append({"V": V, "b": b, "cut": cut, "tok": t, "u": float(u[b]), "lo": lo, "hi": float(cdf[b, t]),
                     "p": float(logp[b, t].exp()), "lp": float(lp[b]), "lp_ref": float(logp[b, t]),
                     "blocked_eos": bool(block[b]) and t == eos, "repeat": bool(torch.equal(tok, tok2) and torch.equal(lp, lp2))})
print(json.dumps(rows))
"""


@pytest.fixture(scope="module")
def drawn():
    return interpreter.run(SCRIPT)


def test_the_token_drawn_is_the_inverse_cdf_at_u(drawn):
    assert len(drawn) == 32
    for r in drawn:
        # the fp32 CDF of V terms <= 1 is within V * 2**-24 of fp64's
        tol = r["V"] * 2.0 ** -24
        assert r["lo"] - tol <= r["u"] <= r["hi"] + tol, r
        assert r["p"] > 0 and not r["blocked_eos"] and r["repeat"], r
        assert abs(r["lp"] - r["lp_ref"]) <= 1e-5 * max(1.0, abs(r["lp_ref"])), r


def test_the_ends_of_the_interval_and_the_masked_row(drawn):
    by = {(r["V"], r["b"]): r for r in drawn}
    for V in (1000, 4096, 777, 50):
        assert by[V, 1]["tok"] < 5  # only the first five tokens have probability
        assert by[V, 6]["tok"] == by[V, 6]["cut"]  # u = 0: the first token of nonzero probability
