"""`opd plan` before any download: the builtin pairs plan from the shapes shipped in conf/arch/, a
cached config.json wins over them, the plan names its shape source, and an option the plan cannot
use is an error (never a silent plan of another config)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from support import ROOT, opd

PAIR = "builtin:smollm2-360m-1.7b-opd"
PROFILE = "verl-opd-v0.8-single-gpu-v1"


def offline(hub: Path) -> dict:
    """A machine that never downloaded a model: an empty Hugging Face cache, no hub access."""
    hub.mkdir(exist_ok=True)
    return {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}


def test_builtin_pair_plans_offline_from_shipped_shapes(tmp_path):
    env = offline(tmp_path / "hub")
    r = opd("plan", "--profile", PROFILE, "--config", PAIR, "--out", "plan.json", cwd=tmp_path, env=env)
    assert "shapes from conf/arch/smollm2-360m.json (shipped shapes of HuggingFaceTB/SmolLM2-360M-Instruct)" \
        in r.stdout.replace("\n", "")
    plan = json.loads((tmp_path / "plan.json").read_text())
    s, t = plan["memory"]["models"]["student"], plan["memory"]["models"]["teacher"]
    assert (s["layers"], s["hidden"], t["layers"], t["hidden"]) == (32, 960, 24, 2048)
    assert 3.5e8 < s["params"] < 3.7e8 and 1.6e9 < t["params"] < 1.8e9
    assert plan["resolved"]["student"]["name"] == "HuggingFaceTB/SmolLM2-360M-Instruct"
    assert not any((tmp_path / "hub").iterdir())  # nothing was fetched into the cache


def test_a_cached_config_json_is_used_before_the_shipped_shapes(tmp_path):
    pair = yaml.safe_load((ROOT / "conf/pair/smollm2-360m-1.7b-opd.yaml").read_text())
    repo, rev = pair["student"]["name"], pair["student"]["revision"]
    hub = tmp_path / "hub"
    d = hub / f"models--{repo.replace('/', '--')}"
    conf = {k: v for k, v in json.loads((ROOT / "conf/arch/smollm2-360m.json").read_text()).items() if k != "_comment"}
    conf["num_hidden_layers"] = 30  # only the cached file says 30: the plan must have read it
    (d / "snapshots" / rev).mkdir(parents=True)
    (d / "snapshots" / rev / "config.json").write_text(json.dumps(conf))
    (d / "refs").mkdir()
    (d / "refs" / "main").write_text(rev)
    opd("plan", "--profile", PROFILE, "--config", PAIR, "--out", "plan.json", cwd=tmp_path, env=offline(hub))
    s = json.loads((tmp_path / "plan.json").read_text())["memory"]["models"]["student"]
    assert s["layers"] == 30 and s["source"] == f"{repo} config.json (Hugging Face cache)"


def test_an_option_the_plan_cannot_use_is_an_error(tmp_path):
    env = offline(tmp_path / "hub")
    for argv in (["--config", PAIR], ["--set", "trainer.total_training_steps=3"], ["--accept", "all"]):
        r = opd("plan", *argv, cwd=tmp_path, env=env, check=False)
        errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
        assert r.returncode == 2 and len(errors) == 1 and "--profile" in errors[0], (argv, r.stderr)
        assert "opd plan:" not in r.stdout  # nothing was planned
    # an id with neither a cached config.json nor shipped shapes: one line saying what to fetch
    r = opd("plan", "student.name=someone/unknown-model", cwd=tmp_path, env=env, check=False)
    assert r.returncode == 2 and "someone/unknown-model" in r.stderr and "Traceback" not in r.stderr
    assert os.listdir(tmp_path / "hub") == []
