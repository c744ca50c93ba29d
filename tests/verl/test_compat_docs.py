"""The compatibility documentation is generated from the mapping code and must match it byte for
byte; the shipped verl field snapshot must match the installed verl 0.8.0 byte for byte."""
from __future__ import annotations

import pytest

from support import ROOT, opd
from stages.verl import compat, fields


def test_docs_compat_md_is_the_generated_table():
    doc = ROOT / compat.DOC
    assert doc.read_bytes() == compat.table_markdown().encode(), \
        "docs/compat.md is stale: run `opd compat table --out docs/compat.md`"


def test_verl_field_snapshot_matches_installed_verl():
    pytest.importorskip("verl")
    assert fields.SNAPSHOT.read_text() == fields.generate(), \
        "stages/verl/verl-0.8.0-fields.json is stale: run `python -m stages.verl.fields`"


def test_cli_documents_the_mapping(tmp_path):
    r = opd("profiles", "list", cwd=tmp_path)
    assert len(r.stdout.strip().splitlines()) == 5
    r = opd("profiles", "show", "verl-opd-v0.8-single-gpu-pg-k1-rewarded-v1", cwd=tmp_path)
    assert "use_task_rewards: true" in r.stdout and "data.generator=arith" in r.stdout
    r = opd("compat", "explain", "distillation.distillation_loss.topk", cwd=tmp_path)
    assert "class: exact" in r.stdout and "our key: objective.topk" in r.stdout and "default: 32" in r.stdout
    r = opd("compat", "explain", "objective.advantage", cwd=tmp_path)
    assert "algorithm.adv_estimator" in r.stdout
    r = opd("compat", "table", "--out", str(tmp_path / "compat.md"), cwd=tmp_path)
    assert (tmp_path / "compat.md").read_bytes() == (ROOT / compat.DOC).read_bytes()
    for args in (("compat", "explain", "data.max_prompt_lenght"), ("profiles", "show", "nope")):
        r = opd(*args, cwd=tmp_path, check=False)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
