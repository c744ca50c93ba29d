"""Damaged store files are detected when read (size and xxh3 content hash against the manifest);
the stage is recomputed, to the same bytes, with one warning naming the file, and the damaged copy
is set aside (never deleted). A full disk during publish leaves the store exactly as it was and
exits 75 with one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import differences, leftovers, snapshot


def _replace(p: Path, data: bytes) -> None:
    """Write a damaged file as a new inode: the test's artifacts are hard links to the reference."""
    p.unlink()
    p.write_bytes(data)


def truncate(p: Path) -> None:
    _replace(p, p.read_bytes()[: p.stat().st_size // 2])


def flip(p: Path) -> None:
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0x01
    _replace(p, bytes(b))


def mismatch(p: Path) -> None:
    """The manifest disagrees with its files: one recorded hash edited."""
    man = json.loads(p.read_text())
    first = sorted(man["files"])[0]
    man["files"][first]["xxh3_128"] = "0" * 32
    _replace(p, json.dumps(man).encode())


def drop(p: Path) -> None:
    p.unlink()


# (case, stage, step or model role, file inside the stage dir, damage, also removed so it must run)
CASES = [
    ("truncated rollout Parquet", "rollout", 2, "rollout.parquet", truncate, None),
    ("truncated scores Parquet", "score", 3, "scores.parquet", truncate, None),
    ("flipped byte in an adapter", "update", 2, "adapter/adapter_model.safetensors", flip, None),
    ("flipped byte in optimizer state", "update", 1, "optimizer.safetensors", flip, None),
    ("manifest hash mismatch", "score", 1, "manifest.json", mismatch, None),
    ("manifest missing", "rollout", 3, "manifest.json", drop, None),
    ("flipped byte in the teacher weights", "model", "teacher", "model.safetensors", flip, "score:3"),
    # read by prepare before the weights' deep check: a model dir's shallow check hashes all but the weights
    ("flipped byte in the student's config.json", "model", "student", "config.json", flip, None),
]


@pytest.mark.parametrize("case,stage,which,rel,damage,rerun", CASES, ids=[c[0] for c in CASES])
def test_damaged_file_is_detected_and_recomputed(done, reference, case, stage, which, rel, damage, rerun):
    if stage == "model":
        dig = json.loads((reference.artifacts / "runs" / "default" / "prepare.json").read_text())[which]
    else:
        dig = reference.step_digest(stage, which)
    target = done.artifacts / "store" / stage / dig / rel
    damage(target)
    if rerun:  # a stage that has to run now and therefore loads the damaged model
        done.forget(rerun)
    r = done.run()
    assert r.rc == 0, r
    warned = [ln for ln in r.stderr.splitlines() if ln.startswith("warning:")]
    named = f"artifacts/store/{stage}/{dig}"
    assert len(warned) == 1 and named in warned[0], warned
    if damage is mismatch:  # the warning names the file whose hash the manifest contradicts
        assert "content hash mismatch" in warned[0]
    else:
        assert rel in warned[0]
    assert f"{stage}/{dig}" in done.computed()  # recomputed ...
    assert differences(done.dir, reference.dir) == []  # ... to the same bytes, nothing else changed
    assert [x for x in leftovers(done.artifacts) if x.startswith(f"store/{stage}/.corrupt-{dig}")]  # kept aside
    assert done.bad_reads() == []


@pytest.mark.parametrize("point,resume", [("publish.after_temp_write", True), ("publish.after_manifest", False),
                                          ("update.mid", False), ("export.before_rename", True)])
def test_disk_full_during_publish_leaves_the_store_as_it_was(done, reference, point, resume):
    if not point.startswith("export"):  # export always runs; a store stage must have something to do
        done.forget("update:3")  # (evaluate stays: it is reused once update(3) is back)
    before = snapshot(done.artifacts)
    r = done.run(env={"OPD_FAULT": f"{point}@enospc"})
    assert r.rc == 75, r
    errors = r.errors()
    assert len(errors) == 1 and "no space left on device" in errors[0], r.stderr
    after = snapshot(done.artifacts)
    store = lambda s: {k: v for k, v in s.items() if k.startswith("store/")}  # noqa: E731
    assert store(after) == store(before)  # not one byte more or less in the store
    assert leftovers(done.artifacts) == []  # the half-written temp dir is gone
    changed = {k for k in before.keys() & after.keys() if before[k] != after[k]}
    # the run view: re-linked in place; only files that carry timings may have been rewritten
    assert changed <= {"runs/default/history.csv", "runs/default/train.json"}, changed
    assert set(before) - set(after) == set()  # the previous export, if any, is still there
    if resume:
        r = done.run()
        assert r.rc == 0, r
        assert differences(done.dir, reference.dir) == []
    assert done.bad_reads() == []
