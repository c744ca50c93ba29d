"""Tiny random models for the engine's tests (CPU and GPU): the SmolLM2-shaped tiny Llama of
conf/arch, a LoRA made non-trivial, transformers' greedy reference, and the engine's arithmetic up
to the head. A module of its own so any test file can import it, alone or in the whole suite."""
from __future__ import annotations

import json

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from stages.engine import decoder
from stages.weights import lora
from stages.run.config import ROOT, LoraCfg

EOS, PAD = 2, 2


def tiny(name="tiny-llama", seed=0, **over):
    spec = {k: v for k, v in json.loads((ROOT / "conf/arch" / f"{name}.json").read_text()).items() if k != "_comment"}
    spec.update(over)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**spec), dtype=torch.float32).eval()


def peft_alone(base, lcfg: LoraCfg, seed: int):
    """What lora.add builds, by PEFT's own code throughout (each adapter moved as it is made)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=lcfg.r, lora_alpha=lcfg.alpha, lora_dropout=lcfg.dropout,
                     target_modules=list(lcfg.target_modules), bias="none", task_type="CAUSAL_LM")
    with lora.peft_wrap_quietly():
        return get_peft_model(base, cfg)


def same_adapters(ours, theirs) -> int:
    """Asserts two LoRA'd models hold the same parameters (names, dtypes, devices, flags, bits); returns
    how many are LoRA's."""
    a, b = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert a.keys() == b.keys()
    n = 0
    for name, p in a.items():
        q = b[name]
        assert (p.dtype, p.device, p.shape, p.requires_grad) == (q.dtype, q.device, q.shape, q.requires_grad), name
        assert torch.equal(p, q), name
        n += "lora_" in name
    return n


def with_trained_lora(model, scale=0.2):
    peft = lora.add(model, LoraCfg(r=4, alpha=8), seed=1)
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
    W = decoder.sampling_weights(model)
    B, P, N = len(prompts), max(len(x) for x in prompts), max(len(r) for r in responses)
    L = P + N
    ids = torch.full((B, L), pad, dtype=torch.long)
    for b, (x, r) in enumerate(zip(prompts, responses)):
        ids[b, P - len(x):P + len(r)] = torch.tensor(x + r)
    pad_len = torch.tensor([P - len(x) for x in prompts])
    q = torch.arange(L)
    valid = (q[None, None, :] <= q[None, :, None]) & (q[None, None, :] >= pad_len[:, None, None])
    valid = valid | ((q[None, :, None] < pad_len[:, None, None]) & (q[None, None, :] == q[None, :, None]))
    h = decoder.forward(W, ids, (q[None, :] - pad_len[:, None]).clamp_min(0), decoder.new_cache(W, B, L, "cpu"),
                         q, valid)  # [B, L, H]
    at = [(b, P - 1 + t) for b, r in enumerate(responses) for t in range(len(r))]
    return h[torch.tensor([a for a, _ in at]), torch.tensor([c for _, c in at])]
