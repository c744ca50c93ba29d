"""An export moved with `mv` still loads (issue #44): an adapter over a Hugging Face Hub model names
it by id and commit, so `AutoPeftModelForCausalLM.from_pretrained(<moved>/adapter)` loads from any
directory; over any other base the adapter loads over the moved export's own base/, as its manifest
says. Tiny models, CPU; the "Hub" is a Hugging Face cache made here (no network)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support import TINY, opd

HUB_ID, COMMIT = "opd-test/tiny-llama", "0123456789abcdef0123456789abcdef01234567"

# in a fresh process (the Hub settings are read at import): logits of the moved export, loaded the
# standard way (AutoPeftModelForCausalLM) when asked, and as PEFT over the export's own base/
LOAD = """
import json, sys, torch
from peft import AutoPeftModelForCausalLM, PeftModel
from transformers import AutoModelForCausalLM
exp, auto = sys.argv[1], sys.argv[2] == "auto"
ids = torch.tensor([[1, 17, 42, 99, 7]])
over_base = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(exp + "/base", dtype=torch.float32),
                                      exp + "/adapter").eval()
base = AutoModelForCausalLM.from_pretrained(exp + "/base", dtype=torch.float32).eval()
with torch.no_grad():
    a, b = over_base(ids).logits, base(ids).logits
    out = {"lora_moves_logits": (a - b).abs().max().item()}
    if auto:
        c = AutoPeftModelForCausalLM.from_pretrained(exp + "/adapter", dtype=torch.float32).eval()(ids).logits
        out["auto_vs_over_base"] = (c - a).abs().max().item()
print(json.dumps(out))
"""


def load_moved(exp: Path, cwd: Path, env: dict, auto: bool) -> dict:
    r = subprocess.run([sys.executable, "-c", LOAD, str(exp), "auto" if auto else "base"], cwd=cwd,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture
def hub_env(work, tmp_path) -> dict:
    """A Hugging Face cache holding the tiny student as Hub model HUB_ID at commit COMMIT."""
    import os

    store = work / "artifacts" / "store" / "model"
    student = next(d for d in store.iterdir() if d.is_dir() and json.loads(
        (d / "config.json").read_text())["num_hidden_layers"] == 2)  # tiny-llama
    repo = tmp_path / "hf" / f"models--{HUB_ID.replace('/', '--')}"
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    for f in student.iterdir():
        if f.name != "manifest.json":
            shutil.copy(f, snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def test_an_export_over_a_hub_model_loads_after_a_move(work, hub_env, tmp_path):
    opd("run", *TINY, f"student.name={HUB_ID}", "student.init=pretrained", "student.keep_layers=0",
        "train.updates=1", "run=hub", cwd=work, env=hub_env)
    exp = work / "artifacts" / "export" / "hub"
    acfg = json.loads((exp / "adapter" / "adapter_config.json").read_text())
    assert (acfg["base_model_name_or_path"], acfg["revision"]) == (HUB_ID, COMMIT)
    assert HUB_ID in json.loads((exp / "manifest.json").read_text())["load"]["adapter"]
    moved = tmp_path / "elsewhere" / "my-distilled"
    moved.parent.mkdir()
    shutil.move(exp, moved)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    out = load_moved(moved, cwd, hub_env, auto=True)
    assert out["auto_vs_over_base"] == 0.0 and out["lora_moves_logits"] > 0, out


def test_an_export_over_any_other_base_loads_over_its_moved_base(work, tmp_path):
    """A random-init (or pruned, or embedded) student exists only in the export's base/: the adapter
    names it by absolute path (PEFT resolves a relative one against the cwd), and after a move it
    loads over the moved base/, as the manifest says."""
    import os

    opd("run", *TINY, "train.updates=1", "run=arch", cwd=work)
    exp = work / "artifacts" / "export" / "arch"
    acfg = json.loads((exp / "adapter" / "adapter_config.json").read_text())
    assert acfg["base_model_name_or_path"] == str((exp / "base").resolve()) and acfg.get("revision") is None
    assert "PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained('base'), 'adapter')" in \
        json.loads((exp / "manifest.json").read_text())["load"]["adapter"]
    moved = tmp_path / "elsewhere" / "arch"
    moved.parent.mkdir()
    shutil.move(exp, moved)
    out = load_moved(moved, tmp_path, {**os.environ, "HF_HUB_OFFLINE": "1"}, auto=False)
    assert out["lora_moves_logits"] > 0, out
