"""Helpers shared by the test modules (import from here, not from conftest: several test folders
have a conftest.py of their own, and `import conftest` would pick whichever loaded first)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from stages.tools.process import process_settings

process_settings()  # before torch, as `opd` does: MKL reads MKL_CBWR once (stages/cli.py)
import torch

ROOT = Path(__file__).resolve().parent.parent
OPD = str(Path(sys.executable).parent / "opd")
TINY = ["student.name=arch:tiny-llama", "student.init=random", "student.keep_layers=0",
        "teacher.name=arch:tiny-llama-teacher", "teacher.init=random", "data.num_train=8", "data.num_eval=4",
        "rollout.max_new_tokens=8", "eval.max_new_tokens=8", "train.updates=3", "objective.topk=8"]
# Where the embedded model is not installed (the lent GPU machine: its GGUF is over the carry limit),
# the random-init models take the same SmolLM2 tokenizer from a directory of its files.
TOKENIZER_DIR = os.environ.get("OPD_TEST_TOKENIZER")
TOKENIZER = [f"{r}.tokenizer={TOKENIZER_DIR}" for r in ("student", "teacher")] if TOKENIZER_DIR else []
TINY += TOKENIZER
# torch's intra-op thread count as this test process started (tests/conftest.py restores it after
# each test: in-process sessions may set runtime.threads, and it is part of CPU stage digests)
DEFAULT_THREADS = torch.get_num_threads()


def seeds(ci: int = 1) -> list[int]:
    """Seeds for a numerical test's random inputs: `ci` of them by default (CI stays fast), or as many
    as OPD_TEST_SEEDS says (benchmarks/numerics_sweep.py runs 20 under each CPU capability)."""
    return list(range(int(os.environ.get("OPD_TEST_SEEDS", ci))))



def opd(*args: str, cwd: Path, env: dict | None = None, check: bool = True, timeout: int = 600):
    """Run the installed `opd` command; returns CompletedProcess (text)."""
    e = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    r = subprocess.run([OPD, *args], cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"opd {' '.join(args)} exited {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


def session(work: Path, *overrides: str):
    from stages import train
    from stages.run import config

    return train.session(config.compose([*TINY, *overrides], ROOT / "conf"))
