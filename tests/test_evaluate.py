"""What the evaluate stage reports about the greedy answers themselves (stages/evaluate.py): the
figures that expose a degenerate student whose KL still falls."""
from __future__ import annotations

import pytest

from stages import evaluate
from support import session


@pytest.fixture
def tok(work):
    return session(work).tokenizer()  # the real SmolLM2 tokenizer, from the seeded store


def test_answers_flags_blank_and_repeating_answers(tok):
    nl = tok.encode("\n", add_special_tokens=False)
    blank = [nl * 8, nl * 8]  # what the degenerate student printed: newlines only
    assert len(nl) == 1  # SmolLM2 has a newline token
    a = evaluate.answers(tok, blank)
    # 2 x 7 bigrams, all the same one; figures are rounded to 6 decimals
    assert a["nonblank"] == 0.0 and a["mean_tokens"] == 8 and a["distinct_bigrams"] == pytest.approx(1 / 14, abs=1e-6)
    words = [tok.encode(t, add_special_tokens=False) for t in ("12 + 30 = 42", "The heart beats.")]
    b = evaluate.answers(tok, words + [nl])
    assert b["nonblank"] == pytest.approx(2 / 3, abs=1e-6)
    pairs = [tuple(r[i:i + 2]) for r in words for i in range(len(r) - 1)]
    assert b["distinct_bigrams"] == pytest.approx(len(set(pairs)) / len(pairs), abs=1e-6)


def test_answers_of_nothing_are_zero(tok):
    assert evaluate.answers(tok, []) == {"nonblank": 0.0, "distinct_bigrams": 0.0, "mean_tokens": 0.0}
    # an EOS-only answer decodes to nothing: blank
    assert evaluate.answers(tok, [[tok.eos_token_id]])["nonblank"] == 0.0


def test_user_text_takes_the_last_user_turn():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 2 plus 2?"}]
    assert evaluate._user_text(msgs) == "What is 2 plus 2?" and evaluate._user_text("plain") == "plain"
