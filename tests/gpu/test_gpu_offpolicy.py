"""The off-policy control on CUDA (rollout.sampler=teacher, objective.name=nll): the teacher samples
every rollout with its own engine, the student trains on them, and a second run in a fresh store
publishes the same bytes."""
from __future__ import annotations

import json
import math

import pytest
from reliability.harness import entry_differences, published
from support import TINY, opd

pytestmark = pytest.mark.gpu

RUN = [*TINY, "runtime.device=cuda", "train.updates=2", "rollout.max_new_tokens=16", "rollout.sampler=teacher",
       "objective.name=nll"]


def test_teacher_sampled_sft_on_cuda_replays_byte_for_byte(tmp_path):
    ref, again = tmp_path / "ref", tmp_path / "again"
    for d in (ref, again):
        d.mkdir()
        opd("stage", "train", *RUN, cwd=d)
    entries = {e for e in published(ref / "artifacts") if e.split("/")[0] in ("rollout", "score", "update")}
    assert len(entries) == 6
    st = json.loads((ref / "artifacts/runs/default/step-0002/state.json").read_text())
    assert st["rollout"]["sampler"] == "teacher" and math.isfinite(st["policy"]["loss"])
    assert entry_differences(again / "artifacts", ref / "artifacts", entries) == []
