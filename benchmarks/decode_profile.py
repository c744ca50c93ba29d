"""Where a decode step's GPU time goes: one shape of benchmarks/decode_kernels.py, one or more of its
variants captured in a CUDA graph, 20 replays under torch.profiler, the kernels' table (CUDA time per
step, by kernel) for each.

    python benchmarks/decode_profile.py --shape b --variants compiled,fused --out $OUT   # CUDA only
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

import decode_kernels as dk
from stages.engine import decoder
from stages.weights import models


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="b", choices=sorted(dk.SHAPES))
    ap.add_argument("--variants", default="compiled,fused")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    arch, B, P, N = dk.SHAPES[args.shape]
    W = dk.build(arch)
    lines = [f"# Decode step profile: {torch.cuda.get_device_name()}, torch {torch.__version__}, workload "
             f"{args.shape} ({arch}, batch {B}, cache {P + N}, live {P + N // 2 + 1}), {args.steps} replays", ""]
    for v in args.variants.split(","):
        torch._dynamo.reset()
        models.compile_settings()
        opts = v.split(":")[1:]
        dk.set_knobs(opts)
        st = dk.state(W, B, P, N, P + N // 2 + 1)
        layer = {"eager": decoder.layer, "kernels": decoder.fused_layer}.get(v.split(":")[0])
        if layer is None:
            layer = torch.compile(decoder.fused_layer if v.startswith("fused") else decoder.layer, fullgraph=True, dynamic=False)
        with torch.no_grad():
            _, ms, _ = dk.timed_graph(lambda: dk.step_fn(W, st, lambda: dk.logits_fn(W, st, layer)), 50)  # noqa: B023
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                dk.step_fn(W, st, lambda: dk.logits_fn(W, st, layer))  # noqa: B023
            g.replay()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(args.steps):
                    g.replay()
                torch.cuda.synchronize()
        dk.set_knobs([])
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90)
        lines += [f"## {v}: {ms:.4f} ms per step (events timing)", "", "```", table, "```", ""]
        print(lines[-4], flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "decode-profile.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
