"""What the evaluate stage reports (stages/evaluate.py): about the greedy answers themselves, the
figures that expose a degenerate student whose KL still falls; the headline numbers of metrics.json;
the one warning line of a run that left the student worse than policy 0; task accuracy by the rows'
checkers on the same answers, and the prompts that flipped."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from stages import evaluate
from stages.run import runview
from support import TINY, opd, session


@pytest.fixture
def tok(work):
    return session(work).models.tokenizer()  # the real SmolLM2 tokenizer, from the seeded store


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
    view = lambda k, a: {"kl": k, "top1_agreement": a, "tokens": 478}  # noqa: E731  (the default run's count)
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
    # within the evaluation's noise: KL up 4% (under KL_RISE), agreement down 0.03 (under two standard
    # errors of 0.6 over 478 tokens, 0.045): no regression to shout about
    assert runview.headline(_record((0.5, 0.52), (0.6, 0.57)), 1)["worse"] is False
    assert runview.headline(_record((0.5, 0.53), (0.6, 0.6)), 1)["worse"] is True  # KL up 6%
    assert runview.headline(_record((0.5, 0.5), (0.6, 0.55)), 1)["worse"] is True  # agreement down 0.05
    # a metrics.json written before the flat keys (the record nested under `eval`), or none at all
    assert runview.worse_warning({"eval": {}, "updates": 3}) is None and runview.worse_warning(None) is None


def test_task_accuracy_that_fell_past_its_noise_is_worse_and_the_warning_names_it():
    """Two standard errors of a proportion over the scored rows, as for agreement: at 0.174 of 121 rows
    (the real pair's start) a fall to 0.140 is noise, a fall to 0.099 is not."""
    task = lambda k: {"correct": k, "n": 121, "accuracy": round(k / 121, 6), "ci95": [0, 1], "checker": "c"}  # noqa: E731
    rec = _record((0.5, 0.5), (0.6, 0.6))
    rec["teacher"]["task"], rec["initial"]["task"] = task(36), task(21)
    rec["final"]["task"] = task(17)
    assert runview.headline(rec, 4)["worse"] is False
    rec["final"]["task"] = task(12)
    m = runview.headline(rec, 4)
    assert m["worse"] is True and m["acc_after"] == 0.099174
    assert runview.worse_warning(m) == ("warning: the trained student is worse than policy 0 on held-out prompts: KL "
                                        "0.5000 -> 0.5000, agreement 0.600 -> 0.600, task accuracy 0.174 -> 0.099 "
                                        "(consider a lower optim.lr)")
    del rec["final"]["task"]  # a record without a task (no ground truths): KL and agreement decide alone
    assert runview.headline(rec, 4)["worse"] is False


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


# ---- task accuracy: the rows' checkers on the same greedy answers ----

def _row(question: str, truth: str | None, source: str = "opd/arith") -> dict:
    return {"data_source": source, "prompt": [{"role": "user", "content": question}],
            "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {"split": "test", "index": 0}}


def test_task_accuracy_and_flips_on_a_synthetic_case():
    """Four rows with a truth (one right -> wrong, one wrong -> right, one right both times, one wrong both
    times) and one without: accuracy counts the four, and only the two that changed are flips."""
    rows = [_row("What is 2 plus 2?", "4"), _row("What is 3 plus 3?", "6"), _row("What is 5 minus 1?", "4"),
            _row("What is 9 times 9?", "81"), _row("Write a poem.", "")]
    text = {"teacher": ["4", "6", "4", "81", "roses"],
            "initial": ["It is 4", "It is 5", "4", "80", "x"],
            "final": ["It is 3", "It is 6", "so 4", "I do not know", "y"]}
    scores, rec = evaluate.task(rows, text)
    assert [s.correct if s else None for s in scores["final"]] == [False, True, True, False, None]
    acc = rec["accuracy"]
    assert {w: (a["correct"], a["n"], a["checker"]) for w, a in acc.items()} == {
        "teacher": (4, 4, "rule"), "initial": (2, 4, "rule"), "final": (2, 4, "rule")}
    assert acc["teacher"]["accuracy"] == 1.0 and acc["teacher"]["ci95"] == [0.510109, 1.0]  # Wilson: 4 / (4 + z^2)
    assert rec["flips"] == {
        "gained": [{"prompt": "What is 3 plus 3?", "truth": "6", "initial": "It is 5", "final": "It is 6",
                    "checker": "rule"}],
        "lost": [{"prompt": "What is 2 plus 2?", "truth": "4", "initial": "It is 4", "final": "It is 3",
                  "checker": "rule"}]}
    # no row with a truth: no record (the eval record then has no task keys)
    scores, rec = evaluate.task(rows[4:], {w: t[4:] for w, t in text.items()})
    assert rec is None and scores["teacher"] == [None]


def test_metrics_gain_task_accuracy_only_where_the_record_has_it():
    rec = _record((3.1, 0.75), (0.28, 0.65))
    assert not any(k.startswith("acc_") for k in runview.headline(rec, 4))
    for who, a in (("teacher", 0.75), ("initial", 0.25), ("final", 0.5)):
        rec[who]["task"] = {"correct": int(4 * a), "n": 4, "accuracy": a, "ci95": [0.0, 1.0], "checker": "rule"}
    m = runview.headline(rec, 4)
    assert (m["acc_before"], m["acc_after"], m["acc_teacher"]) == (0.25, 0.5, 0.75) and m["worse"] is False


def test_the_report_shows_task_accuracy_with_its_checker_and_the_flips():
    from stages.report_html import eval_section

    rec = _record((3.1, 0.75), (0.28, 0.65))
    for who, k in (("teacher", 3), ("initial", 1), ("final", 2)):
        rec[who]["task"] = {"correct": k, "n": 4, "accuracy": k / 4, "ci95": [0.1, 0.9],
                            "checker": "reasoning_gym/chain_sum"}
    flips = {"gained": [{"prompt": "1 + 5 =", "truth": "6", "initial": "<answer>5</answer>",
                         "final": "<answer>6</answer>", "checker": "reasoning_gym/chain_sum"}], "lost": []}
    page = eval_section(rec, {"side_by_side": [], "flips": flips})
    assert "task accuracy of" in page and "reasoning_gym/chain_sum" in page and "3 / 4" in page and "75.0%" in page
    assert "1 wrong before and right after, 0 right before and wrong after" in page
    assert "&lt;answer&gt;6&lt;/answer&gt;" in page and "wrong → right" in page
    assert "teacher.task" not in page  # shown in its table, not again in the leftover metrics


def test_a_reasoning_gym_file_trains_and_reports_task_accuracy(work):
    """`opd data reasoning-gym` writes rows that `opd run data.path=...` trains on and holds out; the
    evaluation scores every held-out row with reasoning-gym's checker, for all three answer sets."""
    import pyarrow.parquet as pq

    pytest.importorskip("reasoning_gym")  # CI installs it (the `test` extra): a skip there fails CI

    out = work / "chain_sum.parquet"
    r = opd("data", "reasoning-gym", "chain_sum", "--size", "24", "--seed", "5", "--out", str(out), cwd=work)
    assert "reasoning_gym/chain_sum" in r.stdout
    tests = sum(x["split"] == "test" for x in pq.read_table(out).column("extra_info").to_pylist())
    r = opd("run", *TINY, f"data.path={out}", "data.max_prompt_tokens=256", cwd=work)
    assert "task accuracy (reasoning_gym/chain_sum, n=" in r.stdout, r.stdout
    run = work / "artifacts" / "runs" / "default"
    ev = json.loads((run / "eval.json").read_text())
    n = json.loads((run / "prepare.json").read_text())["num_eval"]
    assert n == min(tests, 4)  # every held-out row (data.num_eval = 4 in TINY), not only the side-by-side ones
    for who in ("teacher", "initial", "final"):
        t = ev[who]["task"]
        assert t["checker"] == "reasoning_gym/chain_sum" and t["n"] == n and 0 <= t["correct"] <= n
        assert t["accuracy"] == round(t["correct"] / n, 6) and 0 <= t["ci95"][0] <= t["accuracy"] <= t["ci95"][1] <= 1
    assert "flips" not in ev  # text: in answers.json
    answers = json.loads((run / "answers.json").read_text())
    assert set(answers["flips"]) == {"gained", "lost"}
    m = json.loads((run / "metrics.json").read_text())
    assert (m["acc_before"], m["acc_after"], m["acc_teacher"]) == tuple(
        ev[w]["task"]["accuracy"] for w in ("initial", "final", "teacher"))
    samples = pq.read_table(next((work / "artifacts" / "store" / "evaluate").glob("*/samples.parquet"))).to_pylist()
    assert len(samples) == 3 * n and {s["checker"] for s in samples} == {"reasoning_gym/chain_sum"}
    assert sum(s["score"] == 1.0 for s in samples if s["policy"] == "final") == ev["final"]["task"]["correct"]


# ---- eval.every and export.policy=best ----

def test_evaluated_policies_are_0_every_kth_and_the_last():
    from stages.run.config import EvalCfg
    evaluated = lambda K, every: EvalCfg(every=every).policies(K)  # noqa: E731
    assert evaluated(8, 0) == [0, 8] and evaluated(8, 3) == [0, 3, 6, 8] and evaluated(8, 4) == [0, 4, 8]
    assert evaluated(2, 5) == [0, 2] and evaluated(0, 1) == [0]


def test_best_policy_is_the_lowest_kl_earliest_of_equals_else_initial_or_final():
    rec = _record((0.44, 1.14), (0.733, 0.588))  # the real pair that got worse: policy 0 is the best of two
    assert runview.best_policy(rec, 4) == {"policy": 0, "kl": 0.44, "of": [0, 4]}
    assert runview.best_policy(_record((3.1, 0.75), (0.28, 0.65)), 4)["policy"] == 4
    rec["policies"] = [{"policy": k, "kl": kl} for k, kl in ((0, 0.44), (2, 0.31), (4, 1.14), (6, 0.31), (8, 0.5))]
    assert runview.best_policy(rec, 8) == {"policy": 2, "kl": 0.31, "of": [0, 2, 4, 6, 8]}
    assert runview.headline(rec, 8)["best_policy"] == 2 and "best_policy" not in runview.headline(_record(
        (3.1, 0.75), (0.28, 0.65)), 4)


def test_eval_every_zero_keeps_the_evaluate_digest_and_a_nonzero_one_names_the_policies(work):
    base = session(work)
    d0 = base.chain.evaluate()
    assert session(work, "eval.every=0").chain.evaluate() == d0
    K = base.cfg.train.updates
    every = session(work, "eval.every=1")
    d1 = every.chain.evaluate()
    assert d1 != d0 and d1 == session(work, "eval.every=1").chain.evaluate()
    assert every.cfg.eval.policies(K) == list(range(K + 1))
    # every > K evaluates only 0 and K, yet names the setting: another digest, never a silent equal
    assert session(work, f"eval.every={K + 1}").chain.evaluate() not in (d0, d1)


def test_the_teacher_reads_each_set_of_answers_once_whatever_the_policies_measured(work, monkeypatch):
    """eval.every=1 measures every policy on the teacher's answers: the teacher's forward over them
    runs once (plus once over each student's own answers), not once per policy."""
    from stages import train
    from stages.engine import lmhead

    sess = session(work, "eval.every=1")
    train.run(sess)
    teacher, reads, hidden = sess.models.teacher(), [], lmhead.hidden
    monkeypatch.setattr(lmhead, "hidden", lambda model, p, *a, **kw: (
        reads.append(model is teacher) or hidden(model, p, *a, **kw)))
    result = evaluate.run(sess)
    K = sess.cfg.train.updates
    assert [p["policy"] for p in result["policies"]] == list(range(K + 1))
    # teacher: its answers once, then the initial and the final student's own answers; students: 2 + 2 + K - 1
    assert reads.count(True) == 3 and reads.count(False) == 2 + 2 + (K - 1)
