"""The real `dvc` commands on a copy of this repository: `dvc repro` builds the run view, a second
`dvc repro` runs nothing, and `dvc exp run -S` composes the same params.yaml as `opd params`."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import ROOT, TINY, opd

DVC = str(Path(sys.executable).parent / "dvc")


def sh(*cmd, cwd):
    import os

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}  # dvc runs `opd`
    r = subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture
def repo(tmp_path, seeded_store) -> Path:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for f in files:
        src = ROOT / f
        if src.is_file() and not f.startswith(("tests/", "benchmarks/")):
            (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, tmp_path / f)
    for part in ("tokenizer", "model"):
        shutil.copytree(seeded_store / part, tmp_path / "artifacts" / "store" / part)
    sh("git", "init", "-q", cwd=tmp_path)
    sh("git", "-c", "user.email=t@t", "-c", "user.name=t", "add", "-A", cwd=tmp_path)
    sh("git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "copy", cwd=tmp_path)
    return tmp_path


def test_dvc_repro_then_nothing_to_do_and_exp_run_matches_opd_params(repo):
    opd("params", *TINY, cwd=repo)
    r = sh(DVC, "repro", cwd=repo)
    for stage in ("prepare", "train", "evaluate", "export"):
        assert f"Running stage '{stage}'" in r.stdout
    run = repo / "artifacts" / "runs" / "default"
    assert (run / "step-0003" / "rollout.parquet").exists() and (run / "history.csv").exists()
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["updates"] == 3 and metrics["eval"]["final"]["on_teacher_text"]["tokens"] > 0
    assert (repo / "dvc.lock").exists()

    t = time.perf_counter()
    r2 = sh(DVC, "repro", cwd=repo)
    assert time.perf_counter() - t <= 15
    assert "Running stage" not in r2.stdout and "up to date" in r2.stdout

    # dvc exp run -S composes conf/ through DVC's Hydra support; opd params must write the same file
    overrides = [*TINY, "train.updates=4"]
    sh(DVC, "exp", "run", *[a for o in overrides for a in ("-S", o)], cwd=repo)
    opd("params", "--out", "opd-params.yaml", *overrides, cwd=repo)
    assert (repo / "params.yaml").read_text() == (repo / "opd-params.yaml").read_text()
    # the experiment reused updates 1-3 from the store and added step 4
    hist = (run / "history.csv").read_text().splitlines()
    assert len(hist) == 5
