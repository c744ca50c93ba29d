"""lora.add on CUDA: the adapters moved to the device at once (`lora.moved_at_once`)
hold what PEFT's own per-layer moves leave: the same values to the bit, dtypes, devices, flags."""
from __future__ import annotations

import pytest
import torch
from engine_models import peft_alone, same_adapters, tiny

from stages.weights import lora
from stages.run.config import LoraCfg

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("targets", [None, ["embed_tokens", "q_proj"]])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lora_moved_at_once_on_cuda_equals_peft_moving_each(dtype, targets):
    """(An embedding's LoRA, in ParameterDicts, is PEFT's to move: left to the batch it stayed on the host.)"""
    lcfg = LoraCfg(r=4, alpha=8, **({"target_modules": targets} if targets else {}))
    ours = lora.add(tiny(seed=2).to("cuda", dtype), lcfg, seed=7)
    theirs = peft_alone(tiny(seed=2).to("cuda", dtype), lcfg, seed=7)
    per_layer = 2 * (1 if targets else 7)
    assert same_adapters(ours, theirs) == per_layer * ours.config.num_hidden_layers + (2 if targets else 0)
    assert {p.device.type for p in ours.parameters()} == {"cuda"}
