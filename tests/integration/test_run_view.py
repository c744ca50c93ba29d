"""One run, one view: a run view holds exactly the steps of the run that made it, whatever ran there
before (fewer updates, another model, `opd run` after `dvc repro`'s params, a killed takeover, a
resumed run), and every reader (report, inspect, export) sees only that run."""
from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from stages.run import runview
from support import ROOT, TINY, opd, session

UPDATES = [o for o in TINY if not o.startswith("train.updates=")]


def tiny(updates: int, *more: str) -> list[str]:
    return [*UPDATES, f"train.updates={updates}", *more]


@pytest.fixture(scope="module")
def base4(tmp_path_factory, seeded_store) -> Path:
    """A workspace after `opd run` of 4 tiny updates (the store is shared read-only by copies)."""
    d = tmp_path_factory.mktemp("view-base")
    (d / "conf").symlink_to(ROOT / "conf")
    for part in ("tokenizer", "model"):
        shutil.copytree(seeded_store / part, d / "artifacts" / "store" / part)
    opd("run", *tiny(4), cwd=d)
    return d


def copy_of(base: Path, dst: Path) -> Path:
    """A private copy: the store hard-linked (published files are never written), the views copied."""
    dst.mkdir()
    (dst / "conf").symlink_to(ROOT / "conf")
    shutil.copytree(base / "artifacts" / "store", dst / "artifacts" / "store", copy_function=os.link)
    for part in ("runs", "export"):
        shutil.copytree(base / "artifacts" / part, dst / "artifacts" / part, symlinks=True)
    return dst


def steps_on_disk(run: Path) -> list[str]:
    return sorted(p.name for p in run.glob("step-*"))


def rollout_digests(run: Path) -> set[str]:
    return {pq.read_schema(p).metadata[b"opd.digest"].decode() for p in run.glob("step-*/rollout.parquet")}


def test_fewer_updates_leave_exactly_the_new_runs_steps(base4, tmp_path):
    w = copy_of(base4, tmp_path / "w")
    run = w / "artifacts" / "runs" / "default"
    assert steps_on_disk(run)[-1] == "step-0004"
    opd("run", *tiny(2), cwd=w)
    assert steps_on_disk(run) == ["step-0000", "step-0001", "step-0002"]
    view = json.loads((run / "view.json").read_text())
    assert view["steps"] == [0, 1, 2] and view["complete"] and view["updates"] == 2
    hist = list(csv.DictReader(open(run / "history.csv")))
    assert [h["step"] for h in hist] == ["1", "2"]
    # the report's last sampled step and phase table are the 2-update run's
    opd("report", "run=default", "--out", str(tmp_path / "r.html"), cwd=w)
    text = (tmp_path / "r.html").read_text()
    assert "step 2: " in text and "step 4: " not in text
    # inspect of the run searches its steps only (--worst looks at every step, not the last only)
    rows = json.loads(opd("inspect", "default", "--worst", "8", "--format", "json", cwd=w).stdout)
    assert len(rows) == 8 and {r["uid"][:5] for r in rows} == {"s0001", "s0002"}
    r = opd("inspect", "default", "--step", "4", cwd=w, check=False)
    assert r.returncode == 2 and "--step 4: not a step of the run" in r.stderr


def test_another_model_replaces_the_view_whole(base4, tmp_path):
    """`opd run` with another student (same origin: conf/ + overrides) takes the view over cleanly."""
    w = copy_of(base4, tmp_path / "w")
    run = w / "artifacts" / "runs" / "default"
    other = ["student.name=arch:tiny-llama-teacher"]
    opd("run", *tiny(2, *other), cwd=w)
    page = opd("report", cwd=w).stdout  # no RUN: the run of ./params.yaml, else `default`
    assert "artifacts/runs/default/report.html" in page
    text = (run / "report.html").read_text()
    assert "arch:tiny-llama-teacher" in text and "step 2: " in text and "step 4: " not in text
    assert steps_on_disk(run) == ["step-0000", "step-0001", "step-0002"]
    cfg = json.loads((run / "config.json").read_text())
    view = json.loads((run / "view.json").read_text())
    assert cfg["student"]["name"] == "arch:tiny-llama-teacher" and view["updates"] == 2
    assert rollout_digests(run) == {view["digests"]["steps"][k]["rollout"] for k in ("1", "2")}


def test_opd_run_never_silently_takes_over_a_view_made_from_params(base4, tmp_path):
    """A view `dvc repro` made (stages run with --params params.yaml) is not replaced by an `opd run`
    with another config, and the reverse; a run under its own name is fine."""
    w = copy_of(base4, tmp_path / "w")
    run = w / "artifacts" / "runs" / "default"
    shutil.rmtree(run)
    opd("params", *tiny(3), cwd=w)
    for stage in ("prepare", "train", "evaluate"):
        opd("stage", stage, "--params", "params.yaml", cwd=w)
    before = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    r = opd("run", *tiny(2, "student.name=arch:tiny-llama-teacher"), cwd=w, check=False)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "run=NAME" in errors[0] and "dvc repro" in errors[0], r.stderr
    assert {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()} == before  # untouched
    # the same config made the other way is the same run: allowed, nothing changes
    opd("stage", "train", *tiny(3), cwd=w)
    assert json.loads((run / "view.json").read_text())["origin"] == "params"
    # under its own name it runs, in its own view
    opd("run", *tiny(2, "student.name=arch:tiny-llama-teacher", "run=other"), cwd=w)
    assert steps_on_disk(w / "artifacts/runs/other")[-1] == "step-0002" and steps_on_disk(run)[-1] == "step-0003"
    # and the reverse: params.yaml with another config against a view `opd run` made
    opd("params", *tiny(2, "run=other"), cwd=w)
    r = opd("stage", "prepare", "--params", "params.yaml", cwd=w, check=False)
    assert r.returncode == 2 and "opd run" in r.stderr


def test_a_killed_takeover_shows_none_of_the_old_run(base4, tmp_path):
    w = copy_of(base4, tmp_path / "w")
    run = w / "artifacts" / "runs" / "default"
    r = opd("run", *tiny(3, "objective.loss_max_clamp=0.5"), cwd=w, env={"OPD_FAULT": "update.before"}, check=False)
    assert r.returncode != 0 and "fault injection: update.before" in r.stderr
    assert steps_on_disk(run) == ["step-0000"]  # step-0004 of the old run is gone, step 1 not linked yet
    view = json.loads((run / "view.json").read_text())
    assert view["steps"] == [0] and not view["complete"]
    assert not any((run / f).exists() for f in ("history.csv", "metrics.json", "eval.json", "answers.json"))
    opd("report", "default", "--out", str(tmp_path / "r.html"), cwd=w)
    assert "Incomplete run: 0 of 3 updates linked" in (tmp_path / "r.html").read_text()
    r = opd("stage", "export", cwd=w, check=False)
    assert r.returncode == 2 and "has no final policy" in r.stderr


def test_a_resumed_run_says_what_it_reused(base4, tmp_path):
    w = copy_of(base4, tmp_path / "w")
    run = w / "artifacts" / "runs" / "default"
    r = opd("stage", "train", *tiny(3, "optim.lr=0.0031"), cwd=w, env={"OPD_FAULT": "train.between_steps:2"},
            check=False)
    assert r.returncode != 0 and "train: 3 steps to compute" in r.stdout
    r = opd("stage", "train", *tiny(3, "optim.lr=0.0031"), cwd=w)
    assert "train: resuming at step 3: steps 1-2 published; 1 to compute" in r.stdout
    assert "train: 3 updates (2 reused, 1 computed)" in r.stdout
    hist = list(csv.DictReader(open(run / "history.csv")))
    assert [h["reused"] for h in hist] == ["1", "1", "0"]
    opd("report", "default", "--out", str(tmp_path / "r.html"), cwd=w)
    page = (tmp_path / "r.html").read_text()
    assert "Steps 1-2 published by an earlier run and reused" in page
    assert '<td>rollout</td><td>1</td>' in page  # the phase table times the computed step only
    r = opd("stage", "train", *tiny(3, "optim.lr=0.0031"), cwd=w)
    assert "all 3 steps published by an earlier run: reusing them, nothing to compute" in r.stdout


def test_export_of_a_named_run_is_that_runs_final_policy(base4, tmp_path):
    w = copy_of(base4, tmp_path / "w")
    default = json.loads((w / "artifacts/runs/default/train.json").read_text())
    opd("stage", "train", *tiny(2, "run=short"), cwd=w)
    short = json.loads((w / "artifacts/runs/short/train.json").read_text())
    store = lambda: sorted(str(p) for p in (w / "artifacts/store").glob("*/*"))  # noqa: E731
    # a params file that names the run but not its config: the recorded run is exported, nothing trained
    opd("params", *tiny(3, "run=short"), cwd=w)
    before = store()
    opd("stage", "export", "--params", "params.yaml", cwd=w)
    man = json.loads((w / "artifacts/export/short/manifest.json").read_text())
    assert man["run"] == "short" and man["digests"]["final_policy"] == short["final_policy"]
    assert sorted(man["digests"]["steps"]) == ["1", "2"] and store() == before
    # a run that has no final policy: one line, exit 2, and nothing trained
    opd("params", *tiny(3, "run=never"), cwd=w)
    r = opd("stage", "export", "--params", "params.yaml", cwd=w, check=False)
    assert r.returncode == 2 and "run 'never' has no final policy" in r.stderr and "run it first" in r.stderr
    assert store() == before and not (w / "artifacts/export/never").exists()
    os.unlink(w / "params.yaml")
    # run=NAME selects the run the same way as in `opd report` / `opd inspect`
    opd("stage", "export", "run=default", "--out", "exp-default", cwd=w)
    assert json.loads((w / "exp-default/manifest.json").read_text())["digests"]["final_policy"] == \
        default["final_policy"]
    r = opd("stage", "export", "run=short", "train.updates=5", cwd=w, check=False)
    assert r.returncode == 2 and "run 'short' was trained with train.updates=2" in r.stderr
    opd("stage", "export", "run=short", *tiny(2), cwd=w)  # overrides that agree with the run are fine


def test_export_policy_best_exports_the_evaluated_policy_of_lowest_held_out_kl(base4, tmp_path, monkeypatch):
    """eval.every=1 measures every policy on the teacher's held-out answers; export.policy=best takes
    the lowest, bytes for bytes the adapter that step published. The training is all reused."""
    w = copy_of(base4, tmp_path / "w")
    train = json.loads((w / "artifacts/runs/default/train.json").read_text())
    r = opd("run", *tiny(4, "eval.every=1", "export.policy=best"), cwd=w)
    assert "(4 reused, 0 computed)" in r.stdout
    ev = json.loads((w / "artifacts/runs/default/eval.json").read_text())
    pol = ev["policies"]
    assert [p["policy"] for p in pol] == [0, 1, 2, 3, 4]
    assert pol[0]["kl"] == ev["initial"]["on_teacher_text"]["kl"] and pol[-1]["kl"] == ev["final"]["on_teacher_text"]["kl"]
    assert len({p["kl"] for p in pol}) > 1  # each policy measured, not one figure repeated
    best = min(pol, key=lambda p: (p["kl"], p["policy"]))["policy"]
    assert json.loads((w / "artifacts/runs/default/metrics.json").read_text())["best_policy"] == best
    assert f"the lowest at policy {best}" in r.stdout and f"(policy {best} of [0, 1, 2, 3, 4]" in r.stdout
    man = json.loads((w / "artifacts/export/default/manifest.json").read_text())
    assert man["policy"]["step"] == best and man["digests"]["final_policy"] == train["final_policy"]
    stage, dig = ("update", man["digests"]["steps"][str(best)]["update"]) if best else \
        (json.loads((w / "artifacts/runs/default/view.json").read_text())["digests"]["policy0_stage"],
         man["digests"]["initial_policy"])
    assert man["policy"]["digest"] == dig
    published = w / "artifacts/store" / stage / dig / "adapter/adapter_model.safetensors"
    assert (w / "artifacts/export/default/adapter/adapter_model.safetensors").read_bytes() == published.read_bytes()
    # the default exports the final policy, as before
    opd("stage", "export", *tiny(4, "eval.every=1"), "--out", "final", cwd=w)
    assert json.loads((w / "final/manifest.json").read_text())["policy"]["step"] == 4
    # given only the run's name, export finds the evaluation of the run's recorded config (eval.every=1)
    opd("stage", "export", "run=default", "export.policy=best", "--out", "named", cwd=w)
    assert json.loads((w / "named/manifest.json").read_text())["policy"] == man["policy"]
    # a run that was never evaluated has no best policy: one line, exit 2, no export
    opd("stage", "train", *tiny(2, "run=short"), cwd=w)
    r = opd("stage", "export", *tiny(2, "run=short", "export.policy=best"), cwd=w, check=False)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "export.policy=best: run 'short' has no evaluation" in r.stderr
    assert not (w / "artifacts/export/short").exists()
    # a trained step chosen (the tiny random pair's KL only rises): the adapter that update published
    from stages import export

    monkeypatch.setattr(runview, "best_policy", lambda result, K: {"policy": 2, "kl": 0.0, "of": [0, 1, 2, 3, 4]})
    sess = session(w, *tiny(4, "eval.every=1", "export.policy=best", f"artifacts={w / 'artifacts'}"))
    export.run(sess, w / "second")
    man = json.loads((w / "second/manifest.json").read_text())
    dig = man["digests"]["steps"]["2"]["update"]
    assert man["policy"]["step"] == 2 and man["policy"]["digest"] == dig
    assert (w / "second/adapter/adapter_model.safetensors").read_bytes() == \
        (w / "artifacts/store/update" / dig / "adapter/adapter_model.safetensors").read_bytes()
