"""Shared fixtures: tiny random Llamas that use the real SmolLM2 tokenizer, a prepared store that
tests copy instead of rebuilding, and a helper that drives the real `opd` console script."""
from __future__ import annotations

import os
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


# Under CI (CI=true, ./install.sh test) every test runs but those that need CUDA (the `gpu` marker, or a
# reason that says CUDA) and the one root cannot run (it ignores directory permissions): any other skip
# is a test CI should have run (a verl or conformance test that cannot import verl among them), listed
# after the short summary, and it fails the session.
CI = os.environ.get("CI", "").lower() not in ("", "0", "false")
CI_ALLOWED_SKIPS = ("CUDA", "root ignores directory permissions")
_unexpected_skips: list[str] = []


def _note_skip(report) -> None:
    if not CI or not report.skipped or hasattr(report, "wasxfail"):  # (an xfail reports as skipped)
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if "gpu" not in getattr(report, "keywords", {}) and not any(a in reason for a in CI_ALLOWED_SKIPS):
        _unexpected_skips.append(f"{report.nodeid}: {reason}")


def pytest_runtest_logreport(report):
    _note_skip(report)  # (under xdist the controller gets every worker's reports: counted there once)


def pytest_collectreport(report):
    _note_skip(report)  # a whole module skipped at import (pytest.importorskip at its top)


def pytest_terminal_summary(terminalreporter):
    if _unexpected_skips:
        terminalreporter.section("skips CI does not allow (CI=true)", red=True)
        for line in _unexpected_skips:
            terminalreporter.line(line)


def pytest_sessionfinish(session):  # noqa: F811  (pytest passes the hook's argument by this name)
    if _unexpected_skips and not hasattr(session.config, "workerinput") and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


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
