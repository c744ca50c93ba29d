"""stages/weights/lora_kernels.py on the GPU, bf16: a PEFT LoRA Linear's output and gradients with the
kernels against the fp64 branch within the bounds derived in tests/lora_kernel_cases.py (PEFT's own
meet them too), at the real widths of SmolLM2-360M and Qwen3-0.6B up to workload b's 41,000 rows;
the bytes repeat; a captured graph of forward and backward replays the eager bytes; and lora.add
with kernels on a tiny Llama: every projection installed, and with B = 0 (policy 0) PEFT's bytes."""
from __future__ import annotations

import pytest
import torch
from engine_models import tiny

import lora_kernel_cases as cases
from stages.run.config import LoraCfg
from stages.weights import lora, lora_kernels

pytestmark = pytest.mark.gpu


def test_within_the_derived_bounds_at_the_real_widths_and_deterministic():
    for row in cases.check("cuda", torch.bfloat16, cases.GPU_SHAPES, 0):
        print(row)
        assert max(row[k] for k in ("y", "ga", "gb", "gx_lora", "gx_vs_peft")) <= 1.0, row
        assert max(row["y_peft"], row["ga_peft"], row["gb_peft"]) <= 1.0, row
        assert row["repeat"] and row["y_identical"] > 0.9, row


def test_a_captured_forward_and_backward_replays_the_eager_bytes():
    gen = torch.Generator().manual_seed(1)
    lin = cases.layer(960, 2560, 16, 32.0, torch.bfloat16, "cuda", gen)
    assert lora_kernels.install(lin) == 1
    x = torch.randn(2048, 960, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    g = torch.randn(2048, 2560, generator=gen).to("cuda", torch.bfloat16)
    eager = cases.run_branch(lin, x, g)
    a, b = lin.lora_A["default"].weight, lin.lora_B["default"].weight

    def step():
        a.grad = b.grad = x.grad = None
        y = lin(x)
        y.backward(g)
        return y

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # (a warm-up pass before capture, as graphs.py does)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, eager[0]) and torch.equal(x.grad, eager[1])
    assert torch.equal(a.grad, eager[2]) and torch.equal(b.grad, eager[3])


def test_lora_add_installs_every_projection_and_policy_0_is_peft_s_bytes():
    lcfg = LoraCfg(r=8, alpha=16)
    ours = lora.add(tiny(seed=3).to("cuda", torch.bfloat16), lcfg, seed=5, kernels=True)
    theirs = lora.add(tiny(seed=3).to("cuda", torch.bfloat16), lcfg, seed=5)
    assert sum(getattr(m.forward, "func", None) is lora_kernels.forward for m in ours.modules()) \
        == 7 * ours.config.num_hidden_layers
    ids = torch.arange(40, device="cuda").view(2, 20) % 100
    with torch.no_grad():  # B = 0: the branch adds an exact zero in both
        assert torch.equal(ours(ids).logits, theirs(ids).logits)
