"""Model folders for verl's transformers 4.x: the rewrite of config.json and tokenizer_config.json, and
the refusal (exit 2, one line) of a model whose 4.x form has not been checked. The equivalence itself
(logits, ids under transformers 4.57) is tests/verl/test_transformers4.py."""
from __future__ import annotations

import json

import pytest

from support import opd
from stages.errors import UserError
from stages.verl import modeldir

from tinymodels import tokenizer_source, write_model


def test_rope_is_written_in_both_forms():
    five = {"model_type": "qwen3", "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                         "original_max_position_embeddings": 64}}
    both = modeldir.config_for_both(five, "x")
    assert both["rope_parameters"] == five["rope_parameters"] and both["rope_theta"] == 1e6
    assert both["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    plain = modeldir.config_for_both({"model_type": "llama", "rope_parameters": {"rope_type": "default",
                                                                                 "rope_theta": 1e5}}, "x")
    assert plain["rope_theta"] == 1e5 and plain["rope_scaling"] is None
    four = {"model_type": "llama", "rope_theta": 5e5}  # written by 4.x: left as it is
    assert modeldir.config_for_both(four, "x") == four


@pytest.mark.parametrize("conf,needle", [
    ({"model_type": "gemma3", "rope_parameters": {"rope_theta": 1e4}}, "model_type 'gemma3' has no checked"),
    ({"model_type": "qwen3", "rope_parameters": {"full_attention": {"rope_theta": 1e6}}}, "per layer type"),
    ({"model_type": "llama", "rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4}}, "rope_type one of"),
])
def test_a_form_4x_cannot_read_is_refused_naming_the_key(conf, needle):
    with pytest.raises(UserError, match=needle) as e:
        modeldir.config_for_both(conf, "teacher/config.json")
    assert str(e.value).startswith("teacher/config.json") and "\n" not in str(e.value)


def test_tokenizer_config_for_both():
    tc = modeldir.tokenizer_config_for_both({"tokenizer_class": "TokenizersBackend", "extra_special_tokens":
                                             ["<a>", "<b>"], "eos_token": "<|im_end|>"}, "x")
    assert tc == {"tokenizer_class": "PreTrainedTokenizerFast", "additional_special_tokens": ["<a>", "<b>"],
                  "eos_token": "<|im_end|>"}
    named = {"tokenizer_class": "Qwen2Tokenizer", "extra_special_tokens": {"image_token": "<img>"}}
    assert modeldir.tokenizer_config_for_both(named, "x") == named  # 4.x's AutoTokenizer takes its Fast class


def test_export_refuses_a_model_without_a_checked_4x_form(work, seeded_store):
    student = write_model(work / "gemma-student", "gemma", tokenizer_source(seeded_store), 3, hidden_size=64,
                          intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16)
    assert json.loads((student / "config.json").read_text())["model_type"] == "gemma"
    r = opd("stage", "export", "--verl", "out", f"student.name={student}", "student.keep_layers=0",
            "teacher.name=arch:tiny-llama-teacher", "teacher.init=random", "data.num_train=8", "data.num_eval=4",
            "train.updates=2", cwd=work, check=False)
    assert r.returncode == 2 and "base/config.json: model_type 'gemma' has no checked transformers 4.x form" \
        in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (work / "out").exists()
    assert not (work / "artifacts" / "store" / "init").exists()  # refused before any training
