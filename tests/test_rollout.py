"""stages/rollout.py: each rollout row carries its own prompt's ids, source and reward."""
from stages import train
from stages.rows import prompts, rewards, tables
from support import session


def test_rows_match_the_prompts_they_sample_across_an_epoch_boundary(work):
    """Batch 3 of 3 prompts x 2 samples over 8 prompts spans epochs 0 and 1 (prompt positions 6, 7,
    then epoch 1's first): every row holds the ids, text and rule reward of the prompt row its
    prompt_index names (a reward only where that prompt has a ground truth), and uids stay unique."""
    sess = session(work, "runtime.threads=1", "rollout.batch_size=3", "rollout.n=2")
    train.run(sess)  # (updates 1-2: rollouts 2-3 sample policies 1-2)
    tok = sess.models.tokenizer()
    src = tables.read(sess.store.path("prompts", sess.prepared["prompts"]) / "train.parquet").to_pylist()
    truths = [rewards.ground_truth(r) for r in src]
    assert any(truths) and not all(truths)  # arith_words: prompts with and without a ground truth
    seen = set()
    for k in (1, 2, 3):
        ro = tables.read(sess.store.path("rollout", sess.chain.rollout(k)) / "rollout.parquet").to_pylist()
        idx = prompts.batch_indices(len(src), 3, k, sess.prepared["prompts"])
        assert [r["prompt_index"] for r in ro] == [i for i in idx for _ in range(2)]
        for r in ro:
            p = src[r["prompt_index"]]
            assert r["prompt_ids"] == prompts.prompt_ids(tok, p["prompt"], sess.cfg.data)
            assert r["prompt_text"] == tok.decode(r["prompt_ids"]) and r["data_source"] == p["data_source"]
            truth = truths[r["prompt_index"]]
            assert r["reward"] == rewards.rule_reward(tok.decode(r["response_ids"], skip_special_tokens=True), truth)
            assert (r["reward"] is None) == (truth is None)
            assert r["uid"] not in seen
            seen.add(r["uid"])
    assert len(seen) == 18
    # what Session.hand_on writes beside the table: the stage digest, the tokenizer and each stage's own keys
    import pyarrow.parquet as pq

    for stage, name, own in (("rollout", "rollout.parquet", {}),
                             ("score", "scores.parquet", {b"opd.topk": b"8", b"opd.selection": b"all"})):
        dig = getattr(sess.chain, stage)(2)
        md = pq.read_schema(sess.store.path(stage, dig) / name).metadata
        assert md[b"opd.digest"] == dig.encode() and md[b"opd.tokenizer"] == sess.prepared["tokenizer"].encode()
        assert {k: md[k] for k in own} == own
