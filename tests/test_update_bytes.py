"""benchmarks/update_bytes.py, the byte model of the update and the scoring forward: a fused stand-in
moves fewer bytes than the eager pieces it replaces, attention is one fused kernel per layer each way,
and the scoring forward (no grad, no adapters) has no backward."""
from __future__ import annotations

import sys

from support import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import update_bytes  # noqa: E402


def test_fused_pieces_move_fewer_bytes_and_attention_runs_once_per_layer():
    L = 2  # conf/arch/tiny-llama.json
    totals = {}
    for name, fuse in (("eager", set()), ("norm", {"rmsnorm"}), ("lora", {"lora"}), ("both", {"rmsnorm", "lora"})):
        ops, calls = update_bytes.count("tiny-llama", 2, 64, False, fuse)
        assert calls["attention (fused)"] == calls["attention (fused) backward"] == L
        assert not {"bmm", "_safe_softmax"} & set(calls)  # (the math path's [B, H, T, T] never counted)
        totals[name] = sum(ops.values())
    assert totals["eager"] > totals["norm"] > totals["both"] and totals["eager"] > totals["lora"] > totals["both"]
    # checkpointing recomputes each layer's forward in the backward: attention's forward twice per layer
    _, calls = update_bytes.count("tiny-llama", 2, 64, True, set())
    assert calls["attention (fused)"] == 2 * L
    # the LoRA kernels' own ops: one of each per projection (7 a layer; the backward's four kernels), fewer
    # ops than PEFT's eager passes, and at a real width (SmolLM2-360M) fewer bytes, about the fused stand-in's
    # (at the tiny model's width 64 the rank-16 fp32 products weigh as much as what they save)
    _, kcalls = update_bytes.count("tiny-llama", 2, 64, False, {"kernels"})
    eager_calls = sum(update_bytes.count("tiny-llama", 2, 64, False, set())[1].values())
    # launches as the shapes decide (lora_kernels.launches): 128 rows are two row blocks, so the weight
    # gradients' sums over the rows come in two chunks each (+2 per projection); down_proj's 128 input
    # columns in two (+1), and so gate_proj's and up_proj's 128 output columns in the backward (+1 each)
    assert kcalls["lora_tail"] == 7 * L and kcalls["lora_down"] == (7 + 1) * L
    assert kcalls["lora_grads"] == (7 * (4 + 2) + 2) * L
    assert sum(kcalls.values()) < eager_calls
    real = {k: sum(update_bytes.count("smollm2-360m", 1, 64, False, f)[0].values())
            for k, f in (("eager", set()), ("kernels", {"kernels"}), ("lora", {"lora"}))}
    assert real["kernels"] < 0.75 * real["eager"] and abs(real["kernels"] - real["lora"]) < 0.05 * real["lora"]
    ops, calls = update_bytes.count("tiny-llama", 2, 64, False, set(), train=False)
    assert calls["attention (fused)"] == L and "attention (fused) backward" not in calls
    assert 0 < sum(ops.values()) < totals["eager"] / 2
