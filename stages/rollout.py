"""rollout(k): the student at policy version k-1 samples responses for prompt batch k.

Writes rollout.parquet (one row per trajectory, the contract in docs/architecture.md) with the
sampling log-probs; with a tool environment (env.name), multi-turn episodes (stages/rows/tooluse.py).
With rollout.sampler=teacher (the off-policy control) the teacher samples them instead, with the same
settings and seed rule, and sample_logprobs are the teacher's (the behaviour policy's).
The batch for step k is a deterministic walk over per-epoch permutations of the training prompts,
so it depends on k and the prompt set only (never on how many updates the run has in total).
"""
from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa

from . import envs
from .engine import sampler
from .engine.sampling import Sampling
from .rows import prompts, rewards, tables, tooluse
from .run.store import seed_of
from .session import Session, phase


def run(sess: Session, k: int) -> Path:
    if sess.cfg.env.name:  # multi-turn episodes on a tool environment
        return episodes(sess, k)
    dig = sess.chain.rollout(k)

    def produce(tmp: Path) -> None:
        t_in = time.perf_counter()
        cfg, tok = sess.cfg, sess.models.tokenizer()
        rows_in = sess.table("prompts", sess.prepared["prompts"], "train.parquet")
        idx = prompts.batch_indices(rows_in.num_rows, cfg.rollout.batch_size, k, sess.prepared["prompts"])
        idx = [i for i in idx for _ in range(cfg.rollout.n)]  # n samples per prompt, grouped
        # the batch's rows only, in batch order: whole columns as Python cost a thousand times more
        # per step for 50,000 prompts (docs/performance.md)
        batch_rows = rows_in.take(pa.array(idx, pa.int64()))
        col = lambda name, fill: batch_rows.column(name).to_pylist() if name in batch_rows.column_names \
            else [fill] * len(idx)  # noqa: E731
        pids = [prompts.prompt_ids(tok, m, cfg.data) for m in batch_rows.column(cfg.data.prompt_key).to_pylist()]
        sources = col("data_source", "unknown")
        # rule reward where the prompt row carries reward_model.ground_truth (None: no reward)
        truths = [rewards.ground_truth({"reward_model": r}) for r in col("reward_model", None)]
        state: dict = {"stage": "rollout", "step": k, "digest": dig}
        meta = {}
        if cfg.rollout.sampler == "teacher":  # the off-policy control: the teacher samples
            generate = teacher_sampler(sess)
            state["sampler"] = meta["sampler"] = "teacher"
        else:
            sess.models.use_policy(k - 1, sample=True)  # engine build counts as input, not sampling
            generate = sess.models.generate
        io = state["io_s"] = {"inputs": round(time.perf_counter() - t_in, 4)}  # outside the timed phase
        with phase(sess.device, state) as ph:
            out = generate(pids, cfg.rollout.max_new_tokens, seed_of(dig), min_new=cfg.rollout.min_new_tokens)
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
                "prompt_index": i, "data_source": sources[b], "prompt_ids": pids[b], "response_ids": resp,
                "response_mask": [1] * n, "sample_logprobs": out.logprobs[b, :n].tolist(),
                "finish_reason": "stop" if bool(out.finished[b]) else "length",
                "prompt_text": tok.decode(pids[b]), "response_text": tok.decode(resp),
                "reward": rewards.rule_reward(tok.decode(resp, skip_special_tokens=True), truths[b]),
            })
        scored = [r["reward"] for r in rows if r["reward"] is not None]
        if scored:
            state["reward_mean"] = round(sum(scored) / len(scored), 6)
        table = pa.Table.from_pylist(rows, tables.ROLLOUT)
        io["outputs"] = round(time.perf_counter() - t_out, 4)
        return sess.hand_on("rollout", dig, "rollout.parquet", table, meta, state)

    d, _ = sess.store.ensure("rollout", dig, produce, background=sess.background_publish)
    return d


def teacher_sampler(sess: Session):
    """generate(prompt_ids, max_new, seed, min_new) sampling the teacher with the run's Sampling (as
    Resident.generate samples the student): evaluate's machinery, the rollout engine made on the teacher
    (or the transformers fallback). Built per rollout, before the timed phase, and dropped with it: the
    engine's weight copies and graphs are not kept between steps (the memory plan counts them in the rollout
    phase alone)."""
    sess.models.activate("teacher")  # placement swap: the student waits in host memory
    teacher, tok = sess.models.teacher(), sess.models.tokenizer()
    engine = sampler.make(teacher, sess.cfg.rollout.cuda_graphs, sess.models.compiled_decode, sess.models.before_capture)
    kw = dict(eos=tok.eos_token_id, pad=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
              sampling=Sampling.of(sess.cfg.rollout))

    def generate(prompt_ids: list[list[int]], max_new: int, seed: int, min_new: int = 0):
        if engine is not None:
            return engine.generate(prompt_ids, max_new, seed=seed, min_new=min_new, **kw)
        return sampler.hf_generate(teacher, prompt_ids, max_new, seed=seed, min_new=min_new, **kw)

    return generate


# ---- multi-turn episodes on a tool environment (env.name set) ----

def episodes(sess: Session, k: int) -> Path:
    dig = sess.chain.rollout(k)

    def produce(tmp: Path) -> None:
        cfg, tok = sess.cfg, sess.models.tokenizer()
        env = envs.get(cfg.env.name)
        tasks = tooluse.load_tasks(sess, "train")
        idx = prompts.batch_indices(len(tasks), cfg.rollout.batch_size, k, f"{sess.prepared['tasks_train']}:{cfg.train.seed}")
        idx = [i for i in idx for _ in range(cfg.rollout.n)]  # n samples per task, grouped
        sess.models.use_policy(k - 1, sample=True)  # engine built before the timed phase
        state: dict = {"stage": "rollout", "step": k, "digest": dig, "env": cfg.env.name}
        with phase(sess.device, state) as ph:
            trajs = tooluse.run_episodes(sess, env, [tasks[i] for i in idx], cfg.env.max_turns, cfg.env.max_tokens_per_turn,
                                 seed_of(dig))
            ph["tokens"] = sum(sum(t.mask) for t in trajs)
        rows = []
        for b, (i, t) in enumerate(zip(idx, trajs)):
            rows.append({
                "uid": f"s{k:04d}-p{i:05d}-{b % cfg.rollout.n}", "step": k, "policy_version": k - 1,
                "prompt_index": i, "data_source": envs.data_source(cfg.env.name, t.task.split),
                "prompt_ids": t.prompt, "response_ids": t.resp, "response_mask": t.mask,
                "sample_logprobs": t.logprobs, "finish_reason": t.ep.finish_reason,
                "prompt_text": tok.decode(t.prompt), "response_text": tok.decode(t.resp), **tooluse.task_columns(t)})
        state["success_rate"] = round(sum(r["success"] for r in rows) / len(rows), 6)
        state["reward_mean"] = state["success_rate"]
        return sess.hand_on("rollout", dig, "rollout.parquet", pa.Table.from_pylist(rows, tables.ROLLOUT_WITH_TASK),
                            {"env": cfg.env.name}, state)

    d, _ = sess.store.ensure("rollout", dig, produce, background=sess.background_publish)
    return d
