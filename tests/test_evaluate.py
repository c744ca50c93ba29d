"""What the evaluate stage reports (stages/evaluate.py): about the greedy answers themselves, the
figures that expose a degenerate student whose KL still falls; the headline numbers of metrics.json;
and the one warning line of a run that left the student worse than policy 0."""
from __future__ import annotations

from pathlib import Path

import pytest

from stages import evaluate
from stages.run import runview
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


def _record(kl: tuple[float, float], agree: tuple[float, float]) -> dict:
    """The evaluate stage's record (the store's eval.json) with the given before/after figures."""
    view = lambda k, a: {"kl": k, "top1_agreement": a, "tokens": 9}  # noqa: E731
    answers = {"nonblank": 0.75, "distinct_bigrams": 0.5, "mean_tokens": 4.0}
    return {"teacher": {"answers": answers},
            "initial": {"on_teacher_text": view(kl[0], agree[0]), "on_own_text": view(2.0, 0.5), "answers": answers},
            "final": {"on_teacher_text": view(kl[1], agree[1]), "on_own_text": view(1.0, 0.6),
                      "answers": {**answers, "nonblank": 1.0}},
            "kl_reduction_on_teacher_text": 0.1, "kl_reduction_on_own_text": 0.5, "side_by_side": []}


def test_metrics_are_the_records_own_numbers_under_short_flat_keys():
    """metrics.json (DVC's metrics: one `dvc exp show` column per key) holds the record's figures as
    they are, nothing nested, and no text."""
    m = runview.headline(_record((3.112542, 0.750716), (0.278243, 0.648536)), 48)
    assert m == {"kl_before": 3.112542, "kl_after": 0.750716, "agree_before": 0.278243, "agree_after": 0.648536,
                 "nonblank_after": 1.0, "updates": 48, "worse": False}
    assert runview.worse_warning(m) is None


@pytest.mark.parametrize("kl,agree", [((0.44, 1.14), (0.733, 0.733)),  # KL rose
                                      ((0.44, 0.44), (0.733, 0.588)),  # agreement fell
                                      ((0.44, 1.14), (0.733, 0.588))])
def test_a_run_that_got_worse_says_so_in_one_warning_line(kl, agree):
    m = runview.headline(_record(kl, agree), 4)
    assert m["worse"] is True
    line = runview.worse_warning(m)
    assert line == (f"warning: the trained student is worse than policy 0 on held-out prompts: KL {kl[0]:.4f} -> "
                    f"{kl[1]:.4f}, agreement {agree[0]:.3f} -> {agree[1]:.3f} (consider a lower optim.lr)")
    assert "\n" not in line


def test_equal_figures_are_not_worse_and_old_metrics_have_no_warning():
    assert runview.headline(_record((0.5, 0.5), (0.6, 0.6)), 1)["worse"] is False
    # a metrics.json written before the flat keys (the record nested under `eval`), or none at all
    assert runview.worse_warning({"eval": {}, "updates": 3}) is None and runview.worse_warning(None) is None


def test_main_prints_the_warning_to_stderr_only_when_worse(monkeypatch, capsys):
    """evaluate.main: the summary line on stdout, then the one `warning:` line on stderr (sessions
    stand in: main reads only the store path, the updates and run's record)."""
    class Sess:
        class cfg:
            class train:
                updates = 4

        class chain:
            evaluate = staticmethod(lambda: "d" * 32)

        class store:
            path = staticmethod(lambda *a: Path("/nonexistent"))

    for rec, worse in ((_record((0.44, 1.14), (0.733, 0.588)), True), (_record((3.1, 0.75), (0.28, 0.65)), False)):
        monkeypatch.setattr(evaluate, "run", lambda sess, rec=rec: rec)
        evaluate.main(Sess)
        out, err = capsys.readouterr()
        assert out.startswith("evaluate: held-out KL") and "warning" not in out
        if worse:
            assert err.splitlines() == [runview.worse_warning(runview.headline(rec, 4))]
            assert err.startswith("warning: the trained student is worse than policy 0") and "1.1400" in err
        else:
            assert err == ""
