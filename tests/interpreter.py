"""Run a script of Triton kernel checks on CPU through Triton's interpreter: TRITON_INTERPRET=1 is
read when a kernel is defined, so the script runs in a fresh process (tests/engine/test_kernels.py,
test_draw.py). Its last line of output is JSON, returned parsed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(script: str):
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.splitlines()[-1])
