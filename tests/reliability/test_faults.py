"""SIGKILL at named points (power loss, OOM killer) and SIGTERM/SIGINT (scheduler, Ctrl-C).

One process per kill point, chained: each restart resumes the previous one's work and dies at the
next point, so ~30 kill points cost one run's compute plus process starts. After every kill the
store holds only complete, verifiable dirs, each byte-identical to the reference run's; the last
restart completes and every artifact equals the uninterrupted reference. All processes are
read-traced (tracer.py): no stage ever opened a temp, set-aside or unverified file.
"""
from __future__ import annotations

import signal

import pytest
from harness import (FAULT_POINTS, TINY, differences, entry_differences, invalid_published, leftovers, published,
                     real_opd, wait_for)

# (OPD_FAULT, what is in flight when it fires) in the order a resumed run reaches them; a publish.*
# point's count is per process, so :2 is the second stage that process publishes.
CHAIN = [
    ("prepare.before", "nothing yet"),
    ("prompts.before", "prompts: temp dir made"),
    ("publish.after_temp_write", "prompts written, not fsynced"),
    ("publish.after_rename", "prompts renamed into place, not yet recorded"),
    ("publish.before_manifest", "the prepared record (prompts published first)"),
    ("prepare.after", "prepare done"),
    ("init.before", "policy 0"),
    ("publish.after_fsync", "policy 0 fsynced, not hashed"),
    ("publish.after_manifest", "policy 0 sealed, not renamed"),
    ("publish.before_rename", "policy 0, just before the rename"),
    ("init.after", "policy 0 published"),
    ("rollout.before", "rollout(1)"),
    ("rollout.after", "rollout(1) published"),
    ("score.before", "score(1)"),
    ("score.after", "score(1) published"),
    ("update.before", "update(1)"),
    ("update.mid", "update(1): adapter written, optimizer not"),
    ("update.after", "update(1) published"),
    ("train.between_steps", "step 1 linked into the run view"),
    ("publish.before_manifest:2", "score(2) (rollout(2) published first)"),
    ("publish.after_temp_write:2", "update(2) (score(2) published first)"),
    ("publish.after_rename:1", "update(2) renamed into place"),
    ("train.between_steps:2", "step 2 linked"),
    ("rollout.before", "rollout(3)"),
    ("score.after", "score(3) published (rollout(3) first)"),
    ("publish.after_fsync:1", "update(3) fsynced"),
    ("evaluate.before", "evaluate (update(3) published first)"),
    ("evaluate.after", "evaluate published, metrics not written"),
    ("export.before", "export: lock taken"),
    ("export.before_rename", "export: temp dir complete"),
    ("export.after", "export swapped in"),
]


def test_the_chain_covers_at_least_20_points_over_every_stage():
    points = {p.split(":")[0] for p, _ in CHAIN}
    assert len(CHAIN) >= 20 and points <= set(FAULT_POINTS)
    for stage in ("publish", "prepare", "prompts", "init", "rollout", "score", "update", "train", "evaluate",
                  "export"):
        assert any(p.startswith(stage + ".") for p in points), stage


def _assert_store_is_a_prefix_of(work, reference) -> set[str]:
    """Only complete dirs, each one byte-identical to the reference run's."""
    got = published(work.artifacts)
    assert got <= published(reference.artifacts)
    assert invalid_published(work.artifacts) == []
    computed = {e for e in got if not e.startswith(("model/", "tokenizer/"))}  # the rest are seeded copies
    assert entry_differences(work.artifacts, reference.artifacts, computed) == []
    return got


def test_sigkill_at_every_point_then_resume_is_byte_identical(fresh, reference):
    before = published(fresh.artifacts)
    for point, what in CHAIN:
        r = fresh.run(env={"OPD_FAULT": point})
        assert r.rc == -signal.SIGKILL, f"{point} ({what}) was not reached:\n{r}"
        assert f"fault injection: {point.split(':')[0]} #" in r.stderr
        print(f"{point:32s} {r.cpu_s:5.1f} CPU s")
        now = _assert_store_is_a_prefix_of(fresh, reference)
        assert before <= now, f"{point}: published work was lost: {sorted(before - now)}"
        before = now
    r = fresh.run()
    assert r.rc == 0, r
    assert differences(fresh.dir, reference.dir) == []
    assert leftovers(fresh.artifacts) == []  # every dead writer's temp dir was cleared under its lock
    assert fresh.bad_reads() == []
    # each stage was computed once in total, over all 32 processes: nothing computed was lost
    computed = fresh.computed()
    assert len(computed) == len(set(computed))


@pytest.mark.parametrize("action,rc,point", [("term", 143, "update.mid"), ("int", 130, "score.before")])
def test_sigterm_sigint_abandon_the_stage_cleanly(done, reference, action, rc, point):
    """The signal arrives mid-stage (here: sent by the process itself at a named point)."""
    done.forget("score:3", "update:3")  # (evaluate stays: update(3) is recomputed to the same bytes)
    r = done.run(env={"OPD_FAULT": f"{point}@{action}"})
    assert r.rc == rc, r
    name = "SIGTERM" if action == "term" else "SIGINT"
    assert r.stderr.strip().splitlines()[-1].startswith(f"interrupted by {name}: the stage in flight was abandoned")
    assert leftovers(done.artifacts) == []  # the abandoned stage's temp dir is gone
    _assert_store_is_a_prefix_of(done, reference)
    r = done.run()
    assert r.rc == 0, r
    assert differences(done.dir, reference.dir) == []
    assert done.bad_reads() == []


def test_real_opd_stopped_by_an_external_sigterm(done):
    """The installed console script, signalled from outside at an arbitrary moment of step 2."""
    done.forget(*(f"{st}:{k}" for st in ("rollout", "score", "update") for k in (2, 3)))
    kept = published(done.artifacts)
    p = real_opd("run", *TINY, cwd=done.dir, env={"OPD_TEST_TRACE": str(done.trace)}, wait=False)
    lines = []
    wait_for(lambda: lines.append(p.stderr.readline()) or "step 1/" in lines[-1] or p.poll() is not None)
    assert p.poll() is None, "".join(lines)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 143, "".join(lines) + err
    assert err.strip().splitlines()[-1].startswith("interrupted by SIGTERM")
    assert leftovers(done.artifacts) == []
    # (the console script imports the working tree's code, which may be newer than the fork
    # server's reference run: checked for completeness here, for byte identity in the chain above)
    assert invalid_published(done.artifacts) == []
    assert kept <= published(done.artifacts)
    assert done.bad_reads() == []
