"""The bundle's model folders under transformers 4.57 (what verl 0.8.0 runs: its vLLM extra pins
vllm<=0.12, which needs transformers<5) compute what they compute under our transformers 5.

tests/verl/tf4_child.py runs in a subprocess with transformers 4.57.6 (+ its tokenizers and
huggingface_hub) first on PYTHONPATH, everything else (torch, peft, safetensors) from this venv; the
same function runs here under 5.x. Compared: the student (base + adapter, as verl's actor loads it)
and the teacher's fp32 logits on chat-templated training prompts; the tokenizer's ids on plain and
special-token strings and on the chat template's output. The folders as the store holds them (what
transformers 5 wrote) are loaded under 4.57 too, and must fail or differ: the test can see the fault.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tf4_child
from side import env_with

TEXTS = ["Hello world", "  two spaces, a\ttab\nand a newline", "unicode: héllo wörld, 日本語, emoji 🤖",
         "<|im_start|>user\nspecial tokens<|im_end|>\n", "12 + 30 = 42; 7 * 6 = 42."]
U = 2.0 ** -24  # fp32 unit roundoff
WIDEST, BLOCKS = 192, 4  # the widest reduction (the teacher's MLP; attention sums < 50 keys); 3 layers + head


def tolerance(logits: torch.Tensor) -> float:
    """Both sides run the same weights, inputs and torch CPU kernels in fp32; they differ only in how each
    transformers version composes the ops (RoPE tables, casts, masking). Re-associating an fp32 reduction
    of n terms moves it by at most n*u of its terms' absolute sum (u = 2^-24; Higham, Accuracy and
    Stability of Numerical Algorithms, 2nd ed., eq. 3.5). Every reduction here has n <= WIDEST, and
    RMSNorm rescales each block's input, so to first order the errors of the BLOCKS blocks add: a logit
    moves by at most BLOCKS * WIDEST * u (4.6e-5) of the logits' scale. The bound is twice that. The
    faults this test exists for move logits by their own scale: a RoPE theta of 10,000 instead of
    100,000, or YaRN dropped, changed these models' logits by 25-31 at max|logit| 19-26 (measured)."""
    return 2 * BLOCKS * WIDEST * U * float(logits.abs().max())


@pytest.fixture(scope="module")
def compared(bundle_run, tmp_path_factory):
    import pyarrow.parquet as pq
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    out, work = bundle_run.out, tmp_path_factory.mktemp("tf4")
    tok = AutoTokenizer.from_pretrained(out / "base")
    chats = pq.read_table(out / "data" / "train.parquet").column("prompt").to_pylist()[:3]
    ids = [list(tok.apply_chat_template(c, tokenize=True, add_generation_prompt=True)["input_ids"]) for c in chats]
    store = json.loads((out / "compat.json").read_text())["prepared"]
    store_dir = bundle_run.dir / "artifacts" / "store" / "model"
    models = {"student": {"dir": str(out / "base"), "adapter": str(out / "adapter")},
              "teacher": {"dir": str(out / "teacher")},
              "store-student": {"dir": str(store_dir / store["student"])},
              "store-teacher": {"dir": str(store_dir / store["teacher"])}}
    job = work / "job.json"
    job.write_text(json.dumps({"models": models, "ids": ids, "tokenizer": str(out / "base"), "texts": TEXTS,
                               "chats": chats}))
    r = subprocess.run([sys.executable, str(Path(tf4_child.__file__)), str(job), str(work / "v4")],
                       env=env_with("transformers-4.57"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    v4 = json.loads((work / "v4" / "result.json").read_text())
    v4["logits"] = load_file(str(work / "v4" / "logits.safetensors"))
    ours = {"errors": {}, "tokenizer": tf4_child.tokenize(str(out / "base"), TEXTS, chats)}
    here = {"student": models["student"], "teacher": models["teacher"], "base": {"dir": str(out / "base")}}
    ours["logits"], ours["errors"] = tf4_child.logits(here, ids)
    return v4, ours, ids


def test_it_really_is_transformers_4(compared):
    v4, _, _ = compared
    assert v4["transformers"].startswith("4.57."), v4["transformers"]


@pytest.mark.parametrize("name", ["student", "teacher"])
def test_logits_match_under_transformers_4(compared, name):
    v4, ours, ids = compared
    assert not v4["errors"].get(name) and not ours["errors"], (v4["errors"], ours["errors"])
    for i in range(len(ids)):
        a, b = v4["logits"][f"{name}/{i}"], ours["logits"][f"{name}/{i}"]  # [T, V]
        assert a.shape == b.shape == (len(ids[i]), 49152) and len(ids[i]) < WIDEST  # the bound's assumption
        gap = float((a - b).abs().max())
        assert gap <= tolerance(b), f"{name} prompt {i}: max |logit gap| {gap} > {tolerance(b)}"
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("name", ["student", "teacher"])
def test_the_folders_transformers_5_wrote_would_fail_under_4(compared, name):
    """The check has power: the store's own folders (RoPE only in rope_parameters) differ under 4.57."""
    v4, ours, ids = compared
    a = v4["logits"][f"store-{name}/0"]
    b = ours["logits"]["base/0" if name == "student" else "teacher/0"]  # the store holds the base, no adapter
    assert float((a - b).abs().max()) > 100 * tolerance(b)


def test_tokenizer_gives_the_same_ids_and_chat_text(compared):
    v4, ours, _ = compared
    assert "tokenizer_error" not in v4, v4.get("tokenizer_error")
    t4, t5 = v4["tokenizer"], ours["tokenizer"]
    assert t4["class"] == "PreTrainedTokenizerFast"
    for key in ("ids", "decoded", "chat_text", "chat_ids", "chat_template_ids", "special"):
        assert t4[key] == t5[key], key
    assert t4["special"]["eos"] == "<|im_end|>" and len(t4["chat_ids"]) == 3
    assert t4["chat_template_ids"] == t4["chat_ids"]  # what verl's agent loop feeds vLLM: the rendered text's ids
