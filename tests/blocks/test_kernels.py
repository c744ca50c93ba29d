"""stages/blocks/kernels.py on CPU, through Triton's interpreter (TRITON_INTERPRET=1, read when the
kernel is defined, hence a fresh process): `project` against its fp64 reference within the bounds
derived in tests/kernel_cases.py, and decoder.fused_layer against decoder.layer. fp16: the
interpreter rounds to bf16 by truncation, unlike the GPU (bf16 runs in tests/gpu/test_gpu_kernels.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stages.blocks import kernels

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys
sys.path.insert(0, "tests")
import torch
from stages.blocks import kernels
import kernel_cases, layer_cases
kernels.usable = lambda x, act: True  # (CPU tensors: the interpreter runs the kernel)
out = {"project": [kernel_cases.check(kernels.project, "cpu", torch.float16, kernel_cases.CPU_SHAPES, s)
                   for s in range(5)],
       "layer": [layer_cases.compare("cpu", torch.float16, qwen3=q, bias=b, seed=s)
                 for s, (q, b) in enumerate([(False, False), (True, False), (False, True)])]}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.splitlines()[-1])


def test_project_within_its_derived_bounds(interpreted):
    for run in interpreted["project"]:
        assert run["bad"] == [], run
        # every flag combination the decoder uses, at several programs per matrix
        assert {lbl.split(" ", 1)[1] for lbl in run["cases"]} == {
            "plain", "norm+bias", "resid", "norm+glu", "glu+bias+resid"}
    # not vacuous: most outputs identical, a few a rounding step apart
    assert all(run["share"] < 0.05 for run in interpreted["project"])


def test_fused_layer_matches_layer(interpreted):
    # each projection agrees to a few ulps (above); wired wrongly (a weight, a residual, the gate
    # order) the layer's output would differ by O(1) of its magnitude, not by a few ulps of it
    for row in interpreted["layer"]:
        assert row["stream"] <= 8 * row["eps"], row
        assert row["cache"] <= 8 * row["eps"], row


def test_cpu_decoding_never_takes_the_kernels():
    x = torch.zeros(2, 1, 8, dtype=torch.bfloat16)
    assert not kernels.usable(x, torch.nn.functional.silu)  # CPU tensors: the decoder's own layer
    assert not kernels.usable(x.float(), torch.nn.functional.silu)
