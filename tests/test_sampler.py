"""The rollout engine against transformers: greedy tokens, recorded log-probs, reproducibility, EOS."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from stages import lmhead, models, sampler
from stages.config import ROOT, LoraCfg

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


def test_sample_logprobs_match_teacher_forced_recompute():
    model = with_trained_lora(tiny())
    eng = sampler.make(model, use_graphs=False)
    out = eng.generate(PROMPTS, 10, eos=EOS, pad=PAD, seed=123, temperature=0.7)
    resp = [out.tokens[b, :int(out.lengths[b])].tolist() for b in range(len(PROMPTS))]
    p = lmhead.pack(PROMPTS, resp, [[1] * len(r) for r in resp], PAD, "cpu")
    with torch.no_grad():
        h = lmhead.hidden(model, p)
        lp, *_ = lmhead.score_positions(h, lmhead.head_weight(model), p.targets, 4, 0, temperature=0.7,
                                        want_topk=False)
    rec = torch.cat([out.logprobs[b, :int(out.lengths[b])] for b in range(len(PROMPTS))])
    assert torch.allclose(lp, rec, atol=1e-4), (lp - rec).abs().max()


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
