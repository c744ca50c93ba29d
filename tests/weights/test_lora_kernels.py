"""stages/weights/lora_kernels.py on CPU, through Triton's interpreter (TRITON_INTERPRET=1, read when a
kernel is defined, hence a fresh process): a PEFT LoRA Linear's output and gradients with `install`'s
forward against the fp64 branch, within the bounds derived in tests/lora_kernel_cases.py, as PEFT's own
are; the bytes repeat. fp16: the interpreter rounds to bf16 by truncation, unlike the GPU (bf16 runs
in tests/gpu/test_gpu_lora_kernels.py). Then what `install` takes and leaves on a PEFT model."""
from __future__ import annotations

import pytest
import torch

import interpreter  # (tests/)

SCRIPT = """
import json, sys
sys.path.insert(0, "tests")
import torch
from stages.weights import lora_kernels
import lora_kernel_cases as c
lora_kernels.usable = lora_kernels.fits  # (CPU tensors: the interpreter runs the kernels)
print(json.dumps([row for seed in range(2) for row in c.check("cpu", torch.float16, c.CPU_SHAPES, seed)]))
"""


@pytest.fixture(scope="module")
def cases():
    return interpreter.run(SCRIPT)


def test_output_and_gradients_within_the_derived_bounds_as_peft_s(cases):
    assert len(cases) == 6
    for row in cases:
        ratios = {k: v for k, v in row.items() if k in ("y", "ga", "gb", "gx_lora", "gx_vs_peft")}
        assert max(ratios.values()) <= 1.0, row
        assert max(row["y_peft"], row["ga_peft"], row["gb_peft"]) <= 1.0, row  # (the bounds hold PEFT's too)
        assert row["repeat"], row


def test_most_outputs_are_peft_s_bytes(cases):
    # the two differ only in the order of fp32 sums of K and r terms, so an output's final rounding flips
    # rarely; a kernel that indexed or rounded wrongly would differ almost everywhere
    for row in cases:
        assert row["y_identical"] > 0.9, row


def test_install_takes_the_plain_fp32_lora_linears_only():
    from peft import LoraConfig, inject_adapter_in_model
    from stages.weights import lora_kernels

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.v_proj = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    m = inject_adapter_in_model(LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), Two().to(torch.bfloat16))
    for lin in (m.q_proj, m.v_proj):
        for p in (lin.lora_A["default"], lin.lora_B["default"]):
            p.float()
    assert lora_kernels.fits(m.q_proj) and not lora_kernels.usable(m.q_proj)  # (fits; on the CPU: not used)
    assert lora_kernels.install(m) == 0
    m.v_proj.lora_dropout["default"] = torch.nn.Dropout(0.1)
    m.q_proj.lora_A["default"].half()
    assert not lora_kernels.fits(m.v_proj) and not lora_kernels.fits(m.q_proj)
