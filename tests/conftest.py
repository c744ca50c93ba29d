"""Shared fixtures: tiny random Llamas that use the real SmolLM2 tokenizer, a prepared store that
tests copy instead of rebuilding, and a helper that drives the real `opd` console script."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OPD = str(Path(sys.executable).parent / "opd")
TINY = ["student.name=arch:tiny-llama", "student.init=random", "student.keep_layers=0",
        "teacher.name=arch:tiny-llama-teacher", "teacher.init=random", "data.num_train=8", "data.num_eval=4",
        "rollout.max_new_tokens=8", "eval.max_new_tokens=8", "train.updates=3", "objective.topk=8"]


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def opd(*args: str, cwd: Path, env: dict | None = None, check: bool = True, timeout: int = 600):
    """Run the installed `opd` command; returns CompletedProcess (text)."""
    e = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    r = subprocess.run([OPD, *args], cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"opd {' '.join(args)} exited {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


@pytest.fixture(scope="session")
def seeded_store(tmp_path_factory) -> Path:
    """A store holding the tokenizer and the tiny models (built once per test session)."""
    d = tmp_path_factory.mktemp("seed")
    (d / "conf").symlink_to(ROOT / "conf")
    opd("stage", "prepare", *TINY, cwd=d)
    return d / "artifacts" / "store"


@pytest.fixture
def work(tmp_path, seeded_store, monkeypatch) -> Path:
    """A fresh working dir with conf/ and a copy of the seeded store's models and tokenizer."""
    (tmp_path / "conf").symlink_to(ROOT / "conf")
    for part in ("tokenizer", "model"):
        shutil.copytree(seeded_store / part, tmp_path / "artifacts" / "store" / part)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def session(work: Path, *overrides: str):
    from stages import config
    from stages.session import Session

    return Session(config.compose([*TINY, *overrides], ROOT / "conf"))
