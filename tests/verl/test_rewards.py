"""Task rewards: the rule reward, the rollout's `reward` column, and pg_k1_rewarded's advantages
(computed per trajectory over prompt groups, spread over each trajectory's positions)."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from support import session
from stages import objectives
from stages.rows import rewards, tables
from stages.run.config import compose
from stages.errors import UserError
from stages.run.store import read_state
from stages.update import trajectory_advantages


@pytest.mark.parametrize("response,truth,want", [
    ("The answer is 42.", "42", 1.0),
    ("12 + 30 = 42", "42", 1.0),
    ("42, no wait, 41", "42", 0.0),
    ("<final>1,234</final>", "1234", 1.0),
    ("<final>about 7 apples</final> then 9", "7", 1.0),
    ("-5", "-5", 1.0),
    ("no number here", "3", 0.0),
    ("Paris\n", "paris", 1.0),
    ("It is Paris.", "Paris", 0.0),
    ("anything", "", None),
    ("anything", None, None),
])
def test_rule_reward(response, truth, want):
    assert rewards.rule_reward(response, truth) == want


def test_ground_truth_of_a_row():
    assert rewards.ground_truth({"reward_model": {"style": "rule", "ground_truth": " 12 "}}) == "12"
    assert rewards.ground_truth({"reward_model": {"style": "rule", "ground_truth": ""}}) is None
    assert rewards.ground_truth({}) is None


def _rollout_table(rewards_, prompt_index):
    rows = [{"uid": f"u{i}", "prompt_index": p, "reward": r} for i, (r, p) in enumerate(zip(rewards_, prompt_index))]
    return pa.Table.from_pylist(rows, pa.schema([("uid", pa.string()), ("prompt_index", pa.int32()),
                                                 ("reward", pa.float32())]))


@pytest.mark.parametrize("mode", ["raw", "group_centered", "group_standardized", "leave_one_out"])
def test_trajectory_advantages_follow_the_objective_mode(mode):
    cfg = compose(["objective.name=pg_k1_rewarded", "objective.use_policy_gradient=true", f"objective.advantage={mode}"])
    t = _rollout_table([1.0, 0.0, 1.0, 1.0], [3, 3, 5, 5])
    got = trajectory_advantages(t, cfg, 1)
    want = objectives.reward_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), [3, 3, 5, 5], mode)
    assert torch.allclose(got, want)


def test_missing_rewards_are_an_error_naming_the_field():
    cfg = compose(["objective.name=pg_k1_rewarded", "objective.use_policy_gradient=true"])
    with pytest.raises(UserError, match=r"reward_model.ground_truth") as e:
        trajectory_advantages(_rollout_table([1.0, None], [0, 0]), cfg, 2)
    assert "\n" not in str(e.value)


def test_rollout_scores_rewards_and_pg_k1_rewarded_trains(work):
    from stages import rollout, score, train, update

    sess = session(work, "data.generator=arith", "objective.name=pg_k1_rewarded", "objective.use_policy_gradient=true",
                   "rollout.n=2", "train.updates=1")
    train.ensure_policy(sess, 0)
    d = rollout.run(sess, 1)
    t = pq.read_table(d / "rollout.parquet")
    assert t.schema.field("reward").type == pa.float32() and t.schema.names == tables.ROLLOUT.names
    r = t.column("reward").to_pylist()
    assert len(r) == 8 and all(x in (0.0, 1.0) for x in r)
    assert t.column("prompt_index").to_pylist()[::2] == t.column("prompt_index").to_pylist()[1::2]  # grouped
    score.run(sess, 1)
    st = read_state(update.run(sess, 1))
    assert st["loss"] == st["loss"] and "task_advantage" in st and st["grad_norm"] > 0
    # prompts without ground truth: no reward (null), never a silent 0
    sess2 = session(work, "data.generator=topics", "train.updates=1")
    t2 = pq.read_table(rollout.run(sess2, 1) / "rollout.parquet")
    assert set(t2.column("reward").to_pylist()) == {None}
