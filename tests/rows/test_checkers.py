"""Task checkers (stages/rows/checkers.py) and the reasoning-gym rows builder (stages/rows/taskdata.py):
the registry picks a row's checker by data_source, the rule stays rewards.rule_reward for every row
that is not reasoning-gym's, reasoning-gym's own checker scores real entries, and `opd data
reasoning-gym` writes rows that are deterministic and load as verl prompt rows."""
from __future__ import annotations

import json
import sys

import pyarrow.parquet as pq
import pytest

from stages.errors import UserError
from stages.rows import checkers, rewards, taskdata
from stages.rows.verl_rows import read_verl_parquet


def row(truth, source="opd/arith", entry=None, question="What is 12 plus 30?") -> dict:
    info = {"split": "test", "index": 0, **({"entry": json.dumps(entry)} if entry else {})}
    return {"data_source": source, "prompt": [{"role": "user", "content": question}],
            "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": info}


@pytest.mark.parametrize("response,value", [
    ("12 plus 30 is 42", 1.0),  # right: the last number
    ("<final>42</final> and then 7", 1.0),  # right: the answer tag wins over a later number
    ("It is 41.", 0.0),  # wrong
    ("I cannot say.", 0.0),  # no answer at all
    ("", 0.0),
])
def test_the_rule_checker_scores_right_wrong_and_no_answer(response, value):
    s = checkers.score(response, row("42"))
    assert s == checkers.Score(value, "rule") and s.correct == (value == 1.0)


def test_rows_that_are_not_reasoning_gyms_keep_the_rule_exactly():
    """The same function for the same rows: the rollout's reward and the verl bundle's reward.py
    (rewards.py's source) stay what they were."""
    cases = [("42", "the answer is 42"), ("Paris", "paris"), ("7", "<final>seven</final>"), ("-3", "3")]
    for source in ("opd/arith_words", "gsm8k", "", None, "reasoning_gymnastics", "opd/reasoning_gym/x"):
        for truth, resp in cases:
            assert checkers.checker_of(source) == "rule"
            assert checkers.score(resp, row(truth, source)).value == rewards.rule_reward(resp, truth)


def test_a_row_without_ground_truth_has_no_score():
    for truth in (None, "", "  "):
        assert checkers.score("42", row(truth)) is None
        assert checkers.score("42", row(truth, "reasoning_gym/chain_sum")) is None  # not even imported
    assert checkers.score("42", {"prompt": []}) is None


def test_the_registry_names_reasoning_gym_rows_by_dataset():
    assert checkers.checker_of("reasoning_gym/chain_sum") == "reasoning_gym/chain_sum"
    assert set(checkers.REGISTRY) == {"reasoning_gym/"}


# reference values: the Wilson bounds evaluated with mpmath at 30 digits (k = 0: hi = z^2 / (n + z^2))
@pytest.mark.parametrize("k,n,lo,hi", [(0, 10, 0.0, 0.277533), (10, 10, 0.722467, 1.0), (5, 10, 0.236593, 0.763407),
                                       (1, 1, 0.206549, 1.0), (0, 0, 0.0, 1.0)])
def test_wilson_interval(k, n, lo, hi):
    got = checkers.wilson(k, n)
    assert got == pytest.approx((lo, hi), abs=1e-6)


def test_accuracy_counts_full_credit_and_names_the_checkers():
    scores = [checkers.Score(1.0, "rule"), checkers.Score(0.5, "rule"), checkers.Score(0.0, "rule"),
              checkers.Score(1.0, "reasoning_gym/chain_sum")]
    a = checkers.accuracy(scores)
    assert a == {"correct": 2, "n": 4, "accuracy": 0.5, "ci95": [0.150039, 0.849961],
                 "checker": "reasoning_gym/chain_sum+rule"}


def test_a_missing_library_is_one_error_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` now raises ImportError
    monkeypatch.setitem(sys.modules, "reasoning_gym.utils", None)
    checkers._score_fn.cache_clear()
    r = row("-4", "reasoning_gym/chain_sum")
    for call in (lambda: checkers.score("<answer>-4</answer>", r), lambda: checkers.require([r]),
                 lambda: taskdata.rows("chain_sum", 4, 0)):
        with pytest.raises(UserError, match=r"pip install 'opd-stages\[tasks\]'"):
            call()
    checkers.require([row("-4")])  # rule rows need no library
    checkers._score_fn.cache_clear()


# ---- reasoning-gym's own checkers on real entries ----

@pytest.fixture(scope="module")
def rg():
    return pytest.importorskip("reasoning_gym")  # CI installs it (the `test` extra): a skip there fails CI


@pytest.mark.parametrize("dataset", ["chain_sum", "basic_arithmetic"])
def test_reasoning_gyms_checker_scores_real_entries(rg, dataset):
    name = f"reasoning_gym/{dataset}"
    for e in list(rg.create_dataset(dataset, size=2, seed=3)):
        r = row(e["answer"], name, entry=e, question=e["question"])
        right, wrong = e["answer"], str(int(e["answer"]) + 1)
        assert checkers.score(f"Let me think.\n<answer>{right}</answer>", r) == checkers.Score(1.0, name)
        assert checkers.score(f"So the result is {right}", r).correct  # no tag: the rule's answer (last number)
        assert checkers.score(f"<answer>{wrong}</answer>", r) == checkers.Score(0.0, name)
        assert checkers.score("no idea", r).value == 0.0 and checkers.score("", r).value == 0.0
        # the library's own credit, to the bit: it decides what right means
        fn = rg.get_score_answer_fn(dataset)
        assert checkers.score(f"<answer>{right} apples</answer>", r).value == fn(f"{right} apples", e)
    # partial credit is not correct: basic_arithmetic gives an answer that contains the reference its share
    e = rg.create_dataset("basic_arithmetic", size=1, seed=3)[0]
    s = checkers.score(f"<answer>= {e['answer']}</answer>", row(e["answer"], "reasoning_gym/basic_arithmetic", e))
    assert 0 < s.value < 1 and not s.correct


def test_an_unknown_dataset_is_a_user_error(rg):
    with pytest.raises(UserError, match="reasoning-gym has no dataset 'no_such_set'"):
        checkers.score("1", row("1", "reasoning_gym/no_such_set"))
    with pytest.raises(UserError, match="did you mean chain_sum"):
        taskdata.rows("chain_sums", 4, 0)


def test_the_builder_writes_deterministic_verl_rows_split_by_question(rg, tmp_path):
    a, n = taskdata.write("chain_sum", 30, 7, tmp_path / "a.parquet", 0.25)
    b, _ = taskdata.write("chain_sum", 30, 7, tmp_path / "b.parquet", 0.25)
    assert a.read_bytes() == b.read_bytes()  # a function of (name, size, seed, fraction)
    other, _ = taskdata.write("chain_sum", 30, 8, tmp_path / "c.parquet", 0.25)
    assert other.read_bytes() != a.read_bytes()
    t = read_verl_parquet(str(a), "prompt")  # what prepare reads for data.path
    rows = t.to_pylist()
    entries = list(rg.create_dataset("chain_sum", size=30, seed=7))
    assert len(rows) == 30 and n == {"train": 30 - n["test"], "test": n["test"]} and n["test"] >= 30 * 0.25
    for i, (r, e) in enumerate(zip(rows, entries)):
        assert r["data_source"] == "reasoning_gym/chain_sum" and r["ability"] == "arithmetic"
        assert r["prompt"] == [{"role": "user", "content": e["question"] + "\n\n" + taskdata.INSTRUCTION}]
        assert r["reward_model"] == {"style": "rule", "ground_truth": e["answer"]}
        assert r["extra_info"]["index"] == i and json.loads(r["extra_info"]["entry"])["answer"] == e["answer"]
        assert checkers.score(f"<answer>{e['answer']}</answer>", r).correct  # the checker finds what it needs
    split = {}
    for r, e in zip(rows, entries):
        split.setdefault(e["question"], set()).add(r["extra_info"]["split"])
    assert all(len(s) == 1 for s in split.values())  # no held-out question is also a training one
    assert pq.read_schema(a).field("extra_info").type.get_field_index("entry") >= 0


def test_the_builder_refuses_what_it_cannot_build(rg, tmp_path):
    with pytest.raises(UserError, match="--size 1"):
        taskdata.rows("chain_sum", 1, 0)
    for f in (0.0, 1.0, -0.1):
        with pytest.raises(UserError, match="--test-fraction"):
            taskdata.rows("chain_sum", 8, 0, f)
    with pytest.raises(UserError, match="has no reference answers"):
        taskdata.rows("graph_color", 2, 0)
