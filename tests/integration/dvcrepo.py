"""Helpers for the tests that drive real `git` and `dvc` on a copy of the project."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from support import ROOT

BIN = Path(sys.executable).parent
ENV = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "DVC_NO_ANALYTICS": "1",
       "TOKENIZERS_PARALLELISM": "false", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
       "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid"}


def sh(*cmd: str, cwd: Path, check: bool = True, timeout: int = 900, env: dict | None = None
       ) -> subprocess.CompletedProcess:
    r = subprocess.run(list(cmd), cwd=cwd, env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode:
        raise AssertionError(f"{' '.join(cmd)} exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def dvc(*args: str, cwd: Path, **kw) -> subprocess.CompletedProcess:
    return sh(str(BIN / "dvc"), *args, cwd=cwd, **kw)


def copy_project(dst: Path) -> None:
    """What `dvc repro` needs of the project: the pipeline, its config tree, data and code."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for d in ("conf", "data", "stages"):
        shutil.copytree(ROOT / d, dst / d, ignore=skip)
    for f in ("dvc.yaml", ".dvcignore", ".gitignore", ".dvc/config"):
        (dst / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dst / f)
