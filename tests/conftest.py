"""Shared fixtures: tiny random Llamas that use the real SmolLM2 tokenizer, a prepared store that
tests copy instead of rebuilding, and a helper that drives the real `opd` console script."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

# support imports `stages` before torch (MKL's reproducibility mode must be set before MKL starts)
from support import OPD, ROOT, DEFAULT_THREADS, TINY, opd, session  # noqa: F401  (re-exported)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """A test's in-process Session may set runtime.threads (process-wide in torch); the next test
    starts from the default again, since the thread count is part of CPU stage digests."""
    import torch

    yield
    if torch.get_num_threads() != DEFAULT_THREADS:
        torch.set_num_threads(DEFAULT_THREADS)


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
        if (seeded_store / part).exists():  # (no tokenizer entry when OPD_TEST_TOKENIZER names a dir)
            shutil.copytree(seeded_store / part, tmp_path / "artifacts" / "store" / part)
    monkeypatch.chdir(tmp_path)
    return tmp_path
