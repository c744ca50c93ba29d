"""One verl bundle for the tests of this folder, exported the way a user would: a run trains one update,
then `opd export --verl OUT --gpus 8 --nodes 2 --teacher-gpus 4 ... train.updates=3` warm-starts the
remaining two on verl. Its models are local folders written by transformers 5 with RoPE that
transformers 4.x misreads unless the bundle rewrites it: a Llama student with rope_theta 100,000 (4.x
falls back to 10,000) and a Qwen3 teacher with YaRN scaling."""
from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from support import ROOT, TOKENIZER_DIR, opd

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def _tokenizer_source(seeded_store: Path) -> Path:
    if TOKENIZER_DIR:
        return Path(TOKENIZER_DIR)
    return next(p.parent for p in sorted((seeded_store / "model").glob("*/tokenizer.json")))


def write_model(out: Path, model_type: str, tok: Path, seed: int, **kw) -> Path:
    """A tiny random model folder as transformers 5 saves it (fp32), with the SmolLM2 tokenizer files."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = AutoConfig.for_model(model_type, vocab_size=49152, max_position_embeddings=256, tie_word_embeddings=True,
                                initializer_range=0.5, bos_token_id=1, eos_token_id=2, pad_token_id=2, **kw)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(conf, dtype=torch.float32).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tok / name).is_file():
            shutil.copyfile(tok / name, out / name)
    return out


@pytest.fixture(scope="session")
def bundle_run(tmp_path_factory, seeded_store):
    d = tmp_path_factory.mktemp("verlrun")
    (d / "conf").symlink_to(ROOT / "conf")
    tok = _tokenizer_source(seeded_store)
    student = write_model(d / "student-src", "llama", tok, 1, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rope_theta=100000.0)
    teacher = write_model(d / "teacher-src", "qwen3", tok, 2, hidden_size=96, intermediate_size=192,
                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                          rope_theta=1000000.0, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                              "original_max_position_embeddings": 64})
    args = [f"student.name={student}", "student.keep_layers=0", f"teacher.name={teacher}", "data.generator=arith", "data.num_train=12",
            "data.num_eval=4", "rollout.batch_size=6", "rollout.n=2", "rollout.max_new_tokens=8",
            "eval.max_new_tokens=8", "objective.topk=8", "objective.name=pg_k1_rewarded",
            "objective.use_policy_gradient=true"]
    opd("stage", "train", *args, "train.updates=1", cwd=d)
    r = opd("export", "--verl", "out", "--gpus", "8", "--nodes", "2", "--teacher-gpus", "4", *args, "train.updates=3",
            cwd=d)
    return SimpleNamespace(dir=d, out=d / "out", result=r, args=args)
