"""SFT on verified oracle traces: trace verification, token layout against the chat template,
NLL goes down, the cold start becomes policy 0, and the protocol_sft teacher carries its adapter."""
from __future__ import annotations

import copy

import pytest
import torch

import numerics
from support import session
from stages import envs, sft, train
from stages.rows import tooluse
from stages.errors import UserError
from stages.run import runview
from stages.run.store import read_state
from stages.envs import protocol

TOOL = ["env.name=calculator", "env.split=hard", "env.num_train=8", "env.num_test=2", "env.max_turns=3",
        "env.max_tokens_per_turn=8"]


@pytest.mark.parametrize("name", sorted(envs.REGISTRY))
def test_oracle_traces_verify_and_tampered_ones_do_not(name):
    env = envs.get(name)
    for task in env.generate(env.SPLITS[-1], 5, 3, "train"):
        turns = env.oracle_trace(task)
        assert sft.verified(env, task, turns)
        wrong = copy.deepcopy(turns)
        wrong[-1]["content"] = "<final>definitely not it</final>"
        assert not sft.verified(env, task, wrong)
        forged = copy.deepcopy(turns)
        forged[1]["content"] = protocol.format_result({"result": 123456789})
        assert not sft.verified(env, task, forged)


def test_trace_tokens_follow_the_chat_template(work):
    sess = session(work, *TOOL)
    tok, env = sess.models.tokenizer(), envs.get("calculator")
    task = tooluse.load_tasks(sess, "train")[0]
    turns = env.oracle_trace(task)
    prompt = tooluse.initial_ids(tok, env, task)
    resp, mask = tooluse.trace_ids(tok, tooluse.glue(tok), turns)
    want = tok.apply_chat_template(protocol.initial_messages(env, task) + turns, tokenize=False)
    assert tok.decode(prompt + resp) == want.rstrip("\n")
    model_text = tok.decode([t for t, m in zip(resp, mask) if m])
    assert model_text.count(tok.eos_token) == 3 and "<tool_result>" not in model_text  # 3 assistant turns, each stops


def test_sft_lowers_nll_on_oracle_traces(work):
    sess = session(work, *TOOL, "sft.steps=6", "sft.lr=0.01")
    trs, rejected = sft.traces(sess)
    assert len(trs) == 8 and rejected == 0
    p = sft.pack(sess, trs)
    from stages import update

    update.init(sess)
    before = sft.nll(sess.models.use_adapter("init", sess.chain.init()), p, 64)
    d = sft.cold_start(sess)
    after = sft.nll(sess.models.use_policy(0), p, 64)
    assert after < before - 0.5, (before, after)
    st = read_state(d)
    assert st["traces"] == 8 and len(st["losses"]) == 6 and st["losses"][-1] < st["losses"][0]


def test_cold_start_is_policy_0_and_is_reused(work):
    sess = session(work, *TOOL, "sft.steps=2", "train.updates=1")
    assert sess.chain.policy(0) == sess.chain.cold_start() and sess.policy_dir(0).parent.name == "sft"
    train.run(sess)
    assert (runview.step_dir(sess.run_dir, 0) / "adapter").resolve() == (sess.policy_dir(0) / "adapter").resolve()
    store = work / "artifacts" / "store"
    before = {p for p in store.glob("*/*")}
    again = session(work, *TOOL, "sft.steps=2", "train.updates=1")
    train.run(again)
    assert {p for p in store.glob("*/*")} == before  # nothing recomputed
    # another seed: a different cold start, and the whole chain after it differs
    other = session(work, *TOOL, "sft.steps=2", "train.updates=1", "sft.seed=1")
    assert other.chain.policy(0) != sess.chain.policy(0) and other.chain.rollout(1) != sess.chain.rollout(1)
    # continued SFT carries on from the cold start
    stage, dig = train.sft_continued(sess, 2)
    assert stage == "sft" and dig != sess.chain.policy(0)
    assert update_state(sess, dig)["start"] == 2


def update_state(sess, dig):
    return read_state(sess.store.path("sft", dig))


def test_protocol_sft_teacher_is_base_plus_adapter(work, monkeypatch):
    raw = session(work, *TOOL)
    psft = session(work, *TOOL, "teacher_mode=protocol_sft", "sft.teacher_steps=2", "sft.lr=0.01")
    assert "teacher_adapter" in psft.chain.teacher_inputs() and "teacher_adapter" not in raw.chain.teacher_inputs()
    with pytest.raises(UserError, match="teacher adapter sft/.* is not in the store"):
        psft.models.teacher()  # the driver publishes it first
    train.ensure_teacher(psft)
    ids = torch.tensor([tooluse.initial_ids(raw.models.tokenizer(), envs.get("calculator"),
                                            tooluse.load_tasks(raw, "train")[0])])
    with torch.no_grad():
        a, b = raw.models.teacher()(ids).logits, psft.models.teacher()(ids).logits
    # the SFT adapter changes the logits by more than rounding: where they differ most, by more than
    # the derived fp32 bounds of both (numerics.fp32_bound_through, that one logit)
    t, v = divmod(int((a - b)[0].abs().argmax()), a.shape[-1])
    import transformers.masking_utils as mu

    monkeypatch.setattr(mu, "_ignore_causal_mask_sdpa", lambda *a, **k: False)  # trace one mask path
    bounds = [numerics.fp32_bound_through(lambda: m.model(input_ids=ids).last_hidden_state[0, t:t + 1],
                                          lambda h: torch.nn.functional.linear(h, m.lm_head.weight)[:, v])[1]
              for m in (raw.models.teacher(), psft.models.teacher())]
    assert float((a - b)[0, t, v].abs()) > float(bounds[0] + bounds[1]), ((a - b)[0, t, v], bounds)
    assert not hasattr(psft.models.teacher(), "peft_config")  # merged: a plain model for scoring


def test_policy0_and_tooleval_run_alone_from_the_cli(work):
    from support import TINY, opd

    args = [*TINY, "env.name=sqlite", "env.split=default", "env.num_train=4", "env.num_test=2", "env.max_turns=2",
            "env.max_tokens_per_turn=6", "sft.steps=1"]
    r = opd("tooleval", "--step", "0", *args, cwd=work)  # publishes policy 0 (the cold start), evaluates it
    assert "tooleval policy 0: strict" in r.stdout and "over 2 held-out tasks" in r.stdout
    assert len([d for d in (work / "artifacts/store/sft").iterdir() if not d.name.startswith(".")]) == 1
    assert not (work / "artifacts/store/update").exists()  # policy 0 only: no training step ran
    r = opd("tooleval", *TINY, cwd=work, check=False)
    assert r.returncode == 2 and "env.name" in r.stderr


def test_continued_sft_equals_uninterrupted_sft(work):
    # the continuation restores the optimizer state and carries the trace walk on: 2 + 2 steps give
    # exactly the losses (and so the adapter) of 4 steps in one go
    split = session(work, *TOOL, "sft.steps=2", "sft.lr=0.01")
    stage, dig = train.sft_continued(split, 2)
    whole = session(work, *TOOL, "sft.steps=4", "sft.lr=0.01")
    train.policy0(whole)
    d = whole.policy_dir(0)
    first, rest = update_state(split, split.chain.policy(0))["losses"], update_state(split, dig)["losses"]
    assert first + rest == update_state(whole, whole.chain.policy(0))["losses"]
    assert (split.store.path(stage, dig) / "adapter" / "adapter_model.safetensors").read_bytes() == \
        (d / "adapter" / "adapter_model.safetensors").read_bytes()
