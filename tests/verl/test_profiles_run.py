"""Each of the five profiles plans and runs through the real CLI (`opd plan --profile`, then
`opd run --plan`); plan.json carries a digest and is refused once edited."""
from __future__ import annotations

import csv
import json

import pytest
import yaml

from support import TINY, opd
from stages.verl import mapping, planfile

PAIR = "builtin:smollm2-135m-embedded-opd"


@pytest.mark.parametrize("profile", mapping.profile_names())
def test_each_profile_plans_and_runs(work, profile):
    opd("plan", "--profile", profile, "--config", PAIR, "--out", "plan.json", *TINY, "train.updates=1", cwd=work)
    plan = json.loads((work / "plan.json").read_text())
    assert plan["profile"] == profile and plan["digest"] == planfile.content_digest(plan)
    assert plan["resolved"]["train"]["updates"] == 1 and plan["mapping"]["counts"]["unsupported"] == 0
    opd("run", "--plan", "plan.json", cwd=work)
    run = work / "artifacts" / "runs" / "default"
    assert [r["step"] for r in csv.DictReader(open(run / "history.csv"))] == ["1"]
    st = json.loads((run / "step-0001" / "state.json").read_text())
    n = plan["resolved"]["rollout"]["n"]
    assert st["rollout"]["tokens"] > 0 and st["policy"]["loss"] == st["policy"]["loss"]
    import pyarrow.parquet as pq

    assert pq.read_table(run / "step-0001" / "rollout.parquet").num_rows == 4 * n
    if "rewarded" in profile:
        assert "reward_mean" in st["rollout"] and "task_advantage" in st["policy"]


def test_plan_is_refused_once_edited_and_dry_run_runs_nothing(work):
    opd("plan", "--profile", "verl-opd-v0.8-single-gpu-v1", "--config", PAIR, "--set", "data.train_batch_size=2",
        "--out", "p.json", *TINY, cwd=work)
    r = opd("run", "--plan", "p.json", "--dry-run", cwd=work)
    assert "nothing was run" in r.stdout and "1 samples" in r.stdout
    assert not (work / "artifacts" / "runs").exists()
    plan = json.loads((work / "p.json").read_text())
    assert plan["sets"] == ["data.train_batch_size=2"] and "rollout.batch_size=2" in plan["overrides"]
    plan["resolved"]["train"]["updates"] = 99  # an edit, digest left as it was
    (work / "p.json").write_text(json.dumps(plan))
    r = opd("run", "--plan", "p.json", cwd=work, check=False)
    assert r.returncode == 2 and "edited after planning" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    plan["digest"] = planfile.content_digest(plan)  # re-sealed by hand: the config no longer matches conf/
    (work / "p.json").write_text(json.dumps(plan))
    r = opd("run", "--plan", "p.json", "--dry-run", cwd=work, check=False)
    assert r.returncode == 2 and "key 'train.updates' differs" in r.stderr
    r = opd("run", "--plan", "p.json", "train.updates=2", cwd=work, check=False)
    assert r.returncode == 2 and "no overrides" in r.stderr


@pytest.mark.parametrize("args,needle", [
    (["--profile", "nope", "--config", PAIR], "unknown profile 'nope'"),
    (["--profile", "verl-opd-v0.8-single-gpu-v1", "--config", PAIR, "--set", "trainer.n_gpus_per_node=8"],
     "'trainer.n_gpus_per_node' = 8 is unsupported"),
    (["--profile", "verl-opd-v0.8-single-gpu-v1", "--config", PAIR, "--set", "distillation.bogus=1"],
     "unknown verl field 'distillation.bogus'"),
    (["--profile", "verl-opd-v0.8-single-gpu-v1", "--config", PAIR, "--set", "distillation.distillation_loss.topk=60000"],
     "objective.topk"),
])
def test_bad_plan_input_is_one_line_exit_2(work, args, needle):
    tiny = [o for o in TINY if not o.startswith("objective.topk")]  # ours would win over the verl field
    r = opd("plan", *args, "--out", "p.json", *tiny, cwd=work, check=False)
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (work / "p.json").exists()


def test_external_verl_file_needs_accept(work):
    f = work / "verl.yaml"
    f.write_text(yaml.safe_dump({"actor_rollout_ref": {"model": {"path": "arch:tiny-llama"},
                                                       "rollout": {"name": "sglang", "n": 1}},
                                 "distillation": {"teacher_models": {"teacher_model": {"model_path": "arch:tiny-llama-teacher"}}}}))
    r = opd("plan", "--profile", "verl-opd-v0.8-single-gpu-v1", "--config", str(f), "--out", "p.json", *TINY,
            cwd=work, check=False)
    assert r.returncode == 2 and "--accept actor_rollout_ref.rollout.name" in r.stderr
    opd("plan", "--profile", "verl-opd-v0.8-single-gpu-v1", "--config", str(f), "--accept",
        "actor_rollout_ref.rollout.name", "--out", "p.json", *TINY, cwd=work)
    plan = json.loads((work / "p.json").read_text())
    assert plan["config_sha256"] and plan["accept"] == ["actor_rollout_ref.rollout.name"]
