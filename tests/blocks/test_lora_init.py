"""A fresh LoRA from stages/blocks/lora_init.py equals PEFT's own construction byte for byte (values,
dtypes, devices, parameter order, trainability) and leaves the CPU generator where PEFT leaves it, for
fp32, bf16 and NF4 bases; targets it cannot replay take PEFT's path."""
from __future__ import annotations

import pytest
import torch
from engine_models import tiny
from peft import LoraConfig, get_peft_model

from stages.blocks import lora_init, models
from stages.blocks.config import LoraCfg, ModelCfg


def _config(targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), r=16):
    return LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=list(targets), bias="none",
                      task_type="CAUSAL_LM")


def _both(make_base, config, seed=1234):
    """(PEFT's model, generator state after it), (ours, generator state after it), same seed."""
    out = []
    for build in (lambda m: get_peft_model(m, config), lambda m: lora_init.build(m, config)):
        base = make_base()
        torch.manual_seed(seed)
        with models.peft_wrap_quietly():
            m = build(base)
        out.append((m, torch.get_rng_state()))
    return out


def _same(a, b) -> int:
    pa, pb = list(a.named_parameters()), list(b.named_parameters())
    assert [n for n, _ in pa] == [n for n, _ in pb]  # the optimizer's order
    lora = 0
    for (n, x), (_, y) in zip(pa, pb):
        assert (x.dtype, x.device, x.shape, x.requires_grad) == (y.dtype, y.device, y.shape, y.requires_grad), n
        if "lora_" in n:
            lora += 1
            assert x.requires_grad and torch.equal(x.view(torch.uint8), y.view(torch.uint8)), n
    return lora


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_values_order_and_generator_state_as_peft(dtype):
    (peft_m, peft_rng), (ours, our_rng) = _both(lambda: tiny().to(dtype), _config())
    assert _same(peft_m, ours) == 2 * 7 * 2  # tiny-llama: 2 layers x 7 projections x (A, B)
    assert torch.equal(peft_rng, our_rng)
    a = dict(ours.named_parameters())["base_model.model.model.layers.1.mlp.down_proj.lora_A.default.weight"]
    b = dict(ours.named_parameters())["base_model.model.model.layers.1.mlp.down_proj.lora_B.default.weight"]
    assert a.dtype == torch.float32 and a.abs().max() > 0 and not b.any()  # PEFT's upcast; B starts at zero
    if dtype == torch.bfloat16:  # the draw went through the base's dtype, as PEFT's move to it does
        assert torch.equal(a, a.to(torch.bfloat16).float())
    x = torch.tensor([[1, 5, 6, 7]])
    assert torch.equal(peft_m(x).logits, ours(x).logits)


def test_an_lm_head_target_and_another_rank():
    (peft_m, peft_rng), (ours, our_rng) = _both(tiny, _config(("q_proj", "lm_head"), r=4))
    assert _same(peft_m, ours) == 2 * 3  # q_proj in 2 layers + lm_head
    assert torch.equal(peft_rng, our_rng)


def test_an_nf4_base(tmp_path):
    tiny().save_pretrained(tmp_path)
    base = lambda: models.load(tmp_path, ModelCfg(quant="nf4"), torch.device("cpu"), torch.float32)  # noqa: E731
    (peft_m, peft_rng), (ours, our_rng) = _both(base, _config())
    q = ours.get_base_model().model.layers[0].self_attn.q_proj
    assert type(q.base_layer).__name__ == "Linear4bit"
    assert _same(peft_m, ours) == 28 and torch.equal(peft_rng, our_rng)


def test_an_embedding_target_takes_peft_path():
    base = tiny()
    assert lora_init.build(base, _config(("embed_tokens", "q_proj"))) is None
    assert not any("lora_" in n for n, _ in base.named_parameters())  # nothing was wrapped
    torch.manual_seed(5)
    s = models.add_lora(tiny(), LoraCfg(r=4, alpha=8, target_modules=["embed_tokens", "q_proj"]), 5)
    assert any("lora_embedding_A" in n for n, _ in s.named_parameters())


def test_add_lora_uses_it():
    base = tiny()
    torch.manual_seed(0)  # (as add_lora seeds)
    with models.peft_wrap_quietly():
        peft_m = get_peft_model(base, _config(r=4))
    s = models.add_lora(tiny(), LoraCfg(r=4, alpha=8), 0)
    assert _same(peft_m, s) == 28
