"""The intra-op thread count changes no byte of a CPU run (MKL in strict reproducibility mode, which
every `opd` process and this suite's fork server set before torch loads; stages/run/reproducible.py),
and every stage records the stack that computed it, outside its identity."""
from __future__ import annotations

import json

import pytest
from harness import differences

from stages.run import reproducible
from support import DEFAULT_THREADS


def test_another_thread_count_computes_the_same_bytes(fresh, reference):
    """The reference ran with the default count (2 on a 2-core CI machine); this run computes every
    stage again with another count (digests are the same: the count is not part of them) and every
    Parquet, safetensors and JSON file must equal the reference's."""
    if not reproducible.thread_independent(reproducible.mode()):
        pytest.skip(f"MKL mode {reproducible.mode()}: the thread count is part of CPU identity here")
    other = 1 if DEFAULT_THREADS != 1 else 2
    r = fresh.run(f"runtime.threads={other}")
    assert r.rc == 0, r
    assert {"rollout/", "score/", "update/", "evaluate/"} <= {c.split("/")[0] + "/" for c in fresh.computed()}
    # the run view's config.json records the setting itself, view.json the digest of the resolved
    # config that holds it; nothing computed may differ
    settings = ("runs/default/config.json", "runs/default/view.json")
    assert [d for d in differences(fresh.dir, reference.dir) if not d.startswith(settings)] == []
    assert json.loads((fresh.artifacts / "runs/default/config.json").read_text())["runtime"]["threads"] == other
    view = json.loads((fresh.artifacts / "runs/default/view.json").read_text())
    ref_view = json.loads((reference.artifacts / "runs/default/view.json").read_text())
    assert view["digests"] == ref_view["digests"] and view["runtime"] == ref_view["runtime"]


def test_every_stage_records_the_stack_that_computed_it(reference):
    want = reproducible.stack()  # this machine and these libraries, as in the fork server's children
    states = sorted((reference.artifacts / "store").glob("*/*/state.json"))
    assert {p.parent.parent.name for p in states} >= {"init", "rollout", "score", "update", "evaluate"}
    for p in states:
        assert json.loads(p.read_text())["stack"] == want, p
    manifest = json.loads((reference.artifacts / "export" / "default" / "manifest.json").read_text())
    assert manifest["stack"] == want and manifest["stack"]["torch"] == manifest["versions"]["torch"]
