"""dvc.yaml follows the stages' declared reads, checked with real `dvc` on the `repo` fixture (a git
repo after one `dvc repro`): changing any key group a stage reads makes DVC rerun that stage, and a
key no stage reads reruns nothing."""
from __future__ import annotations

import json

import pytest
import yaml

from dvcrepo import dvc
from support import TINY, opd
from stages.tools import dvcyaml

DVC_STAGES = ("prepare", "train", "evaluate")
UNREAD = ("memory.margin", "memory.placement")  # placement and budget never change what is computed


def changed(value):
    """A different value of the same kind (DVC compares values; it does not validate them)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, list):
        return [*value, "x"]
    return "x" if value is None else f"{value}-x"


def leaf(params: dict, key: str) -> str:
    """`key` itself, or the first scalar key under a group (e.g. env -> env.name)."""
    node = params
    for part in key.split("."):
        node = node[part]
    while isinstance(node, dict):
        first = next(iter(node))
        key, node = f"{key}.{first}", node[first]
    return key


def set_key(params: dict, key: str) -> None:
    *path, last = key.split(".")
    node = params
    for part in path:
        node = node[part]
    node[last] = changed(node[last])


def status_with(repo, key: str, cli: bool = False) -> dict:
    """DVC's status after `key` alone changes in params.yaml (then restored): by default from DVC's
    own Python API in this process, what `dvc status --json` prints without a 1.4 s CLI start per
    key (~25 keys); cli=True asks the CLI (the first test checks that the two agree)."""
    from dvc.repo import Repo

    f = repo / "params.yaml"
    text = f.read_text()
    params = yaml.safe_load(text)
    set_key(params, key)
    try:
        f.write_text(yaml.safe_dump(params, sort_keys=False))
        if cli:
            return json.loads(dvc("status", "--json", cwd=repo).stdout or "{}")
        with Repo(str(repo)) as r:
            return r.status()
    finally:
        f.write_text(text)


def stale_stages(repo, key: str, cli: bool = False) -> set[str]:
    """Stages whose params.yaml deps DVC reports changed after `key` alone changes."""
    status = status_with(repo, key, cli)
    # {"train": [{"changed deps": {"params.yaml": {"teacher_mode": "modified"}}}]}; the API, run from
    # another directory, names a stage by its dvc.yaml's relative path: "../x/dvc.yaml:train"
    return {name.rsplit(":", 1)[-1] for name, entries in status.items() for e in entries if isinstance(e, dict)
            for k in e.get("changed deps", {}).get("params.yaml", {}) if key == k or key.startswith(k + ".")}


def test_every_declared_key_group_reruns_its_stage(repo):
    assert json.loads(dvc("status", "--json", cwd=repo).stdout or "{}") == {}  # in sync before we start
    via_cli = stale_stages(repo, "train.updates", cli=True)
    assert "train" in via_cli and via_cli == stale_stages(repo, "train.updates")
    params = yaml.safe_load((repo / "params.yaml").read_text())
    groups = {(stage, g) for stage in DVC_STAGES for g in dvcyaml.dvc_params(stage)}
    assert {("train", "teacher_mode"), ("train", "env"), ("train", "sft"), ("prepare", "env")} <= groups
    missed = []
    for stage, g in sorted(groups):
        key = leaf(params, g)
        if stage not in stale_stages(repo, key):
            missed.append(f"{stage}: {key}")
    assert not missed, f"dvc does not rerun these stages when these keys change: {missed}"


@pytest.mark.parametrize("key", UNREAD)
def test_a_key_no_stage_reads_reruns_nothing(repo, key):
    assert stale_stages(repo, key) == set()


@pytest.mark.parametrize("overrides", [
    ["env.name=calculator", "sft.teacher_steps=1", "teacher_mode=protocol_sft"],
    ["env.name=calculator", "teacher_mode=privileged_context"],
    ["env.name=calculator", "sft.steps=2"],
])
def test_opd_params_then_dvc_repro_reruns_train(repo, overrides):
    """The user's path: compose a new params.yaml, ask `dvc repro` what it would run."""
    f = repo / "params.yaml"
    text = f.read_text()
    try:
        opd("params", *TINY, *overrides, cwd=repo)
        out = dvc("repro", "--dry", cwd=repo).stdout
    finally:
        f.write_text(text)
    assert "Running stage 'train'" in out, out
