"""The student's LoRA (stages/weights/lora.py): built with its adapters moved at once (`lora.moved_at_once`),
it holds what PEFT's own per-layer moves and fp32 upcast leave: the same
names, values to the bit, dtypes, devices and trainable flags (on CUDA: tests/gpu/test_gpu_lora.py)."""
from __future__ import annotations

import pytest
import torch
from engine_models import peft_alone, same_adapters, tiny

from stages.weights import lora, models
from stages.run.config import LoraCfg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lora_moved_at_once_equals_peft_moving_each(dtype):
    lcfg = LoraCfg(r=4, alpha=8)
    ours = lora.add(tiny(seed=2).to(dtype), lcfg, seed=7)
    theirs = peft_alone(tiny(seed=2).to(dtype), lcfg, seed=7)
    # every projection of every layer: A and B, cast through the base's dtype, then kept in fp32
    assert same_adapters(ours, theirs) == 2 * 7 * ours.config.num_hidden_layers
    adapters = [p for n, p in ours.named_parameters() if "lora_" in n]
    assert {p.dtype for p in adapters} == {torch.float32} and all(p.requires_grad for p in adapters)
    if dtype != torch.float32:  # the values went through the base's half precision, as PEFT's move casts them
        a = ours.get_base_model().model.layers[0].self_attn.q_proj.lora_A["default"].weight
        assert torch.equal(a, a.to(dtype).float()) and a.abs().sum() > 0
    # PEFT's moves are PEFT's again once the LoRA is built
    from peft.tuners.tuners_utils import BaseTunerLayer
    assert BaseTunerLayer._move_adapter_to_device_of_base_layer.__name__ == "_move_adapter_to_device_of_base_layer"


def test_lora_on_a_quantized_base_equals_peft_moving_each(tmp_path):
    """bitsandbytes' NF4 layers: the adapters take the layer's compute dtype, as PEFT's move gives them."""
    pytest.importorskip("bitsandbytes")
    from stages.run.config import ModelCfg

    tiny(seed=2).save_pretrained(tmp_path)
    load = lambda: models.load(tmp_path, ModelCfg(quant="nf4"), torch.device("cpu"), torch.float32)  # noqa: E731
    lcfg = LoraCfg(r=4, alpha=8)
    assert same_adapters(lora.add(load(), lcfg, seed=3), peft_alone(load(), lcfg, seed=3)) > 0


def test_a_failed_lora_build_leaves_peft_as_it_was():
    from peft.tuners.tuners_utils import BaseTunerLayer

    real = BaseTunerLayer._move_adapter_to_device_of_base_layer
    with pytest.raises(Exception, match="lora.target_modules"):
        lora.add(tiny(), LoraCfg(target_modules=["no_such_module"]), seed=0)
    assert BaseTunerLayer._move_adapter_to_device_of_base_layer is real


def test_an_embeddings_lora_is_moved_by_peft_and_the_rest_at_once():
    """An embedding's LoRA keeps its adapters in ParameterDicts: PEFT moves and casts those itself (left to
    the batch, they stayed fp32 as drawn, unrounded, and on the host); the Linear ones beside it go at once."""
    lcfg = LoraCfg(r=4, alpha=8, target_modules=["embed_tokens", "q_proj"])
    ours = lora.add(tiny(seed=2).to(torch.bfloat16), lcfg, seed=7)
    theirs = peft_alone(tiny(seed=2).to(torch.bfloat16), lcfg, seed=7)
    assert same_adapters(ours, theirs) == 2 + 2 * ours.config.num_hidden_layers
    emb = ours.get_base_model().model.embed_tokens.lora_embedding_A["default"]
    assert emb.dtype == torch.float32 and torch.equal(emb, emb.to(torch.bfloat16).float())


def _step(model, ids: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Hidden states and every LoRA gradient of one forward/backward against the fixed cotangent g."""
    model.zero_grad(set_to_none=True)
    h = model.get_base_model().model(input_ids=ids).last_hidden_state
    h.backward(g)
    return h.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if "lora_" in n}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("dtype,alpha", [(torch.bfloat16, 8), (torch.bfloat16, 4), (torch.float32, 8),
                                         (torch.bfloat16, 6)])
def test_one_pass_tails_give_peft_bytes_forward_and_backward(dtype, alpha, monkeypatch):
    """lora.one_pass_tails against PEFT's own forward, same weights and inputs: the hidden states and every
    LoRA gradient equal to the bit, for scales 2 and 1 (exact: the one-pass path) and 1.5 (PEFT's path
    kept), with B trained away from zero so that the LoRA term is not nothing."""
    lcfg = LoraCfg(r=4, alpha=alpha)
    model = lora.add(tiny(seed=2).to(dtype), lcfg, seed=7)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (3, 11), generator=gen)
    g = torch.randn(3, 11, model.config.hidden_size, generator=gen).to(dtype)
    ran = []
    tail = lora._Tail.forward
    monkeypatch.setattr(lora._Tail, "forward", staticmethod(lambda *a: ran.append(1) or tail(*a)))
    fast = _step(model, ids, g)
    assert len(ran) == (0 if alpha == 6 else 7 * model.config.num_hidden_layers)  # (1.5: PEFT's path)
    changed = [m for m in model.modules() if "forward" in vars(m)]
    assert len(changed) == 7 * model.config.num_hidden_layers  # every adapted projection
    for m in changed:
        del m.forward  # PEFT's forward again
    slow = _step(model, ids, g)
    assert torch.equal(_bits(fast[0]), _bits(slow[0])) and fast[0].abs().sum() > 0
    assert fast[1].keys() == slow[1].keys() and len(fast[1]) == 2 * len(changed)
    for n in fast[1]:
        assert torch.equal(_bits(fast[1][n]), _bits(slow[1][n])), n
    assert all(fast[1][n].abs().sum() > 0 for n in fast[1] if "lora_A" in n)
