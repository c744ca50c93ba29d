"""runtime.warmup on the GPU: the warm-up thread runs beside the models' loads, finishes without an
error, and the run publishes the same digests and bytes as one without it (it computes nothing the
run keeps, and the capture and phase boundaries join it first)."""
from __future__ import annotations

import json

import pytest

from reliability.harness import entry_differences, published
from support import TINY, opd
from test_gpu_identity import fresh

pytestmark = pytest.mark.gpu

RUN = [*TINY, "runtime.device=cuda", "train.updates=2", "rollout.max_new_tokens=16"]


def test_warmup_changes_no_byte_and_reports_its_time(tmp_path, seeded_store):
    on, off = fresh(tmp_path / "on", seeded_store), fresh(tmp_path / "off", seeded_store)
    opd("stage", "train", *RUN, cwd=on)
    opd("stage", "train", *RUN, "runtime.warmup=false", cwd=off)
    timings = {d: json.loads((d / "artifacts" / "runs" / "default" / "train.json").read_text())["timings"]
               for d in (on, off)}
    assert "warmup_error" not in timings[on] and timings[on]["warmup_s"] > 0
    assert "warmup_s" not in timings[off]
    entries = {e for e in published(on / "artifacts") if e.split("/")[0] in ("init", "rollout", "score", "update")}
    assert entries == {e for e in published(off / "artifacts") if e.split("/")[0] in ("init", "rollout", "score", "update")}
    assert len(entries) == 7, sorted(entries)  # init + 2 steps x rollout/score/update
    assert entry_differences(on / "artifacts", off / "artifacts", entries) == []
