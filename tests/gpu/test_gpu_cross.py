"""Cross-tokenizer OPD on CUDA (objective.cross_tokenizer=spans; stages/align.py): the tiny student
learns from a teacher with another tokenizer, and a second run in a fresh store, and a run SIGKILLed
mid-update then resumed, publish the same bytes (the span sums use no atomics: objectives/spans.py)."""
from __future__ import annotations

import json
import math
import signal

import pytest
from reliability.harness import entry_differences, published
from support import opd
from test_cross_tokenizer import args, bpe  # noqa: F401 (the fixture)

pytestmark = pytest.mark.gpu

COMPUTED = ("rollout", "align", "score", "update")


def computed(d) -> set[str]:
    return {e for e in published(d / "artifacts") if e.split("/")[0] in COMPUTED}


@pytest.mark.parametrize("objective", [["objective.name=k1"], ["objective.name=forward_kl_topk", "objective.topk=8",
                                                                 "objective.use_policy_gradient=false"]])
def test_a_cross_tokenizer_run_on_cuda_replays_byte_for_byte(bpe, tmp_path, objective):  # noqa: F811
    run = [*args(bpe), *objective, "runtime.device=cuda"]
    ref, again, killed = (tmp_path / n for n in ("ref", "again", "killed"))
    for d in (ref, again, killed):
        d.mkdir()
    opd("stage", "train", *run, cwd=ref)
    entries = computed(ref)
    assert len(entries) == 8, sorted(entries)  # 2 steps x rollout/align/score/update
    steps = [json.loads((ref / f"artifacts/runs/default/step-{k:04d}/state.json").read_text()) for k in (1, 2)]
    assert all(math.isfinite(s["policy"]["loss"]) and s["policy"]["exact_token_share"] > 0.5 for s in steps)
    opd("stage", "train", *run, cwd=again)
    assert computed(again) == entries and entry_differences(again / "artifacts", ref / "artifacts", entries) == []
    r = opd("stage", "train", *run, cwd=killed, env={"OPD_FAULT": "update.mid:2@kill"}, check=False)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    opd("stage", "train", *run, cwd=killed)
    assert computed(killed) == entries and entry_differences(killed / "artifacts", ref / "artifacts", entries) == []
