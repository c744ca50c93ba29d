"""The rollout engine against transformers: greedy tokens, recorded log-probs, reproducibility, EOS."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import numerics
from stages.blocks import lmhead, models, sampler
from stages.blocks.config import ROOT, LoraCfg
from support import seeds

EOS, PAD = 2, 2


def tiny(name="tiny-llama", seed=0, **over):
    spec = {k: v for k, v in json.loads((ROOT / "conf/arch" / f"{name}.json").read_text()).items() if k != "_comment"}
    spec.update(over)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**spec), dtype=torch.float32).eval()


def with_trained_lora(model, scale=0.2):
    peft = models.add_lora(model, LoraCfg(r=4, alpha=8), seed=1)
    with torch.no_grad():  # make the adapter non-trivial so merging matters
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, scale)
    return peft


PROMPTS = [[1, 500, 600, 700, 800], [1, 42], [1, 9000, 9001, 9002]]


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=PAD, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_matches_transformers_generate(arch):
    if arch == "llama":
        model = with_trained_lora(tiny())
    else:
        model = tiny("tiny-llama", model_type="qwen3", head_dim=16, attention_bias=False)
    eng = sampler.make(model, use_graphs=False)
    assert eng is not None
    n = 12
    got = eng.generate(PROMPTS, n, eos=-1, pad=PAD, seed=0, greedy=True)  # eos=-1: never stop
    for b, p in enumerate(PROMPTS):
        assert got.tokens[b].tolist() == hf_greedy(model, p, n)


def tempered_logprob(head, targets, temperature):
    """The LM head and the tempered log-softmax at the target, per position: h [n, H] -> [n]."""
    def f(h):
        logits = torch.nn.functional.linear(h, head).float()
        return torch.log_softmax(logits / temperature, -1).gather(-1, targets[:, None])[:, 0]
    return f


def engine_hidden(model, prompts, responses, pad=PAD):
    """The engine's arithmetic over prompt + response in one pass, up to the head: LoRA merged into
    the weights (sampling_weights), the functional decoder on generate's left-padded layout; the
    hidden state that predicts each response token [n, H]. generate computes the same ops one token
    at a time (each position's q/k/v and MLP are per-position ops, each query attends over the same
    keys), so this graph's bound is the bound of what generate recorded."""
    W = sampler.sampling_weights(model)
    B, P, N = len(prompts), max(len(x) for x in prompts), max(len(r) for r in responses)
    L = P + N
    ids = torch.full((B, L), pad, dtype=torch.long)
    for b, (x, r) in enumerate(zip(prompts, responses)):
        ids[b, P - len(x):P + len(r)] = torch.tensor(x + r)
    pad_len = torch.tensor([P - len(x) for x in prompts])
    q = torch.arange(L)
    valid = (q[None, None, :] <= q[None, :, None]) & (q[None, None, :] >= pad_len[:, None, None])
    valid = valid | ((q[None, :, None] < pad_len[:, None, None]) & (q[None, None, :] == q[None, :, None]))
    shape = (W["n_layers"], B, W["n_kv"], L, W["head_dim"])
    h = sampler._forward(W, ids, (q[None, :] - pad_len[:, None]).clamp_min(0), torch.zeros(shape), torch.zeros(shape),
                         q, valid)  # [B, L, H]
    at = [(b, P - 1 + t) for b, r in enumerate(responses) for t in range(len(r))]
    return h[torch.tensor([a for a, _ in at]), torch.tensor([c for _, c in at])]


@pytest.mark.parametrize("seed", seeds(1))
def test_sample_logprobs_match_teacher_forced_recompute(seed, monkeypatch):
    model = with_trained_lora(tiny(seed=seed))
    eng = sampler.make(model, use_graphs=False)
    out = eng.generate(PROMPTS, 10, eos=EOS, pad=PAD, seed=123 + seed, temperature=0.7)
    resp = [out.tokens[b, :int(out.lengths[b])].tolist() for b in range(len(PROMPTS))]
    p = lmhead.pack(PROMPTS, resp, [[1] * len(r) for r in resp], PAD, "cpu")
    with torch.no_grad():
        h = lmhead.hidden(model, p)
        lp, *_ = lmhead.score_positions(h, lmhead.head_weight(model), p.targets, 4, 0, temperature=0.7,
                                        want_topk=False)
    rec = torch.cat([out.logprobs[b, :int(out.lengths[b])] for b in range(len(PROMPTS))])
    # Each side's fp32 error bound from its own ops (numerics.fp32_bound: the transformers forward;
    # the merged-weight decoder), around the exact value. Tracing needs transformers' mask builder
    # not to branch on the data: it builds the padding mask either way (this batch is padded).
    import transformers.masking_utils as mu

    monkeypatch.setattr(mu, "_ignore_causal_mask_sdpa", lambda *a, **k: False)
    head = tempered_logprob(lmhead.head_weight(model), p.targets, 0.7)  # the engine's head: the same tensor
    ref_tf, b_tf = numerics.fp32_bound_through(lambda: lmhead.hidden(model, p), head)
    ref_en, b_en = numerics.fp32_bound_through(lambda: engine_hidden(model, PROMPTS, resp), head)
    numerics.check(lp, ref_tf, b_tf, "teacher-forced recompute")
    numerics.check(rec, ref_en, b_en, "engine's recorded log-probs")
    # the two exact values are one number (merged and unmerged LoRA, one pass or token by token):
    # they may differ only by float64 rounding, the same analysis at u = 2^-53
    numerics.check(ref_en, ref_tf, (b_tf + b_en) * numerics.U64 / numerics.U32, "engine vs teacher-forced, exact")


def test_sampling_reproduces_exactly_from_the_seed_and_differs_across_seeds():
    model = tiny()
    eng = sampler.make(model, use_graphs=False)
    a = eng.generate(PROMPTS, 16, eos=EOS, pad=PAD, seed=7)
    b = eng.generate(PROMPTS, 16, eos=EOS, pad=PAD, seed=7)
    c = eng.generate(PROMPTS, 16, eos=EOS, pad=PAD, seed=8)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.tokens, c.tokens)
    # the transformers fallback draws the same uniforms: same tokens for the same weights
    f = sampler.hf_generate(model, PROMPTS, 16, eos=EOS, pad=PAD, seed=7)
    assert torch.equal(a.tokens, f.tokens)


def test_eos_stops_each_sequence_and_is_kept_in_the_response():
    model = tiny()
    eng = sampler.make(model, use_graphs=False)
    free = eng.generate(PROMPTS, 8, eos=-1, pad=PAD, seed=0, greedy=True)
    eos = int(free.tokens[0, 3])  # pretend the 4th greedy token of row 0 is EOS
    out = eng.generate(PROMPTS, 8, eos=eos, pad=PAD, seed=0, greedy=True)
    first = (free.tokens[0] == eos).nonzero()[0].item()
    assert bool(out.finished[0]) and int(out.lengths[0]) == first + 1
    assert out.tokens[0, first].item() == eos  # the student must learn to stop: EOS is in the response
    assert (out.tokens[0, first + 1:] == PAD).all() and (out.logprobs[0, first + 1:] == 0).all()


def test_min_new_tokens_blocks_eos():
    model = tiny()
    eng = sampler.make(model, use_graphs=False)
    free = eng.generate(PROMPTS, 8, eos=-1, pad=PAD, seed=0, greedy=True)
    eos = int(free.tokens[0, 0])
    out = eng.generate(PROMPTS, 8, eos=eos, pad=PAD, seed=0, greedy=True, min_new=8)
    assert int(out.lengths[0]) == 8 and (out.tokens[0] != eos).all()


def test_refresh_picks_up_a_new_policy():
    model = with_trained_lora(tiny())
    eng = sampler.make(model, use_graphs=False)
    before = eng.generate(PROMPTS, 6, eos=-1, pad=PAD, seed=0, greedy=True).tokens
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(-3)
    eng.refresh()
    after = eng.generate(PROMPTS, 6, eos=-1, pad=PAD, seed=0, greedy=True).tokens
    assert not torch.equal(before, after)
    assert after[0].tolist() == hf_greedy(model, PROMPTS[0], 6)


def test_unsupported_architecture_falls_back_with_a_warning(capsys):
    model = tiny()
    model.config.model_type = "gpt_neox"
    assert sampler.make(model, use_graphs=True) is None
    assert "fallback" in capsys.readouterr().err
