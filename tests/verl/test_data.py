"""verl-schema prompt Parquet: `opd data sample`, reading any verl file (prompt_key, val_files), and
verl's max_prompt_length / truncation semantics under our rule (over the limit: an error unless a
truncation policy was chosen)."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from support import TINY, opd, session
from stages import prepare
from stages.rows import prompts, tables
from stages.errors import UserError


@pytest.mark.parametrize("policy", ["left", "right", "middle"])
@pytest.mark.parametrize("n,limit", [(10, 4), (9, 5), (3, 5)])
def test_truncation_is_verls(policy, n, limit):
    ids = list(range(100, 100 + n))
    got = prompts.truncate_ids(ids, limit, policy)
    want = {"left": ids[-limit:], "right": ids[:limit], "middle": ids[:limit // 2] + ids[n - (limit - limit // 2):]}
    assert got == (ids if n <= limit else want[policy])
    verl_tf = pytest.importorskip("verl.utils.torch_functional")
    if n > limit:  # verl's own postprocess_data on the same ids
        x = torch.tensor([ids])
        out, _ = verl_tf.postprocess_data(x, torch.ones_like(x), limit, 0, left_pad=True, truncation=policy)
        assert out[0].tolist() == got


def test_data_sample_writes_verl_rows_that_read_back(work):
    out = work / "sample.parquet"
    r = opd("data", "sample", "--format", "verl-parquet", "--out", str(out), "--rows", "10", "data.generator=arith",
            cwd=work)
    assert "10 rows" in r.stdout
    t = pq.read_table(out)
    assert t.schema.names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    splits = [e["split"] for e in t.column("extra_info").to_pylist()]
    assert splits.count("test") == 2 and splits.count("train") == 8
    assert all(r["ground_truth"] for r in t.column("reward_model").to_pylist())
    sess = session(work, f"data.path={out}", "data.num_train=8", "data.num_eval=2")
    prep = prepare.run(sess)
    assert (prep["num_train"], prep["num_eval"]) == (8, 2)
    r = opd("data", "sample", "--format", "csv", "--out", str(out), cwd=work, check=False)
    assert r.returncode == 2 and "--format" in r.stderr


def _write(path, rows, key="prompt"):
    msgs = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    pq.write_table(pa.Table.from_pylist([{"data_source": "x", key: m} for m in rows],
                                        pa.schema([("data_source", pa.string()), (key, msgs)])), path)


def test_any_prompt_key_and_a_separate_eval_file(work):
    train, test = work / "train.parquet", work / "test.parquet"
    _write(train, [[{"role": "user", "content": f"q{i}?"}] for i in range(6)], key="question")
    _write(test, [[{"role": "user", "content": f"t{i}?"}] for i in range(3)], key="question")
    sess = session(work, f"data.path={train}", f"data.eval_path={test}", "data.prompt_key=question")
    prep = prepare.run(sess)
    assert (prep["num_train"], prep["num_eval"]) == (6, 3)
    ev = tables.read(sess.store.path("prompts", prep["prompts"]) / "eval.parquet")
    assert ev.column("question").to_pylist()[0][0]["content"] == "t0?"


def test_a_parquet_without_the_prompt_column_is_an_error_naming_it(work):
    bad = work / "bad.parquet"
    pq.write_table(pa.table({"data_source": ["x"], "question": ["2+2?"]}), bad)
    r = opd("stage", "prepare", *TINY, f"data.path={bad}", cwd=work, check=False)
    assert r.returncode == 2 and "missing column 'prompt'" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = opd("stage", "prepare", *TINY, f"data.path={bad}", "data.prompt_key=question", cwd=work, check=False)
    assert r.returncode == 2 and "column 'question' has type string" in r.stderr


def test_over_long_prompts_error_unless_a_truncation_policy_is_chosen(work):
    long = work / "long.parquet"
    _write(long, [[{"role": "user", "content": "word " * 80}]] * 5)
    with pytest.raises(UserError, match=r"data.max_prompt_tokens = 24.*data.truncation"):
        session(work, f"data.path={long}", "data.max_prompt_tokens=24")  # prepare runs as the session opens
    from stages import rollout, train

    sess = session(work, f"data.path={long}", "data.max_prompt_tokens=24", "data.truncation=left", "train.updates=1")
    train.ensure_policy(sess, 0)
    t = pq.read_table(rollout.run(sess, 1) / "rollout.parquet")
    assert {len(p) for p in t.column("prompt_ids").to_pylist()} == {24}
