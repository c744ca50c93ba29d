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
rows = []
for programs in (lora_kernels.PROGRAMS, 1):  # the sums in chunks (these shapes' rows are few), and whole
    lora_kernels.PROGRAMS = programs
    rows += [dict(row, programs=programs) for seed in range(2)
             for row in c.check("cpu", torch.float16, c.CPU_SHAPES, seed)]
print(json.dumps(rows))
"""


@pytest.fixture(scope="module")
def cases():
    return interpreter.run(SCRIPT)


def test_output_and_gradients_within_the_derived_bounds_as_peft_s(cases):
    assert len(cases) == 12
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


def test_the_sums_are_cut_into_chunks_by_the_shapes_until_the_launch_has_enough_programs():
    pytest.importorskip("triton")
    from stages.weights import lora_kernels
    from stages.weights.lora_kernels import BLOCK, PROGRAMS, SPLIT, _chunk

    assert PROGRAMS == 256 and BLOCK == 64
    # workload a's 768 rows, 12 row blocks: K = 960's products in 15 chunks of BLOCK (180 programs, the most)
    assert _chunk(12, 960, 1024) == 64
    assert _chunk(12, 2560, 4096) == 64  # (12 x 20 = 240 programs at 128: too few)
    # the weight gradients at a: 15 column blocks x 12 chunks of 64 rows; at b (40,960 rows) whole SPLITs
    assert _chunk(15, 768, SPLIT) == 64 and _chunk(16, 40960, SPLIT) == SPLIT
    assert _chunk(640, 1024, 1024) == 1024  # b's rows: 640 row blocks, K whole

    # what each op launches: a's gate_proj sums in chunks everywhere (a sum each); b's only over the rows
    # (40 splits of SPLIT rows, as before the chunks)
    assert lora_kernels.launches(768, 960, 2560) == {"lora_down": 2, "lora_tail": 1, "lora_grads": 4 + 3}
    assert lora_kernels.launches(40960, 1024, 3072) == {"lora_down": 1, "lora_tail": 1, "lora_grads": 4 + 2}


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
    # where the kernels do not apply, `forward` is PEFT's own (no kernel runs: this is the CPU, no interpreter)
    x = torch.randn(3, 8).to(torch.bfloat16)
    m.q_proj.base_layer.weight.requires_grad_(True)  # a base being trained
    assert torch.equal(lora_kernels.forward(m.q_proj, x), type(m.q_proj).forward(m.q_proj, x))
    m.q_proj.base_layer.weight.requires_grad_(False)
    m.q_proj.enable_adapters(False)  # (as PEFT's `disable_adapter()` does)
    assert torch.equal(lora_kernels.forward(m.q_proj, x), m.q_proj.base_layer(x))
    wide = inject_adapter_in_model(LoraConfig(r=128, target_modules=["q_proj"]), Two().to(torch.bfloat16))
    wide.q_proj.lora_A["default"].float(), wide.q_proj.lora_B["default"].float()
    assert not lora_kernels.fits(wide.q_proj)  # (past LORA_KERNELS_MAX_RANK: PEFT's forward)
    m.v_proj.lora_dropout["default"] = torch.nn.Dropout(0.1)
    m.q_proj.lora_A["default"].half()
    assert not lora_kernels.fits(m.v_proj) and not lora_kernels.fits(m.q_proj)


SIGNATURES = {  # each kernel's arguments as the launches in stages/weights/lora_kernels.py pass them
    "_to_rank": ({"p": "*bf16", "w": "*fp32", "out": "*fp32", "N": "i32", "K": "i32", "Rt": "i32", "s": "fp32",
                  "sw_k": "i32", "sw_r": "i32", "KC": "i32", "SCALE": "constexpr", "R": "constexpr", "B": "constexpr"},
                 {"SCALE": True, "R": 16, "B": 64}),
    "_tail": ({"res": "*bf16", "xa": "*fp32", "b": "*fp32", "y": "*bf16", "N": "i32", "O": "i32", "Rt": "i32",
               "s": "fp32", "R": "constexpr", "B": "constexpr"}, {"R": 16, "B": 64}),
    "_from_rank": ({"gxa": "*fp32", "a": "*fp32", "gx": "*bf16", "base": "*bf16", "N": "i32", "K": "i32", "Rt": "i32",
                    "HAS_BASE": "constexpr", "R": "constexpr", "B": "constexpr"}, {"HAS_BASE": True, "R": 16, "B": 64}),
    "_wgrad_kernel": ({"m": "*bf16", "v": "*fp32", "part": "*fp32", "N": "i32", "P": "i32", "Rt": "i32", "s": "fp32",
                       "sp": "i32", "sr": "i32", "SPLIT": "i32", "R": "constexpr", "B": "constexpr"},
                      {"R": 16, "B": 64}),
}


@pytest.mark.parametrize("arch", [80, 90])
def test_the_kernels_compile_for_the_gpu_and_the_tail_rounds_as_peft_does(arch):
    """Without a GPU: Triton compiles each kernel to a cubin for Ampere and Hopper with its own ptxas (the
    interpreter above checks no GPU lowering). The tail's PTX multiplies by the scale and adds the base
    output as separate fp32 ops, FP fusion off (PEFT rounds both), and rounds to bf16 to nearest; the
    fp32 products are FMAs (no TF32 tensor-core instruction)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from stages.weights import lora_kernels

    for name, (sig, consts) in SIGNATURES.items():
        k = triton.compile(ASTSource(fn=getattr(lora_kernels, name), signature=sig, constexprs=consts),
                           target=GPUTarget("cuda", arch, 32), options={"enable_fp_fusion": False, "num_warps": 4})
        assert k.asm["cubin"], name
        ptx = k.asm["ptx"]
        assert "fma.rn.f32" in ptx and "mma" not in ptx and "tf32" not in ptx, name
        if name == "_tail":
            assert "mul.rn.f32" in ptx or "mul.f32" in ptx
            assert "add.rn.f32" in ptx or "add.f32" in ptx
            assert "cvt.rn.bf16.f32" in ptx
