"""The git + DVC repository the integration tests share: a copy of the project after one `dvc repro`
on tiny models (built once per test session; tests that change it put it back)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dvcrepo import copy_project, dvc, sh
from support import TINY, opd


@pytest.fixture(scope="session")
def repo(tmp_path_factory, seeded_store) -> Path:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    d = tmp_path_factory.mktemp("dvcrepo")
    copy_project(d)
    for part in ("tokenizer", "model"):  # the tiny models, already built once per session
        shutil.copytree(seeded_store / part, d / "artifacts" / "store" / part)
    sh("git", "init", "-q", cwd=d)
    opd("params", *TINY, cwd=d)
    sh("git", "add", "-A", cwd=d)
    sh("git", "commit", "-qm", "tiny pipeline", cwd=d)
    r = dvc("repro", cwd=d)
    assert "Running stage 'report'" in r.stdout
    sh("git", "add", "-A", cwd=d)
    sh("git", "commit", "-qm", "dvc repro", cwd=d)
    return d


