"""The rollout engine's decode step, kernel variants side by side on one GPU: one step (32 or 28
layers over one new token per sequence, the LM head and the draw) captured in a CUDA graph and
replayed, per variant of stages/blocks/decoder.py:

  eager      the layer eager (~20 kernels per layer)
  compiled   the layer through torch.compile (the engine's default): cuBLAS matmuls, SDPA
  wt         compiled, each matmul as the transposed product w @ x^T (cuBLAS sees a tall-skinny
             problem with the batch as its N, and chooses other kernels than for M = batch); the
             LM head too (F.linear is replaced for the variant), so the draw reads strided logits
  autotune   compiled with mode="max-autotune-no-cudagraphs" (Inductor benchmarks Triton matmul
             templates against cuBLAS per shape; outside the deterministic mode the engine compiles under)
  window     compiled, the cache and mask cut to the bucket that holds the live positions (what a
             length-bucketed decode graph would read instead of the whole static cache)
  skinny     compiled, each matmul of at most 16 rows (the layers' projections and the LM head) by
             stages/blocks/kernels.skinny_linear, the Triton kernel, instead of cuBLAS
and, per projection shape of the step, the matmul alone: cuBLAS against the Triton kernel at
several (BN, BK, warps) settings, each as 20 back-to-back calls captured in one graph (`matmuls`),
and the draw alone (decoder.pick) eager against compiled. (Matmuls and attention as reductions
for Inductor, `rows`, were measured at a483038 and lost: results/2026-12-01-h200-decode-kernels-rows.md.) Numerics: each variant's logits against
the eager variant's on the same state (max |diff|, argmax agreement).

    python benchmarks/decode_kernels.py --out $OUT   # CUDA only; writes decode-kernels.{json,md}
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from stages.blocks import decoder, kernels, models

SHAPES = {  # workload a (the seed) and b of benchmarks/systems.py: batch, prompt, new tokens
    "a": ("smollm2-360m", 4, 128, 64),
    "b": ("qwen3-0.6b", 64, 128, 512),
}
VARIANTS = ("compiled", "skinny", "wt", "eager", "window", "autotune")


def linear_t(x, w, b=None):
    """F.linear as w @ x^T, transposed back (a view: consumers read it strided)."""
    y = (w @ x.reshape(-1, x.shape[-1]).T).T.reshape(*x.shape[:-1], w.shape[0])
    return y if b is None else y + b


def linear_skinny(x, w, b=None):
    """F.linear by the Triton kernel where the rows are few (the decode step), cuBLAS elsewhere."""
    if x.numel() // x.shape[-1] <= kernels.MAX_ROWS:
        return kernels.skinny_linear(x, w, b)
    return ORIG_LINEAR(x, w, b)


ORIG_LINEAR = F.linear
SKINNY = [(None, None, 4), (8, 128, 4), (8, 64, 4), (16, 128, 4), (16, 64, 4), (32, 64, 4), (8, 128, 2), (16, 128, 8),
          (32, 128, 8)]  # (BN, BK, warps); None: kernels.config's choice


def matmuls(W, B: int, reps: int) -> list[dict]:
    """Each projection shape of the decode step (and the LM head) alone: cuBLAS vs the Triton kernel's
    settings, us per call (20 calls per captured graph), and the kernel's max |diff| against cuBLAS."""
    w0 = W["layers"][0]
    shapes = {"qkv": w0["qkv"], "o_proj": w0["o_proj"], "gate_up": w0["gate_up"], "down_proj": w0["down_proj"],
              "head": W["head"]}
    rows = []
    for name, w in shapes.items():
        x = torch.randn(B, w.shape[1], device="cuda", dtype=w.dtype)
        ref = ORIG_LINEAR(x, w)
        row = {"matmul": name, "N": w.shape[0], "K": w.shape[1], "rows": B}
        cands = [("cublas", lambda: ORIG_LINEAR(x, w))]  # noqa: B023
        for BN, BK, warps in SKINNY:
            y = torch.empty_like(ref)
            cands.append((f"triton BN={BN} BK={BK} w={warps}",
                          lambda y=y, BN=BN, BK=BK, warps=warps: kernels.launch(x, w, None, y, BN, BK, warps) or y))  # noqa: B023
        for label, f in cands:
            try:
                _, ms, out = timed_graph(lambda f=f: [f() for _ in range(20)][-1], reps)
            except Exception as e:  # noqa: BLE001
                row[label] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                continue
            row[label] = {"us": round(ms * 1e3 / 20, 2), "max_abs_diff": float((out.float() - ref.float()).abs().max())}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def build(arch: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {k: v for k, v in models.arch_config(arch).items() if not k.startswith("_")}
    conf = AutoConfig.for_model(**cfg)
    with torch.device("cuda"):
        m = AutoModelForCausalLM.from_config(conf, dtype=torch.bfloat16)
    for p in m.parameters():  # realistic scales: logits of a few units, not ~100
        torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
    return decoder.sampling_weights(m)


def state(W, B: int, P: int, N: int, live: int):
    """A mid-rollout state: the cache filled up to `live` positions, the next token's inputs."""
    g = torch.Generator(device="cuda").manual_seed(0)
    L = P + N
    shape = (W["n_layers"], B, W["n_kv"], L, W["head_dim"])
    ck = torch.randn(shape, generator=g, device="cuda", dtype=W["dtype"])
    cv = torch.randn(shape, generator=g, device="cuda", dtype=W["dtype"])
    keys = torch.arange(L, device="cuda")
    return {"tok": torch.randint(0, W["embed"].shape[0], (B, 1), generator=g, device="cuda"),
            "pos": torch.full((B, 1), live, device="cuda"), "slot": torch.full((1,), live, device="cuda"),
            "valid": (keys <= live)[None, None].expand(B, 1, L).contiguous(), "ck": ck, "cv": cv,
            "u": torch.rand(B, generator=g, device="cuda"), "logits": None}


def logits_fn(W, st, layer, L=None):
    ck, cv, valid = st["ck"], st["cv"], st["valid"]
    if L is not None:
        ck, cv, valid = ck[..., :L, :], cv[..., :L, :], valid[..., :L]
    h = decoder.forward(W, st["tok"], st["pos"], ck, cv, st["slot"], valid, layer)
    return F.linear(h[:, 0], W["head"])  # [B, V]


def step_fn(W, st, logits_of):
    """The decode step: logits (compiled or not, per variant), then the draw, eager (the compiled
    draw is timed apart: Inductor 2.11 fails on its scan)."""
    logits = logits_of()
    tok, lp = decoder.pick(logits, st["u"], 1.0, 1.0, False, None, 0)
    return logits, tok, lp


def timed_graph(fn, reps: int) -> tuple[float, float, object]:
    """(first call s incl. compilation, ms per replay of the captured step, the warm-up's output)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    t = time.perf_counter()
    with torch.cuda.stream(s):
        out = fn()
        torch.cuda.synchronize()
        first = time.perf_counter() - t
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(10):
        g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return first, a.elapsed_time(b) / reps, out


def _variants(W, res, name, B, P, N, live, window, reps, deadline, orig_linear) -> None:
    """Each decode-step variant captured and timed into res["variants"] (logits kept for the comparison)."""
    for v in VARIANTS:
        if time.monotonic() > deadline:
            res["variants"][v] = {"skipped": "deadline"}
            continue
        torch._dynamo.reset()
        models.compile_settings()
        if v == "skinny" and (not kernels.available() or B > kernels.MAX_ROWS):
            res["variants"][v] = {"skipped": f"batch {B} > {kernels.MAX_ROWS} rows or no Triton"}
            continue
        decoder.F.linear = {"wt": linear_t, "skinny": linear_skinny}.get(v, orig_linear)  # (torch.nn.functional itself)
        st = state(W, B, P, N, live)
        if v == "eager":
            fn = lambda: step_fn(W, st, lambda: logits_fn(W, st, decoder.layer))  # noqa: E731
        else:
            if v == "autotune":
                import torch._inductor.config as ic

                ic.deterministic = False
            layer = torch.compile(decoder.layer, fullgraph=True, dynamic=False,
                                  mode="max-autotune-no-cudagraphs" if v == "autotune" else None)
            L = window if v == "window" else None
            fn = lambda: step_fn(W, st, lambda: logits_fn(W, st, layer, L))  # noqa: E731
        try:
            first, ms, (logits, tok, _) = timed_graph(fn, reps)
        except Exception as e:  # noqa: BLE001  a variant that does not compile or capture is a result too
            res["variants"][v] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            continue
        logits = logits.float()
        row = {"first_call_s": round(first, 2), "ms_per_step": round(ms, 4),
               "tok_per_s": round(B / ms * 1e3)}
        res["variants"][v] = row
        print(name, v, row, flush=True)
        row["logits"] = logits  # compared once the eager reference exists


def run_shape(name: str, deadline: float, reps: int) -> dict:
    arch, B, P, N = SHAPES[name]
    W = build(arch)
    live = P + N // 2 + 1
    window = -(-(live + 1) // 64) * 64  # the 64-position bucket holding every live key
    res = {"arch": arch, "batch": B, "prompt": P, "new": N, "cache_len": P + N, "live": live, "window": window,
           "variants": {}}
    orig_linear = F.linear
    if B <= kernels.MAX_ROWS and kernels.available():
        res["matmuls"] = matmuls(W, B, reps)
    try:
        _variants(W, res, name, B, P, N, live, window, reps, deadline, orig_linear)
    finally:
        decoder.F.linear = orig_linear  # (torch.nn.functional itself: put back whatever happened)
    ref = res["variants"].get("eager", {}).get("logits")
    for row in res["variants"].values():
        lg = row.pop("logits", None)
        if lg is not None and ref is not None:
            row["max_abs_logit_diff_vs_eager"] = float((lg - ref).abs().max())
            row["argmax_agree_vs_eager"] = float((lg.argmax(-1) == ref.argmax(-1)).float().mean())
    # the draw alone: eager kernels against one compiled function, both captured
    V = W["head"].shape[0]
    g = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(B, V, generator=g, device="cuda") * 3
    u = torch.rand(B, generator=g, device="cuda")
    torch._dynamo.reset()
    models.compile_settings()  # (deterministic again after the autotune variant)
    cpick = torch.compile(decoder.pick, fullgraph=True, dynamic=False)
    for label, f in (("pick_eager", decoder.pick), ("pick_compiled", cpick)):
        try:
            first, ms, (tok, lp) = timed_graph(lambda: f(logits, u, 1.0, 1.0, False, None, 0), reps)  # noqa: B023
        except Exception as e:  # noqa: BLE001
            res[label] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}", "ms": None, "tokens": None}
            continue
        res[label] = {"first_call_s": round(first, 2), "ms": round(ms, 4), "tokens": tok.tolist()[:8],
                      "logprobs": [round(x, 5) for x in lp.tolist()[:8]]}
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--shapes", default="a,b")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--budget-s", type=float, default=420, help="stop starting variants after this")
    args = ap.parse_args()
    deadline = time.monotonic() + args.budget_s
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    for name in args.shapes.split(","):
        with torch.no_grad():  # as the engine samples (Engine.generate)
            out["shapes"][name] = run_shape(name, deadline, args.reps)
        print(json.dumps(out["shapes"][name], indent=1), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "decode-kernels.json").write_text(json.dumps(out, indent=1))
    lines = [f"# Decode step variants ({out['gpu']}, torch {out['torch']})", ""]
    for name, r in out["shapes"].items():
        lines += [f"## workload {name}: {r['arch']}, batch {r['batch']}, cache {r['cache_len']} (live {r['live']})", "",
                  "| variant | ms/step | tok/s | first call s | max abs logit diff vs eager | argmax agree |",
                  "|---|---|---|---|---|---|"]
        for v, row in r["variants"].items():
            if "ms_per_step" not in row:
                lines.append(f"| {v} | {row} | | | | |")
                continue
            lines.append(f"| {v} | {row['ms_per_step']} | {row['tok_per_s']} | {row['first_call_s']} | "
                         f"{row.get('max_abs_logit_diff_vs_eager', '')} | {row.get('argmax_agree_vs_eager', '')} |")
        for m in r.get("matmuls", []):
            cells = [f"{k}: {v['us']} us" if isinstance(v, dict) else f"{k}: {v}" for k, v in m.items()
                     if k not in ("matmul", "N", "K", "rows")]
            lines.append(f"- matmul {m['matmul']} [{m['rows']}, {m['K']}] x [{m['N']}, {m['K']}]^T: " + "; ".join(cells))
        pe, pc = r["pick_eager"], r["pick_compiled"]
        same = f"same tokens: {pe['tokens'] == pc['tokens']}" if pc.get("tokens") else pc.get("error", "")
        lines += ["", f"draw alone: eager {pe['ms']} ms, compiled {pc['ms']} ms ({same})", ""]
    (Path(args.out) / "decode-kernels.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
