"""`opd store du|gc` (issue #44): sizes per stage kind that add up to the disk usage, what each run view
reaches, and a collector that removes (with --yes only) exactly what no run view reaches: the run
that remains still reuses every stage it had."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from support import TINY, opd

RUN = [*TINY, "train.updates=2"]


def stage_dirs(store: Path) -> set[str]:
    return {f"{k.name}/{d.name}" for k in store.iterdir() if k.is_dir() for d in k.iterdir()
            if d.is_dir() and not d.name.startswith(".")}


def du_bytes(path: Path) -> int:
    return int(subprocess.run(["du", "-sB1", str(path)], capture_output=True, text=True, check=True).stdout.split()[0])


@pytest.fixture(scope="module")
def built(tmp_path_factory, seeded_store) -> dict:
    """`first`, then `second` (another learning rate: its policy 0 and first rollout are the first's) in
    one artifacts dir, built once; the store dirs each one added."""
    from support import ROOT

    d = tmp_path_factory.mktemp("two-runs")
    (d / "conf").symlink_to(ROOT / "conf")
    for part in ("tokenizer", "model"):
        if (seeded_store / part).exists():
            shutil.copytree(seeded_store / part, d / "artifacts" / "store" / part)
    store = d / "artifacts" / "store"
    before = stage_dirs(store)
    opd("run", *RUN, "run=first", cwd=d)
    first = stage_dirs(store) - before
    opd("run", *RUN, "optim.lr=0.001", "run=second", cwd=d)
    return {"artifacts": d / "artifacts", "first": first, "second": stage_dirs(store) - before - first}


@pytest.fixture
def two_runs(work, built) -> dict:
    """A copy of the two runs' artifacts dir in this test's workspace."""
    shutil.rmtree(work / "artifacts")
    shutil.copytree(built["artifacts"], work / "artifacts", symlinks=True)
    return {**built, "store": work / "artifacts" / "store"}


def test_du_adds_up_to_the_disk_usage_and_names_what_each_run_reaches(work, two_runs):
    store = two_runs["store"]
    r = json.loads(opd("store", "du", "--format", "json", cwd=work).stdout)
    assert r["total_bytes"] == du_bytes(store)
    assert r["total_bytes"] == store.lstat().st_blocks * 512 + sum(k["bytes"] for k in r["kinds"].values())
    for kind, k in r["kinds"].items():
        assert k["bytes"] == du_bytes(store / kind), kind
    assert {"model", "prompts", "init", "rollout", "score", "update", "evaluate"} <= set(r["kinds"])
    assert set(r["runs"]) == {"first", "second"} and r["unreachable"] == []
    # first reaches everything but what second added (the models and tokenizer were there before both);
    # second shares first's models, prompts, policy 0 and rollout 1, and alone reaches what it added
    everything = stage_dirs(store)
    first, second = (set(r["runs"][n]["reaches"]) for n in ("first", "second"))
    assert first == everything - two_runs["second"] and second - first == two_runs["second"]
    assert {s.split("/")[0] for s in first & second} >= {"model", "prepared", "prompts", "init", "rollout"}
    assert r["runs"]["second"]["alone_bytes"] == sum(du_bytes(store / s) for s in two_runs["second"])
    text = opd("store", "du", cwd=work).stdout
    assert text.startswith("store artifacts/store: ") and f"({r['total_bytes']} bytes)" in text
    assert "unreachable: 0 stage dirs" in text


def test_gc_removes_exactly_what_only_a_deleted_run_reached(work, two_runs):
    store = two_runs["store"]
    shutil.rmtree(work / "artifacts" / "runs" / "second")
    everything = stage_dirs(store)
    dry = opd("store", "gc", "--min-age", "0", cwd=work)
    listed = {line.split()[1] for line in dry.stdout.splitlines() if line.startswith("unreachable ")}
    assert listed == two_runs["second"] and stage_dirs(store) == everything  # a dry run removes nothing
    assert dry.stdout.rstrip().endswith("`opd store gc --yes` removes them")
    recent = opd("store", "gc", "--yes", cwd=work)  # just published: kept (a starting run may not name them yet)
    assert stage_dirs(store) == everything and "gc: removed 0 stage dirs" in recent.stdout
    usage = du_bytes(store)
    r = json.loads(opd("store", "gc", "--yes", "--min-age", "0", "--format", "json", cwd=work).stdout)
    assert set(r["removed"]) == two_runs["second"] and stage_dirs(store) == everything - two_runs["second"]
    assert usage - du_bytes(store) >= r["freed_bytes"] > 0
    assert opd("store", "gc", "--min-age", "0", cwd=work).stdout.strip() == \
        "gc: every stage is reached by a run; nothing to remove"
    # the run that remains reuses every stage it had: nothing is computed or published again
    again = opd("run", *RUN, "run=first", cwd=work)
    assert "train: all 2 steps published by an earlier run" in again.stdout, again.stdout
    assert "(published by an earlier run: reused)" in again.stdout
    assert stage_dirs(store) == everything - two_runs["second"]
    opd("inspect", "first", "--step", "2", cwd=work)


def test_gc_refuses_while_a_run_view_cannot_be_read(work, two_runs):
    (work / "artifacts" / "runs" / "second" / "view.json").write_text("{not json")
    shutil.rmtree(work / "artifacts" / "runs" / "first")
    everything = stage_dirs(two_runs["store"])
    r = opd("store", "gc", "--yes", "--min-age", "0", cwd=work, check=False)
    errors = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(errors) == 1 and "runs/second" in errors[0] and "gc removes nothing" in errors[0]
    assert stage_dirs(two_runs["store"]) == everything
    assert "gc refuses" in opd("store", "du", cwd=work).stderr
