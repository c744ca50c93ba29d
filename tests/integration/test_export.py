"""The export loads with the standard one-line calls, from any directory, and owns its files: the
adapter with `AutoPeftModelForCausalLM`, the merged model with `AutoModelForCausalLM` and
`pipeline("text-generation")`; nothing in it is a link into the store, whose files are read-only."""
from __future__ import annotations

import json
import shutil
import stat
import subprocess
import sys

import pytest
import torch

from support import TINY, opd


@pytest.fixture(scope="module")
def exported(tmp_path_factory, seeded_store):
    from support import ROOT

    d = tmp_path_factory.mktemp("export")
    (d / "conf").symlink_to(ROOT / "conf")
    for part in ("tokenizer", "model"):
        shutil.copytree(seeded_store / part, d / "artifacts" / "store" / part)
    opd("stage", "train", *TINY, cwd=d)
    r = opd("stage", "export", "--merged", cwd=d)
    assert "merged (standalone)" in r.stdout
    return d


def test_adapter_and_merged_model_load_with_the_standard_calls(exported, tmp_path, monkeypatch):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    exp = exported / "artifacts" / "export" / "default"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # not the workspace: the adapter's base path must not depend on the cwd
    peft_model = AutoPeftModelForCausalLM.from_pretrained(str(exp / "adapter"), dtype=torch.float32).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(exp / "merged")).eval()
    base = AutoModelForCausalLM.from_pretrained(str(exp / "base"), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(exp / "adapter"))  # the adapter dir carries the tokenizer
    ids = tok("What is 12 plus 30?", return_tensors="pt").input_ids
    with torch.no_grad():
        lp, lm, lb = (m(ids).logits for m in (peft_model, merged, base))
    # merged = base + B A * alpha / r, in the dtype the run trained in (fp32 on CPU)
    assert merged.dtype == torch.float32
    assert torch.allclose(lm, lp, atol=1e-4), (lm - lp).abs().max()
    assert (lb - lp).abs().max() > 100 * (lm - lp).abs().max()  # the trained LoRA is in the merged weights
    gen = pipeline("text-generation", model=str(exp / "merged"))
    out = gen("What is 12 plus 30?", max_new_tokens=6, min_new_tokens=6, do_sample=False)[0]["generated_text"]
    greedy = merged.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, ids.shape[1]:]
    assert greedy.shape == (6,)
    assert out.startswith("What is 12 plus 30?") and len(out) > len("What is 12 plus 30?")
    assert out.endswith(tok.decode(greedy, skip_special_tokens=True).strip())


def test_the_export_owns_its_files_and_the_store_is_read_only(exported):
    exp = exported / "artifacts" / "export" / "default"
    store = exported / "artifacts" / "store"
    inodes = {(p.stat().st_dev, p.stat().st_ino) for p in store.rglob("*") if p.is_file()}
    files = [p for p in exp.rglob("*") if p.is_file()]
    assert files and all(not p.is_symlink() and (p.stat().st_dev, p.stat().st_ino) not in inodes for p in files)
    computed = [p for stage in ("init", "rollout", "score", "update", "evaluate", "prepared", "prompts")
                for p in (store / stage).rglob("*") if p.is_file() and not p.name.endswith(".lock")]
    assert computed and all(stat.S_IMODE(p.stat().st_mode) & 0o222 == 0 for p in computed)
    # editing the export cannot reach the store
    cfg = exp / "base" / "config.json"
    cfg.write_text(cfg.read_text().replace('"vocab_size"', '"vocab_size_edited"'))
    man = json.loads((exp / "manifest.json").read_text())
    src = store / "model" / man["digests"]["prepared"]["student"] / "config.json"
    assert "vocab_size_edited" not in src.read_text()
    assert json.loads((exp / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        str((exp / "base").resolve())


def test_an_adapter_export_imports_no_model_library(exported, tmp_path):
    """Its manifest names transformers' and peft's versions without importing either (importing peft
    brought transformers, bitsandbytes and Inductor: ~5 s of a fully reused `opd run`)."""
    w = tmp_path / "w"
    shutil.copytree(exported, w, symlinks=True)  # (the module's other tests read the merged export)
    shutil.rmtree(w / "artifacts" / "export")
    probe = ("import sys; from stages import cli; rc = cli.main(['stage', 'export']); "
             "print(rc, *[m for m in ('transformers', 'peft', 'bitsandbytes') if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", probe], cwd=w, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.split()[-1] == "0", (r.stdout, r.stderr[-2000:])  # exported, nothing imported
    man = json.loads((w / "artifacts" / "export" / "default" / "manifest.json").read_text())
    import peft
    import transformers

    assert (man["versions"]["transformers"], man["versions"]["peft"]) == (transformers.__version__, peft.__version__)
