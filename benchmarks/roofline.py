"""The physical floor of each phase of one update, from the workload's shapes and the device's
measured peaks, and our time as a multiple of it (systems.py prints it beside every result).

Floors, for a batch of B prompts of P tokens and R response tokens (bf16 weights, S = 2 bytes):
- rollout: the prefill's FLOPs over the matmul peak, then each of the R decode steps at the larger
  of (weights read once + the KV cache read up to that step) over the copy bandwidth and its FLOPs
  over the matmul peak; at small batches every decode step is bound by the bytes it reads.
- score: the teacher's forward over B x (P + R) tokens (the LM head on the R response positions
  only), the larger of its FLOPs over the matmul peak and its weights read once over the bandwidth.
- update: the student's forward and its backward for the input gradients (the base is frozen: no
  weight gradients but the LoRA's, which are negligible), 2 x the forward's FLOPs, over the peak.
Peaks are measured on the device in the same process (`measure_peaks`): a 1 GiB device-to-device
copy (bytes read + written) and a 8192^3 bf16 matmul, best of several, not the datasheet's figures.
"""
from __future__ import annotations

S = 2  # bytes per bf16 element


def measure_peaks(repeats: int = 10) -> dict | None:
    """{"bandwidth_gbs", "bf16_tflops"} measured on the current CUDA device (None without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return None

    def best(fn) -> float:
        fn()
        torch.cuda.synchronize()
        t = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            t.append(start.elapsed_time(end) / 1e3)
        return min(t)

    def copy_gbs(n: int = 1 << 30) -> float:  # bytes read and written by a 1 GiB copy
        x = torch.empty(n, dtype=torch.uint8, device="cuda")
        y = torch.empty_like(x)
        return 2 * n / best(lambda: y.copy_(x)) / 1e9

    def matmul_tflops(m: int = 8192) -> float:
        a = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
        return 2 * m**3 / best(lambda: a @ b) / 1e12

    bw, tflops = copy_gbs(), matmul_tflops()
    torch.cuda.empty_cache()
    return {"bandwidth_gbs": round(bw, 1), "bf16_tflops": round(tflops, 1)}


def shape(arch: str) -> dict:
    """The shapes the floors need, as the memory plan reads them (stages/memory/shapes.py)."""
    from stages.memory import shapes
    from stages.run.config import ModelCfg

    sh = shapes.shape_of(ModelCfg(name=f"arch:{arch}", init="random"), arch)
    return {"layers": sh.layers, "q_dim": sh.q_dim, "kv_dim": sh.kv_dim,
            "linear": sh.layers * sh.linear_params(), "head": sh.vocab * sh.hidden}


def _forward_flops(s: dict, B: int, T: int, head_positions: int) -> float:
    """Linear layers over B x T tokens, causal attention (QK^T and PV: 2 x 2 x q_dim x T^2 / 2 per
    row and layer), the LM head over `head_positions`."""
    return 2 * s["linear"] * B * T + 2 * s["layers"] * s["q_dim"] * B * T * T + 2 * s["head"] * head_positions


def floors(w: dict, peaks: dict) -> dict:
    """Floor seconds of each phase for workload `w` (systems.py's WORKLOAD_A/B) on a device of `peaks`."""
    bw, fl = peaks["bandwidth_gbs"] * 1e9, peaks["bf16_tflops"] * 1e12
    st, te = shape(w["student"]), shape(w["teacher"])
    B, P, R = w["prompts"], w["prompt_tokens"], w["response"]
    rollout = _forward_flops(st, B, P, B) / fl  # the prefill (the head on each row's last position)
    weights = (st["linear"] + st["head"]) * S
    for t in range(R):
        kv_bytes = 2 * st["layers"] * st["kv_dim"] * B * (P + t) * S
        flops = 2 * (st["linear"] + st["head"]) * B + 2 * st["layers"] * st["q_dim"] * B * 2 * (P + t)
        rollout += max((weights + kv_bytes) / bw, flops / fl)
    score = max(_forward_flops(te, B, P + R, B * R) / fl, (te["linear"] + te["head"]) * S / bw)
    update = 2 * _forward_flops(st, B, P + R, B * R) / fl
    return {"rollout": rollout, "score": score, "update": update, "step": rollout + score + update}


def table(w: dict, ours: dict, peaks: dict | None) -> dict | None:
    """{phase: {"floor_s", "ours_s", "x_floor"}} from our system's medians (None without peaks)."""
    if not peaks or "error" in ours:
        return None
    f = floors(w, peaks)
    got = {"rollout": ours.get("median_rollout_s"), "score": ours.get("median_score_s"),
           "update": ours.get("median_update_phase_s"), "step": ours.get("median_update_s")}
    return {k: {"floor_s": round(f[k], 5), "ours_s": got[k],
                "x_floor": round(got[k] / f[k], 1) if got[k] else None} for k in f}


def markdown(rows: dict | None, peaks: dict | None) -> list[str]:
    if not rows:
        return []
    out = ["", f"Roofline (benchmarks/roofline.py; measured peaks: {peaks['bandwidth_gbs']} GB/s copy, "
               f"{peaks['bf16_tflops']} TFLOP/s bf16 matmul):", "",
           "| phase | floor s | ours s | x floor |", "|---|---|---|---|"]
    out += [f"| {k} | {v['floor_s']} | {v['ours_s']} | {v['x_floor']} |" for k, v in rows.items()]
    return out
