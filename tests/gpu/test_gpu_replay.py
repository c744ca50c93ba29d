"""A GPU run replays byte for byte: the same short training in a fresh store publishes identical
rollout/score/update files, and so does a run SIGKILLed mid-train (while its background publish
writes update 2) and then resumed. The comparison is the reliability suite's (store entries by
manifest, then bytes); OPD_GPU_RECORD=FILE also writes what was compared there (the device lane
commits it)."""
from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from reliability.harness import entry_differences, published
from support import ROOT, TINY, opd

pytestmark = pytest.mark.gpu

RUN = [*TINY, "runtime.device=cuda", "train.updates=3", "rollout.max_new_tokens=16"]
COMPUTED = ("rollout", "score", "update")


def fresh(root: Path, name: str, seeded_store: Path) -> Path:
    d = root / name
    (d / "conf").parent.mkdir(parents=True)
    (d / "conf").symlink_to(ROOT / "conf")
    for part in ("tokenizer", "model"):
        if (seeded_store / part).exists():
            shutil.copytree(seeded_store / part, d / "artifacts" / "store" / part)
    return d


def computed(d: Path) -> set[str]:
    return {e for e in published(d / "artifacts") if e.split("/")[0] in COMPUTED}


def test_rerun_and_sigkill_resume_are_byte_identical(tmp_path, seeded_store):
    ref = fresh(tmp_path, "ref", seeded_store)
    opd("stage", "train", *RUN, cwd=ref)
    entries = computed(ref)
    assert len(entries) == 9, sorted(entries)  # 3 steps x rollout/score/update

    again = fresh(tmp_path, "again", seeded_store)
    opd("stage", "train", *RUN, cwd=again)
    assert computed(again) == entries
    rerun_diffs = entry_differences(again / "artifacts", ref / "artifacts", entries)

    killed = fresh(tmp_path, "killed", seeded_store)
    r = opd("stage", "train", *RUN, cwd=killed, env={"OPD_FAULT": "update.mid:2@kill"}, check=False)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    before = computed(killed)
    assert "update/" + json.loads((ref / "artifacts/runs/default/step-0002/state.json").read_text()
                                  )["policy"]["digest"] not in before  # update 2 was not published
    opd("stage", "train", *RUN, cwd=killed)
    assert computed(killed) == entries
    resume_diffs = entry_differences(killed / "artifacts", ref / "artifacts", entries)

    files = sorted(f"{e}/{f}" for e in entries for f in json.loads(
        (ref / "artifacts/store" / e / "manifest.json").read_text())["files"] if f != "state.json")
    record = {"test": "tests/gpu/test_gpu_replay.py", "run": RUN, "compared_files": len(files),
              "files": files, "published_before_resume": sorted(before),
              "rerun_differences": rerun_diffs, "sigkill_resume_differences": resume_diffs}
    if os.environ.get("OPD_GPU_RECORD"):
        Path(os.environ["OPD_GPU_RECORD"]).write_text(json.dumps(record, indent=1) + "\n")
    assert not rerun_diffs, rerun_diffs
    assert not resume_diffs, resume_diffs
