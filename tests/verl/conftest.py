"""One verl bundle for the tests of this folder, exported the way a user would: a run trains one update,
then `opd stage export --verl OUT --gpus 8 --nodes 2 --teacher-gpus 4 ... train.updates=3` warm-starts the
remaining two on verl. Its models are local folders written by transformers 5 with RoPE that
transformers 4.x misreads unless the bundle rewrites it: a Llama student with rope_theta 100,000 (4.x
falls back to 10,000) and a Qwen3 teacher with YaRN scaling."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from support import ROOT, opd
from tinymodels import tokenizer_source, write_model


@pytest.fixture(scope="session")
def bundle_run(tmp_path_factory, seeded_store):
    d = tmp_path_factory.mktemp("verlrun")
    (d / "conf").symlink_to(ROOT / "conf")
    tok = tokenizer_source(seeded_store)
    student = write_model(d / "student-src", "llama", tok, 1, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rope_theta=100000.0)
    teacher = write_model(d / "teacher-src", "qwen3", tok, 2, hidden_size=96, intermediate_size=192,
                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                          rope_theta=1000000.0, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                              "original_max_position_embeddings": 64})
    args = [f"student.name={student}", "student.keep_layers=0", f"teacher.name={teacher}", "data.generator=arith", "data.num_train=12",
            "data.num_eval=4", "rollout.batch_size=6", "rollout.n=2", "rollout.max_new_tokens=8",
            "eval.max_new_tokens=8", "objective.topk=8", "objective.name=pg_k1_rewarded",
            "objective.use_policy_gradient=true",
            "optim.warmup_updates=0"]  # (an intact student's default warms up over 4: a deviation, tested apart)
    opd("stage", "train", *args, "train.updates=1", cwd=d)
    r = opd("stage", "export", "--verl", "out", "--gpus", "8", "--nodes", "2", "--teacher-gpus", "4", *args, "train.updates=3",
            cwd=d)
    return SimpleNamespace(dir=d, out=d / "out", result=r, args=args)
