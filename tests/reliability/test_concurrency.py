"""Two `opd run` processes (the real console script) on one store: a lock per stage digest makes
the second wait for the first's publish and read it back; never two writers for one digest, so
every stage is computed exactly once, and both runs end with the reference run's bytes."""
from __future__ import annotations

from collections import Counter

from harness import TINY, differences, invalid_published, leftovers, published, real_opd


def test_two_processes_one_store_compute_each_stage_once(fresh, reference):
    env = {"OPD_TEST_TRACE": str(fresh.trace)}
    seeded = published(fresh.artifacts)
    a = real_opd("run", *TINY, cwd=fresh.dir, env=env, wait=False)
    b = real_opd("run", *TINY, cwd=fresh.dir, env=env, wait=False)
    (oa, ea), (ob, eb) = a.communicate(timeout=600), b.communicate(timeout=600)
    assert a.returncode == 0 and b.returncode == 0, ea + eb
    assert "evaluate:" in oa and "evaluate:" in ob
    computed = Counter(fresh.computed())
    assert computed and max(computed.values()) == 1, computed  # never two writers for one digest
    assert set(computed) == published(fresh.artifacts) - seeded  # every new dir computed exactly once
    assert invalid_published(fresh.artifacts) == []
    assert leftovers(fresh.artifacts) == []
    assert fresh.bad_reads() == []  # neither read the other's temp dir
    # both runs wrote the same run view: identical to the uninterrupted reference (store, view, export)
    # (the console script runs the working tree's code; the reference, the fork server's snapshot)
    assert differences(fresh.dir, reference.dir) == []
