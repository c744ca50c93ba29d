"""benchmarks/lora_kernels.py --smoke: the driver end to end on CPU through Triton's interpreter (tiny
shapes, fp16): both variants run over the workload's rows and the seven projections of each of its
layers, their outputs mostly the same bytes, and the JSON and Markdown written."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from interpreter import ROOT


def test_the_smoke_run_times_both_variants_over_the_workload_s_rows(tmp_path):
    pytest.importorskip("triton")
    cmd = [sys.executable, "benchmarks/lora_kernels.py", "--smoke", "--rows", "70", "--out", str(tmp_path)]
    p = subprocess.run(cmd, cwd=ROOT,
                       env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    both = json.loads((tmp_path / "lora-kernels.json").read_text())["workloads"]
    assert list(both) == ["smoke", "smoke@70"] and both["smoke@70"]["rows"] == 70  # (--rows: the same student)
    r = both["smoke"]
    assert (r["student"], r["rows"], r["layers"], r["iters"]) == ("tiny-llama", 2 * (48 + 8), 2, 2)
    assert set(r["layer_s"]) == {"peft", "kernels"} and min(r["layer_s"].values()) > 0
    assert r["model_s"]["peft"] == pytest.approx(r["layer_s"]["peft"] * 2, abs=1e-4)
    assert r["outputs_identical"] > 0.9  # (the rest within tests/lora_kernel_cases.py's bounds)
    assert "| smoke | tiny-llama, 112 |" in (tmp_path / "lora-kernels.md").read_text()
