"""The rollout engine against transformers: greedy tokens, recorded log-probs, reproducibility, EOS."""
from __future__ import annotations

import pytest
import torch

import numerics
from stages.engine import lmhead, sampler
from stages.engine.sampling import Sampling
from support import seeds
from engine_models import EOS, PAD, PROMPTS, engine_hidden, hf_greedy, tempered_logprob, tiny, with_trained_lora


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_matches_transformers_generate(arch):
    if arch == "llama":
        model = with_trained_lora(tiny())
    else:
        model = tiny("tiny-llama", model_type="qwen3", head_dim=16, attention_bias=False)
    eng = sampler.make(model, use_graphs=False)
    assert eng is not None
    n = 12
    got = eng.generate(PROMPTS, n, eos=-1, pad=PAD, seed=0, sampling=Sampling(greedy=True))  # eos=-1: never stop
    for b, p in enumerate(PROMPTS):
        assert got.tokens[b].tolist() == hf_greedy(model, p, n)


@pytest.mark.parametrize("seed", seeds(1))
def test_sample_logprobs_match_teacher_forced_recompute(seed, monkeypatch):
    model = with_trained_lora(tiny(seed=seed))
    eng = sampler.make(model, use_graphs=False)
    out = eng.generate(PROMPTS, 10, eos=EOS, pad=PAD, seed=123 + seed, sampling=Sampling(0.7))
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
    free = eng.generate(PROMPTS, 8, eos=-1, pad=PAD, seed=0, sampling=Sampling(greedy=True))
    eos = int(free.tokens[0, 3])  # pretend the 4th greedy token of row 0 is EOS
    out = eng.generate(PROMPTS, 8, eos=eos, pad=PAD, seed=0, sampling=Sampling(greedy=True))
    first = (free.tokens[0] == eos).nonzero()[0].item()
    assert bool(out.finished[0]) and int(out.lengths[0]) == first + 1
    assert out.tokens[0, first].item() == eos  # the student must learn to stop: EOS is in the response
    assert (out.tokens[0, first + 1:] == PAD).all() and (out.logprobs[0, first + 1:] == 0).all()


def test_min_new_tokens_blocks_eos():
    model = tiny()
    eng = sampler.make(model, use_graphs=False)
    free = eng.generate(PROMPTS, 8, eos=-1, pad=PAD, seed=0, sampling=Sampling(greedy=True))
    eos = int(free.tokens[0, 0])
    out = eng.generate(PROMPTS, 8, eos=eos, pad=PAD, seed=0, sampling=Sampling(greedy=True), min_new=8)
    assert int(out.lengths[0]) == 8 and (out.tokens[0] != eos).all()


def test_refresh_picks_up_a_new_policy():
    model = with_trained_lora(tiny())
    eng = sampler.make(model, use_graphs=False)
    before = eng.generate(PROMPTS, 6, eos=-1, pad=PAD, seed=0, sampling=Sampling(greedy=True)).tokens
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(-3)
    eng.refresh()
    after = eng.generate(PROMPTS, 6, eos=-1, pad=PAD, seed=0, sampling=Sampling(greedy=True)).tokens
    assert not torch.equal(before, after)
    assert after[0].tolist() == hf_greedy(model, PROMPTS[0], 6)


def test_unsupported_architecture_falls_back_with_a_warning(capsys):
    model = tiny()
    model.config.model_type = "gpt_neox"
    assert sampler.make(model, use_graphs=True) is None
    assert "fallback" in capsys.readouterr().err


def test_refresh_merges_a_lora_on_the_lm_head_too():
    from stages.weights import lora
    from stages.run.config import LoraCfg

    model = lora.add(tiny(), LoraCfg(r=4, alpha=8, target_modules=["q_proj", "lm_head"]), seed=1)
    eng = sampler.make(model, use_graphs=False)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    eng.refresh()  # a new policy version: the head's merged copy follows, as the layers' weights do
    assert torch.equal(eng.W["head"], sampler.make(model, use_graphs=False).W["head"])
    got = eng.generate(PROMPTS, 6, eos=-1, pad=PAD, seed=0, sampling=Sampling(greedy=True)).tokens
    assert got[0].tolist() == hf_greedy(model, PROMPTS[0], 6)


def test_sampling_decides_greedy_from_the_rollout_temperature_in_one_place():
    from stages.run.config import RolloutCfg

    zero, warm = RolloutCfg(temperature=0.0, top_p=0.9), RolloutCfg(temperature=0.7)
    assert Sampling.of(zero) == Sampling(1.0, 0.9, True)  # greedy, its log-probs untempered
    assert Sampling.of(warm) == Sampling(0.7, 1.0, False)
    assert Sampling.of(warm, greedy=True) == Sampling(0.7, 1.0, True)  # (tooleval: greedy at the run's temperature)
    assert len({Sampling.of(zero), Sampling(1.0, 0.9, True), Sampling()}) == 2  # hashable: keys the engine's graphs
    with pytest.raises(ValueError, match="Sampling.of"):
        Sampling(0.0)
    with pytest.raises(AttributeError):
        Sampling().greedy = True  # frozen
