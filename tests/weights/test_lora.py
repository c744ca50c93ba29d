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
