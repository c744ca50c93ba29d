"""rollout(k): the student at policy version k-1 samples responses for prompt batch k.

Writes rollout.parquet (one row per trajectory, DESIGN.md contract) with the sampling log-probs.
The batch for step k is a deterministic walk over per-epoch permutations of the training prompts,
so it depends on k and the prompt set only (never on how many updates the run has in total).
"""
from __future__ import annotations

import random
import time
from pathlib import Path

import pyarrow as pa
import torch

from . import rewards, sampler, tables
from .config import logit_temperature
from .prepare import prompt_ids
from .session import Session, phase
from .store import seed_of, write_json


def batch_indices(num_prompts: int, batch_size: int, k: int, key: str) -> list[int]:
    """Prompt indices of batch k (1-based): epochs of seeded permutations, concatenated."""
    out, start = [], (k - 1) * batch_size
    for pos in range(start, start + batch_size):
        epoch, i = divmod(pos, num_prompts)
        perm = list(range(num_prompts))
        random.Random(f"{key}:{epoch}").shuffle(perm)
        out.append(perm[i])
    return out


def tokenizer(sess: Session):
    from transformers import AutoTokenizer

    if not hasattr(sess, "_tok"):
        # model_dir content-checks the whole dir (tokenizer files included) before anything is read
        sess._tok = AutoTokenizer.from_pretrained(sess.model_dir("student"))
    return sess._tok


def sample(sess: Session, student, prompt_ids: list[list[int]], max_new: int, seed: int, greedy: bool = False,
           min_new: int = 0):
    """Sample with the fast engine (or the transformers fallback) for the student's current policy."""
    r, tok = sess.cfg.rollout, tokenizer(sess)
    # temperature 0 is greedy selection (the sampler's argmax path), its log-probs untempered
    kw = dict(eos=tok.eos_token_id, pad=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
              seed=seed, temperature=logit_temperature(r), top_p=r.top_p, greedy=greedy or r.temperature == 0,
              min_new=min_new)
    eng = sess.engine()
    if eng is not None:
        return eng.generate(prompt_ids, max_new, **kw)
    return sampler.hf_generate(student, prompt_ids, max_new, **kw)


def run(sess: Session, k: int) -> Path:
    if sess.cfg.env.name:  # multi-turn episodes on a tool environment
        from . import tooluse

        return tooluse.rollout(sess, k)
    dig = sess.rollout_digest(k)

    def produce(tmp: Path) -> None:
        t_in = time.perf_counter()
        cfg, tok = sess.cfg, tokenizer(sess)
        prompts = tables.read(sess.store.path("prompts", sess.prepared["prompts"]) / "train.parquet")
        idx = batch_indices(prompts.num_rows, cfg.rollout.batch_size, k, sess.prepared["prompts"])
        idx = [i for i in idx for _ in range(cfg.rollout.n)]  # n samples per prompt, grouped
        msgs = prompts.column(cfg.data.prompt_key).to_pylist()
        sources = prompts.column("data_source").to_pylist() if "data_source" in prompts.column_names \
            else ["unknown"] * prompts.num_rows
        pids = [prompt_ids(tok, msgs[i], cfg.data) for i in idx]
        # rule reward where the prompt row carries reward_model.ground_truth (None: no reward)
        truths = [rewards.ground_truth({"reward_model": r}) for r in prompts.column("reward_model").to_pylist()] \
            if "reward_model" in prompts.column_names else [None] * prompts.num_rows
        student = sess.use_policy(k - 1, sample=True)  # engine build counts as input, not sampling
        state: dict = {"stage": "rollout", "step": k, "digest": dig}
        io = state["io_s"] = {"inputs": round(time.perf_counter() - t_in, 4)}  # outside the timed phase
        with phase(sess.device, state) as ph:
            out = sample(sess, student, pids, cfg.rollout.max_new_tokens, seed_of(dig),
                         min_new=cfg.rollout.min_new_tokens)
            ph["tokens"] = int(out.lengths.sum())
        t_out = time.perf_counter()
        rows, seen = [], {}
        for b, i in enumerate(idx):
            n = int(out.lengths[b])
            resp = out.tokens[b, :n].tolist()
            # j-th sample of prompt i in this batch: b % n, unless the batch spans an epoch boundary
            # and holds prompt i twice (then n.. 2n-1): uids stay unique
            j = seen[i] = seen.get(i, -1) + 1
            rows.append({
                "uid": f"s{k:04d}-p{i:05d}-{j}", "step": k, "policy_version": k - 1,
                "prompt_index": i, "data_source": sources[i], "prompt_ids": pids[b], "response_ids": resp,
                "response_mask": [1] * n, "sample_logprobs": out.logprobs[b, :n].tolist(),
                "finish_reason": "stop" if bool(out.finished[b]) else "length",
                "prompt_text": tok.decode(pids[b]), "response_text": tok.decode(resp),
                "reward": rewards.rule_reward(tok.decode(resp, skip_special_tokens=True), truths[i]),
            })
        scored = [r["reward"] for r in rows if r["reward"] is not None]
        if scored:
            state["reward_mean"] = round(sum(scored) / len(scored), 6)
        tables.write(tmp / "rollout.parquet", pa.Table.from_pylist(rows, tables.ROLLOUT),
                     {"digest": dig, "tokenizer": sess.prepared["tokenizer"]})
        io["outputs"] = round(time.perf_counter() - t_out, 4)
        write_json(tmp / "state.json", state)

    d, _ = sess.store.ensure("rollout", dig, produce)
    return d


def main(sess: Session, k: int) -> Path:
    from . import train

    train.ensure_policy(sess, k - 1)
    d = run(sess, k)
    print(f"rollout step {k}: {d / 'rollout.parquet'}")
    return d
