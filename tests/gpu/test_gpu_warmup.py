"""runtime.warmup on the GPU: the warm-up thread runs beside the models' loads, finishes without an
error (and so does its precompiling child), the tokenizer and the teacher are read ahead (stages/blocks/ahead.py), and the run publishes
the same digests and bytes as one without either (they compute nothing the run keeps, and the
capture and phase boundaries join them first). A damaged config.json is repaired before the warm-up reads it."""
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
    # the child compiled the engine's kernels (stages/blocks/warmup.py `_child`) and finished first
    assert "precompile_error" not in timings[on] and 0 < timings[on]["precompile_s"] < timings[on]["warmup_s"]
    assert "warmup_s" not in timings[off] and "precompile_s" not in timings[off]
    assert timings[on]["loaded_ahead"] == ["tokenizer", "teacher"] and "loaded_ahead" not in timings[off]
    entries = {e for e in published(on / "artifacts") if e.split("/")[0] in ("init", "rollout", "score", "update")}
    assert entries == {e for e in published(off / "artifacts") if e.split("/")[0] in ("init", "rollout", "score", "update")}
    assert len(entries) == 7, sorted(entries)  # init + 2 steps x rollout/score/update
    assert entry_differences(on / "artifacts", off / "artifacts", entries) == []


def test_a_damaged_config_json_is_recomputed_before_the_warmup_reads_it(tmp_path, seeded_store):
    """The warm-up reads the models' config.json on its thread, before their loads hash the dirs; a
    damaged one (same size: a shallow check passes) is found by prepare's own check of that file and
    the dir recomputed (one warning each), so the warm-up reads the repaired file and the run
    publishes what an undamaged one does."""
    bad, good = fresh(tmp_path / "bad", seeded_store), fresh(tmp_path / "good", seeded_store)
    configs = sorted((bad / "artifacts" / "store" / "model").glob("*/config.json"))
    assert len(configs) == 2
    for c in configs:
        c.write_text("x" + c.read_text()[1:])
    r = opd("stage", "train", *RUN, cwd=bad)
    opd("stage", "train", *RUN, cwd=good)
    timings = json.loads((bad / "artifacts" / "runs" / "default" / "train.json").read_text())["timings"]
    assert "warmup_error" not in timings and timings["warmup_s"] > 0
    assert sum("config.json: content hash mismatch" in ln for ln in r.stderr.splitlines()) == 2, r.stderr
    entries = {e for e in published(good / "artifacts") if e.split("/")[0] in ("init", "rollout", "score", "update")}
    assert entry_differences(bad / "artifacts", good / "artifacts", entries) == []
