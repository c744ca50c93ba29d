"""The rollout engine's decode step, kernel variants side by side on one GPU: one step (32 or 28
layers over one new token per sequence, the LM head and the draw) captured in a CUDA graph and
replayed, per variant of stages/engine/decoder.py:

  eager      the layer eager (~20 kernels per layer)
  compiled   the layer through torch.compile, cuBLAS matmuls, SDPA (the engine's default until 2026-12-02)
  kernels    decoder.fused_layer uncompiled (the engine's default since the
             rotary kernel): each projection and the rotary/cache write one Triton kernel, no Inductor;
             takes the options of `fused` below, and kernels:sdpa = kernels.rope_cache and SDPA
             instead of decode_attention.rope_attention; kernels:nopdl = plain launches, without programmatic
             dependent launch, kernels.PDL; kernels:t8192 = rope_attention blocks of 8,192 cache
             elements (decode_attention.ATTN_TILE); kernels:kv = rope_attention with a program per kv head at
             any batch (decode_attention.ATTN_KV_ROWS 0), kernels:head = per query head at any batch;
             kernels:b32 = 32 positions per block of the per-kv-head kernel (decode_attention.ATTN_KV_BLOCK),
             kernels:p2 = its blocks in flight (decode_attention.ATTN_KV_STAGES). (kernels:tile, every input row loaded up front as one tile,
             lost to the row loop at 438257d, 1.240 against 1.207 ms, and is gone; kernels:grouped, one
             rope_attention program per kv head, lost at 7abd5a7, 1.019 against 0.909, and is gone; kernels:kN, the
             per-kv-head kernel reading each row's cache in splits of N positions combined by a second kernel,
             lost at 3f0c588 at workload b, 2.672 (N 128), 3.052 (64), 2.581 (256) against 2.584 ms, and is gone)
  fused      decoder.fused_layer through torch.compile (the engine's default at dc11211, and past
             kernels.MAX_ROWS rows, workload b, today: there it is decoder.layer with rope_attention
             for the attention, around cuBLAS's matmuls): the projections
             as stages/engine/kernels.py's `project` launches, RMSNorm, SiLU gate and residual adds
             folded in. Options after colons: fused:w1:s2048 = one warp per program (kernels.WARPS),
             2,048 weight elements per program (kernels.SLAB)
  wt         compiled, each matmul as the transposed product w @ x^T (cuBLAS sees a tall-skinny
             problem with the batch as its N, and chooses other kernels than for M = batch); the
             LM head too (F.linear is replaced for the variant), so the draw reads strided logits
  autotune   compiled with mode="max-autotune-no-cudagraphs" (Inductor benchmarks Triton matmul
             templates against cuBLAS per shape; outside the deterministic mode the engine compiles under)
  window     compiled, the cache and mask cut to the bucket that holds the live positions (what a
             length-bucketed decode graph would read instead of the whole static cache)
  stack      the whole step's forward (all layers and the head) as one compilation, so that Inductor
             may fuse across layer boundaries (the engine compiles one layer and calls it per layer)
and the draw alone (decoder.pick): stages/engine/draw.py's kernels, torch's passes eager, and compiled.
A kernels or fused variant with ':nodraw' draws with torch's passes (draw.ON), e.g. kernels:nodraw. (Matmuls and attention as reductions
for Inductor, `rows`, were measured at a483038 and lost: results/2026-12-01-h200-decode-kernels-rows.md;
a hand-written Triton matmul for the step's few rows, `skinny`, at 7fbcb21 and lost to cuBLAS at
every setting at the seed (batch 4) shapes: -decode-kernels-skinny.md. At 11f8aee, seed shapes:
an additive float mask made once per step instead of the bool one each layer converted 1.356 ms/step
against compiled 1.386 (2%; decoder.forward has made it on CUDA since, for every variant here),
stack 1.688 (lost; 25 s to compile): results/2026-12-02-h200-11f8aee-decode-kernels-floatmask-stack.md.)
Numerics: each variant's logits against
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

from stages.engine import decode_attention, decoder, draw, kernels
from stages.weights import models

SLAB, WARPS, ATTENTION, PDL, DRAW = kernels.SLAB, kernels.WARPS, decode_attention.ATTENTION, kernels.PDL, draw.ON
ATTN_TILE, ATTN_KV_ROWS, ATTN_KV_BLOCK = decode_attention.ATTN_TILE, decode_attention.ATTN_KV_ROWS, decode_attention.ATTN_KV_BLOCK
ATTN_KV_STAGES = decode_attention.ATTN_KV_STAGES  # (fused:...
# variants change them for their capture; put back after)

SHAPES = {  # workload a (the seed) and b of benchmarks/systems.py: batch, prompt, new tokens
    "a": ("smollm2-360m", 4, 128, 64),
    "b": ("qwen3-0.6b", 64, 128, 512),
}
VARIANTS = ("compiled", "kernels", "fused", "stack", "eager", "window", "wt", "autotune")


def set_knobs(opts: list[str]) -> None:
    """The kernels' settings a variant's options name (see the top), the defaults for the rest."""
    num = lambda c, d: next((int(o[1:]) for o in opts if o[:1] == c and o[1:].isdigit()), d)  # noqa: E731
    kernels.SLAB, kernels.WARPS, kernels.PDL = num("s", SLAB), num("w", WARPS), PDL and "nopdl" not in opts
    decode_attention.ATTENTION = ATTENTION and "sdpa" not in opts
    decode_attention.ATTN_TILE, decode_attention.ATTN_KV_BLOCK = num("t", ATTN_TILE), num("b", ATTN_KV_BLOCK)
    decode_attention.ATTN_KV_STAGES = num("p", ATTN_KV_STAGES)
    decode_attention.ATTN_KV_ROWS = 0 if "kv" in opts else 1 << 30 if "head" in opts else ATTN_KV_ROWS
    draw.ON = DRAW and "nodraw" not in opts


def linear_t(x, w, b=None):
    """F.linear as w @ x^T, transposed back (a view: consumers read it strided)."""
    y = (w @ x.reshape(-1, x.shape[-1]).T).T.reshape(*x.shape[:-1], w.shape[0])
    return y if b is None else y + b


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
    kv = torch.randn(decoder.new_cache(W, B, L, "meta").shape, generator=g, device="cuda", dtype=W["dtype"])
    keys = torch.arange(L, device="cuda")
    return {"tok": torch.randint(0, W["embed"].shape[0], (B, 1), generator=g, device="cuda"),
            "pos": torch.full((B, 1), live, device="cuda"), "slot": torch.full((1,), live, device="cuda"),
            "valid": (keys <= live)[None, None].expand(B, 1, L).contiguous(), "kv": kv,
            "u": torch.rand(B, generator=g, device="cuda"), "logits": None}


def logits_fn(W, st, layer, L=None):
    kv, valid = st["kv"], st["valid"]
    if L is not None:
        kv, valid = kv[..., :L, :], valid[..., :L]
    h = decoder.forward(W, st["tok"], st["pos"], kv, st["slot"], valid, layer)
    return F.linear(h[:, 0], W["head"])  # [B, V]


def step_fn(W, st, logits_of):
    """The decode step: logits (compiled or not, per variant), then the draw, eager (the compiled
    draw is timed apart: Inductor 2.11 fails on its scan)."""
    logits = logits_of()
    tok, lp = decoder.pick(logits, st["u"], 1.0, 1.0, False, None, 0)
    return logits, tok, lp


def timed_graph(fn, reps: int) -> tuple[float, float, object]:
    """(first call s incl. compilation, ms per replay of the captured step, the captured step's output
    after the last replay: what the numerics columns compare, so a replay that differs from eager, a
    race between launches say, shows there)."""
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
        out = fn()  # (static output: holds each replay's result)
    for _ in range(10):
        g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return first, a.elapsed_time(b) / reps, out


def _variants(W, res, name, B, P, N, live, window, reps, deadline, orig_linear, variants) -> None:
    """Each decode-step variant captured and timed into res["variants"] (logits kept for the comparison)."""
    for v in variants:
        if time.monotonic() > deadline:
            res["variants"][v] = {"skipped": "deadline"}
            continue
        torch._dynamo.reset()
        models.compile_settings()
        decoder.F.linear = linear_t if v == "wt" else orig_linear  # (torch.nn.functional itself, for this variant)
        st = state(W, B, P, N, live)
        opts = v.split(":")[1:]
        set_knobs(opts)  # (read when the step is captured)
        if v.startswith("kernels"):
            fn = lambda: step_fn(W, st, lambda: logits_fn(W, st, decoder.fused_layer))  # noqa: E731
        elif v == "eager":
            fn = lambda: step_fn(W, st, lambda: logits_fn(W, st, decoder.layer))  # noqa: E731
        elif v == "stack":
            whole = torch.compile(lambda: logits_fn(W, st, decoder.layer), fullgraph=True, dynamic=False)  # noqa: B023
            fn = lambda: step_fn(W, st, whole)  # noqa: E731
        else:
            if v == "autotune":
                import torch._inductor.config as ic

                ic.deterministic = False
            layer = torch.compile(decoder.fused_layer if v.startswith("fused") else decoder.layer,
                                  fullgraph=True, dynamic=False,
                                  mode="max-autotune-no-cudagraphs" if v == "autotune" else None)
            L = window if v == "window" else None
            fn = lambda: step_fn(W, st, lambda: logits_fn(W, st, layer, L))  # noqa: E731
        try:
            first, ms, (logits, tok, _) = timed_graph(fn, reps)  # (the kernels read SLAB when captured)
        except Exception as e:  # noqa: BLE001  a variant that does not compile or capture is a result too
            res["variants"][v] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            continue
        logits = logits.float()
        row = {"first_call_s": round(first, 2), "ms_per_step": round(ms, 4),
               "tok_per_s": round(B / ms * 1e3)}
        res["variants"][v] = row
        print(name, v, row, flush=True)
        row["logits"] = logits  # compared once the eager reference exists


def run_shape(name: str, deadline: float, reps: int, variants: list[str]) -> dict:
    arch, B, P, N = SHAPES[name]
    W = build(arch)
    live = P + N // 2 + 1
    window = -(-(live + 1) // 64) * 64  # the 64-position bucket holding every live key
    res = {"arch": arch, "batch": B, "prompt": P, "new": N, "cache_len": P + N, "live": live, "window": window,
           "variants": {}}
    orig_linear = F.linear
    try:
        _variants(W, res, name, B, P, N, live, window, reps, deadline, orig_linear, variants)
    finally:
        decoder.F.linear = orig_linear  # (torch.nn.functional itself: put back whatever happened)
        set_knobs([])  # (whatever happened)
    ref = res["variants"].get("eager", {}).get("logits")
    for row in res["variants"].values():
        lg = row.pop("logits", None)
        if lg is not None and ref is not None:
            row["max_abs_logit_diff_vs_eager"] = float((lg - ref).abs().max())
            row["argmax_agree_vs_eager"] = float((lg.argmax(-1) == ref.argmax(-1)).float().mean())
    # the draw alone: stages/engine/draw.py's kernels, torch's passes eager, and those compiled, each captured
    V = W["head"].shape[0]
    g = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(B, V, generator=g, device="cuda") * 3
    u = torch.rand(B, generator=g, device="cuda")
    torch._dynamo.reset()
    models.compile_settings()  # (deterministic again after the autotune variant)
    cpick = torch.compile(decoder.pick, fullgraph=True, dynamic=False)
    for label, f, on in (("pick_kernel", decoder.pick, True), ("pick_eager", decoder.pick, False),
                         ("pick_compiled", cpick, False)):
        draw.ON = on
        try:
            first, ms, (tok, lp) = timed_graph(lambda: f(logits, u, 1.0, 1.0, False, None, 0), reps)  # noqa: B023
        except Exception as e:  # noqa: BLE001
            res[label] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}", "ms": None, "tokens": None}
            continue
        finally:
            draw.ON = DRAW
        res[label] = {"first_call_s": round(first, 2), "ms": round(ms, 4), "tokens": tok.tolist()[:8],
                      "logprobs": [round(x, 5) for x in lp.tolist()[:8]]}
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--shapes", default="a,b")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--budget-s", type=float, default=420, help="stop starting variants after this")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ",".join(VARIANTS))
    args = ap.parse_args()
    bad = [v for v in args.variants.split(",") if v not in VARIANTS and not v.startswith(("fused:", "kernels:"))]
    if bad:
        ap.error(f"--variants: unknown {bad}; expected some of {','.join(VARIANTS)}")
    variants = args.variants.split(",")  # (the eager one is the numerics reference)
    deadline = time.monotonic() + args.budget_s
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    for name in args.shapes.split(","):
        with torch.no_grad():  # as the engine samples (Engine.generate)
            out["shapes"][name] = run_shape(name, deadline, args.reps, variants)
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
        pk, pe, pc = r["pick_kernel"], r["pick_eager"], r["pick_compiled"]
        same = {k: (x["tokens"] == pe["tokens"] if x.get("tokens") else x.get("error", "")) for k, x in
                (("kernel", pk), ("compiled", pc))}
        lines += ["", f"draw alone: kernels {pk['ms']} ms, torch eager {pe['ms']} ms, compiled {pc['ms']} ms "
                      f"(the first 8 tokens the same as eager's: {same})", ""]
    (Path(args.out) / "decode-kernels.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
