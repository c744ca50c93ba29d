"""Multi-turn tool-use rollout: config errors, the batched driver's accounting, all three
environments through the pipeline on the tiny models, masking of tool-result tokens, and the
privileged-context teacher scoring the same response tokens behind a different prompt."""
from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import numerics
from support import ROOT, opd, session
from engine_models import engine_hidden, tempered_logprob
from stages import envs, tooleval, train
from stages.run import config, runview
from stages.engine import lmhead
from stages.rows import tables, tooluse
from stages.errors import UserError
from stages.envs import protocol

ENV = ["env.num_train=6", "env.num_test=2", "env.max_turns=3", "env.max_tokens_per_turn=8", "train.updates=1"]


@pytest.mark.parametrize("override,needle", [
    (["env.name=nope"], "env.name"),
    (["env.name=calculator", "env.split=impossible"], "env.split"),
    (["sft.steps=2"], "sft.steps"),
    (["teacher_mode=privileged_context"], "teacher_mode"),
    (["env.name=calculator", "teacher_mode=protocol_sft"], "sft.teacher_steps"),
    (["env.name=calculator", "env.max_turns=0"], "env.max_turns"),
])
def test_bad_tool_config_names_the_key(override, needle):
    with pytest.raises(UserError) as e:
        config.compose(override)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_unknown_environment_exits_2(tmp_path):
    r = opd("params", "--out", str(tmp_path / "p.yaml"), "env.name=nope", cwd=ROOT, check=False)
    assert r.returncode == 2 and "env.name" in r.stderr and not (tmp_path / "p.yaml").exists()


def _scripted_episode(env, task, texts):
    t = tooluse.Traj(task, [], protocol.Episode(messages=protocol.initial_messages(env, task)))
    for text in texts[:3]:
        if tooluse.advance(env, task, t, text, truncated=False) is None:
            break
    tooluse.finish(env, task, t)
    return t


@pytest.mark.parametrize("name", sorted(envs.REGISTRY))
def test_driver_accounting_matches_run_episode(name):
    env = envs.get(name)
    task = env.generate(env.SPLITS[-1], 1, 0, "test")[0]
    oracle = [m["content"] for m in env.oracle_trace(task) if m["role"] == "assistant"]
    scripts = [oracle, ["no tags at all", '<tool_call>{"name": oops</tool_call>', "<final>wrong</final>"],
               ['<tool_call>{"name": "nope", "arguments": {}}</tool_call>'] * 3, ["<answer>x</answer>"] * 3]
    for texts in scripts:
        it = iter(texts)
        ref = protocol.run_episode(env, task, lambda _m: next(it, ""), 3, 10_000)
        got = _scripted_episode(env, task, texts).ep
        for field in ("answer", "success", "success_lenient", "turns", "tool_calls", "invalid_calls", "parse_errors",
                      "finish_reason", "messages"):
            assert getattr(got, field) == getattr(ref, field), (name, texts, field)
    assert _scripted_episode(env, task, oracle).ep.success


def test_single_turn_digests_ignore_tool_settings(work):
    a = session(work)
    b = session(work, "env.num_train=3", "env.max_turns=7", "sft.teacher_steps=5", "sft.seed=9", "sft.lr=0.5")
    for k in (1, 2):
        assert a.chain.rollout(k) == b.chain.rollout(k)
        assert a.chain.score(k) == b.chain.score(k) and a.chain.update(k) == b.chain.update(k)
    assert a.chain.policy(0) == b.chain.policy(0) and a.policy_dir(0).parent.name == "init"
    assert "tasks_train" not in a.prepared


def _spans(mask):
    """[(start, end, value)] runs of equal mask values."""
    out, s = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[s]:
            out.append((s, i, mask[s]))
            s = i
    return out


def _turn_ends(masks) -> torch.Tensor:
    """Flat indices (over all rows' response positions) of each model turn's first and last token:
    the first token after a tool result is where a wrong context would show first. The derived
    bounds (numerics.fp32_bound_through) cost one backward per position through a ~450-token forward,
    so the tool-use checks take these; test_sampler bounds every position, over many seeds."""
    out, off = [], 0
    for m in masks:
        for s, e, v in _spans(m):
            if v:
                out += sorted({off + s, off + e - 1})
        off += len(m)
    return torch.tensor(out)


@pytest.mark.parametrize("name", sorted(envs.REGISTRY))
def test_environment_runs_in_the_pipeline(work, name):
    split = "hard" if name == "calculator" else "default"
    sess = session(work, f"env.name={name}", f"env.split={split}", *ENV)
    train.run(sess)
    tok = sess.models.tokenizer()
    ro = pq.read_table(runview.step_dir(sess.run_dir, 1) / "rollout.parquet")
    sc = pq.read_table(runview.step_dir(sess.run_dir, 1) / "scores.parquet")
    assert set(tables.ROLLOUT_WITH_TASK.names) <= set(ro.column_names)
    tasks = {t.uid: t for t in tooluse.load_tasks(sess, "train")}
    for r, tl in zip(ro.to_pylist(), sc.column("teacher_logprobs").to_pylist()):
        ids, mask, lps = r["response_ids"], r["response_mask"], r["sample_logprobs"]
        assert len(ids) == len(mask) == len(lps) == len(tl)
        assert r["task_uid"] in tasks and r["reward"] == float(r["success"]) and 1 <= r["turns"] <= 3
        assert r["finish_reason"] in ("final", "max_turns") and r["data_source"] == f"opd/{name}-{split}"
        for s, e, v in _spans(mask):
            if v == 0:  # a tool message: never trained on, no sampling log-prob
                assert all(x == 0.0 for x in lps[s:e])
                assert "<tool_result>" in tok.decode(ids[s:e]) and "<|im_start|>assistant" in tok.decode(ids[s:e])
            else:  # model tokens: sampled, log-prob recorded
                assert all(x < 0 for x in lps[s:e])
        n_model_turns = sum(v for *_, v in _spans(mask))
        assert n_model_turns == r["turns"]
    # the verl-schema task rows prepare wrote
    rows = pq.read_table(sess.store.path("tasks", sess.prepared["tasks_train"]) / "tasks.parquet").to_pylist()
    assert rows[0]["reward_model"]["ground_truth"] == tasks[rows[0]["extra_info"]["uid"]].ground_truth
    # greedy held-out evaluation through the store
    d = tooleval.run(sess, "update", sess.chain.policy(1))
    assert tooleval.summarize(pq.read_table(d / "trajectories.parquet").to_pylist())["tasks"] == 2


def test_rollout_logprobs_are_the_students_on_the_whole_trajectory(work, monkeypatch):
    # the context each turn was sampled from is exactly prompt + the earlier response tokens,
    # tool results included: a teacher-forced forward reproduces every sampled log-prob
    sess = session(work, "env.name=calculator", "env.split=easy", *ENV)
    train.run(sess)
    ro = pq.read_table(runview.step_dir(sess.run_dir, 1) / "rollout.parquet")
    student = sess.models.use_policy(0)
    prompts, resps = ro.column("prompt_ids").to_pylist(), ro.column("response_ids").to_pylist()
    p = lmhead.pack(prompts, resps, ro.column("response_mask").to_pylist(), pad=0, device="cpu")
    with torch.no_grad():
        lp, *_ = lmhead.score_positions(lmhead.hidden(student, p), lmhead.head_weight(student), p.targets, 64, 1)
    mask = np.concatenate(ro.column("response_mask").to_pylist()).astype(bool)
    sampled = np.concatenate(ro.column("sample_logprobs").to_pylist())
    assert mask.sum() > 0 and (~mask).sum() > 0
    # Each side within its derived fp32 bound of the exact value (as in test_sampler: the engine
    # re-prefills each turn's context, the same per-position ops as one pass over the trajectory),
    # and the two exact values one number up to float64 rounding.
    import transformers.masking_utils as mu

    monkeypatch.setattr(mu, "_ignore_causal_mask_sdpa", lambda *a, **k: False)  # traceable: the batch is padded
    m = _turn_ends(ro.column("response_mask").to_pylist())  # each model turn's first and last token
    assert mask[m.numpy()].all() and len(m) >= 2
    head = tempered_logprob(lmhead.head_weight(student), p.targets[m], sess.cfg.rollout.temperature)
    ref_tf, b_tf = numerics.fp32_bound_through(lambda: lmhead.hidden(student, p)[m], head)
    ref_en, b_en = numerics.fp32_bound_through(lambda: engine_hidden(student, prompts, resps, pad=0)[m], head)
    numerics.check(lp[m], ref_tf, b_tf, "teacher-forced recompute")
    numerics.check(torch.from_numpy(sampled[m.numpy()]), ref_en, b_en, "sampled log-probs")
    numerics.check(ref_en, ref_tf, (b_tf + b_en) * numerics.U64 / numerics.U32, "engine vs teacher-forced, exact")


def test_privileged_teacher_prompt_differs_but_scores_the_same_tokens(work, monkeypatch):
    raw = session(work, "env.name=calculator", "env.split=hard", *ENV)
    priv = session(work, "env.name=calculator", "env.split=hard", "teacher_mode=privileged_context", *ENV)
    assert raw.chain.rollout(1) == priv.chain.rollout(1)  # the student's side is identical
    assert raw.chain.score(1) != priv.chain.score(1)
    train.run(raw)
    train.run(priv)  # same run name: the run view now shows priv's step; read raw's from the store
    ro = pq.read_table(runview.step_dir(priv.run_dir, 1) / "rollout.parquet")
    sc_p = pq.read_table(priv.store.path("score", priv.chain.score(1)) / "scores.parquet")
    sc_r = pq.read_table(raw.store.path("score", raw.chain.score(1)) / "scores.parquet")
    tok, env = priv.models.tokenizer(), envs.get("calculator")
    tasks = {t.uid: t for t in tooluse.load_tasks(priv, "train")}
    tprompts = [tooluse.teacher_ids(tok, env, tasks[u]) for u in ro.column("task_uid").to_pylist()]
    for sp, tp, uid in zip(ro.column("prompt_ids").to_pylist(), tprompts, ro.column("task_uid").to_pylist()):
        assert tp != sp and tasks[uid].oracle_hint in tok.decode(tp) and tasks[uid].oracle_hint not in tok.decode(sp)
    resp, mask = ro.column("response_ids").to_pylist(), ro.column("response_mask").to_pylist()
    p = lmhead.pack(tprompts, resp, mask, pad=0, device="cpu")
    teacher = priv.models.teacher()
    with torch.no_grad():
        want, *_ = lmhead.score_positions(lmhead.hidden(teacher, p), lmhead.head_weight(teacher), p.targets, 64, 1)
    got = np.concatenate(sc_p.column("teacher_logprobs").to_pylist())
    assert [len(x) for x in sc_p.column("teacher_logprobs").to_pylist()] == [len(r) for r in resp]
    scored = ~np.isnan(got)  # tool-result positions need no teacher: selection leaves them unscored
    assert scored.sum() > 0 and (scored <= np.concatenate(mask).astype(bool)).all()
    # The score stage and this recompute run the same teacher forward on the same batch and differ in
    # the LM-head chunk: each within the derived fp32 bound of the exact value.
    import transformers.masking_utils as mu

    monkeypatch.setattr(mu, "_ignore_causal_mask_sdpa", lambda *a, **k: False)  # traceable: the batch is padded
    s = _turn_ends(ro.column("response_mask").to_pylist())  # each model turn's first and last token
    assert scored[s.numpy()].all()
    T = priv.cfg.rollout.temperature
    ref, bound = numerics.fp32_bound_through(lambda: lmhead.hidden(teacher, p)[s],
                                             tempered_logprob(lmhead.head_weight(teacher), p.targets[s], T))
    numerics.check(torch.from_numpy(got[s.numpy()]), ref, bound, "score stage, privileged teacher")
    numerics.check(want[s], ref, bound, "recompute, privileged teacher")
    # the raw teacher scored the same tokens behind the student's prompt: other values, by more than
    # both computations' rounding bounds (checked where they differ most among these positions)
    raw_lp = np.concatenate(sc_r.column("teacher_logprobs").to_pylist())[s.numpy()]
    i = int(np.abs(got[s.numpy()] - raw_lp).argmax())
    pr = lmhead.pack(ro.column("prompt_ids").to_pylist(), resp, mask, pad=0, device="cpu")
    at = s[i:i + 1]
    _, b_raw = numerics.fp32_bound_through(lambda: lmhead.hidden(teacher, pr)[at],
                                           tempered_logprob(lmhead.head_weight(teacher), pr.targets[at], T))
    assert abs(got[s.numpy()][i] - raw_lp[i]) > float(bound[i] + b_raw[0]), (got[s.numpy()][i], raw_lp[i], bound[i], b_raw)
