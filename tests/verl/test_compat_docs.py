"""The compatibility documentation is generated from the mapping code and must match it byte for
byte; the shipped verl field snapshot must match the installed verl 0.8.0 byte for byte."""
from __future__ import annotations

import pytest

from support import ROOT, opd
from stages.errors import UserError
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


def _verl_root():
    verl = pytest.importorskip("verl")
    from pathlib import Path

    return Path(verl.__file__).parent


def test_every_written_key_is_read_where_the_docs_say():
    """Each key the bundle writes, and each ignored key's evidence, names a line of the installed verl 0.8.0
    that holds the identifier it claims."""
    from stages.verl import keys

    root = _verl_root()
    items = [(k, u) for k, u in keys.USES.items()] + [(k, u) for k, (u, _) in keys.IGNORED.items()]
    for key, u in items:
        lines = (root / u.file).read_text().splitlines()
        assert u.needle in lines[u.line - 1], f"{key}: {u.where} does not hold {u.needle!r}: {lines[u.line - 1]!r}"


def test_every_verl_line_the_docs_cite_exists():
    import re

    root = _verl_root()
    cited = set(re.findall(r"verl/([\w/]+\.py):(\d+)", (ROOT / compat.DOC).read_text()))
    assert len(cited) > 40
    for path, line in cited:
        f = root / path
        assert f.is_file() and len(f.read_text().splitlines()) >= int(line), f"verl/{path}:{line}"


def test_keys_verl_ignores_are_not_exact_and_need_no_value_verl_cannot_honour():
    from stages.verl import keys, mapping, rules

    for key in ("actor_rollout_ref.rollout.ignore_eos", "data.truncation"):  # read on no path of verl 0.8.0
        assert key in keys.IGNORED and rules.rule_for(key).kind != rules.EXACT, key
    # lora_alpha / target_modules go unread only beside lora_adapter_path, which a profile cannot set
    assert not rules.rule_for("actor_rollout_ref.model.lora_adapter_path").allowed.test("/some/adapter", {})
    eos = rules.rule_for("actor_rollout_ref.rollout.ignore_eos")
    assert eos.allowed.test(False, {}) and not eos.allowed.test(True, {})
    trunc = rules.rule_for("data.truncation")
    assert [v for v in ("error", "left", "right", "middle") if trunc.allowed.test(v, {})] == ["error", "left"]
    for sets, field in ((["actor_rollout_ref.rollout.ignore_eos=true"], "ignore_eos"),
                        (["data.truncation=middle"], "data.truncation")):
        with pytest.raises(UserError) as e:
            mapping.map_profile("verl-opd-v0.8-single-gpu-v1", "builtin:smollm2-135m-embedded-opd", sets, ["all"])
        assert field in str(e.value) and "\n" not in str(e.value)
