"""What a process's first attention calls cost, per SDPA backend, at the seed workload's shapes.

    python benchmarks/sdpa_first_call.py --out DIR [--device cuda] [--repeat 20]

On the H200 the first update spends ~3 s inside the first SDPA calls and autograd's first backward
(benchmarks/results/2026-12-02-h200-6c400fd-first-update.md): cuDNN's attention, which the padded
layout's boolean mask selects there, builds a plan per shape. Right padding makes that mask the
causal one at every real position (a real query never sees a later pad), so `is_causal=True` is an
option: flash attention takes it and has no plans. Each variant runs in a fresh process (plans and
lazily loaded kernels are per process), after CUDA is initialised and one matmul has run: its first
forward, first backward, the mean of `--repeat` later forward + backward pairs, whether two
backwards give the same bytes, and the largest difference from fp32 math at real positions (output
and the three gradients). Writes <out>/sdpa-first-call.json and .md.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

# (name, heads, kv heads, head dim, rows, padded length, real lengths): the update's forward of the
# student (SmolLM2-360M, 128 + 64 positions) and the teacher's scoring forward (SmolLM2-1.7B)
SHAPES = {"student-train": (15, 5, 64, 4, 192, (192, 177, 160, 131)),
          "teacher-score": (32, 32, 64, 4, 192, (192, 177, 160, 131))}
VARIANTS = {  # name: (mask form, backend or None for PyTorch's own choice)
    "mask": ("mask", None), "mask-efficient": ("mask", "EFFICIENT_ATTENTION"), "mask-cudnn": ("mask", "CUDNN_ATTENTION"),
    "causal": ("causal", None), "causal-flash": ("causal", "FLASH_ATTENTION"), "causal-cudnn": ("causal", "CUDNN_ATTENTION"),
}

CHILD = r"""
import json, sys, time
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
shape, variant, device, repeat = json.loads(sys.argv[1])
H, KV, D, B, T, lengths = shape
form, backend = variant
dev = torch.device(device)
dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
torch.ones(64, 64, device=dev) @ torch.ones(64, 64, device=dev)  # CUDA (and the BLAS) initialised first
sync()
g = torch.Generator(device="cpu").manual_seed(0)
q = torch.randn(B, H, T, D, generator=g)
k, v = torch.randn(B, KV, T, D, generator=g), torch.randn(B, KV, T, D, generator=g)
real = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # [B, T]
mask = (torch.ones(T, T, dtype=torch.bool).tril() & real[:, None, :])[:, None]  # [B, 1, T, T], the layout's
dout = torch.randn(B, H, T, D, generator=g) * real[:, None, :, None]  # pads carry no gradient

def run(q, k, v, form, backend):
    kw = dict(attn_mask=mask.to(q.device)) if form == "mask" else dict(is_causal=True)
    rep = H // KV  # transformers repeats the kv heads where SDPA takes no GQA
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    if backend is None:
        return F.scaled_dot_product_attention(q, kk, vv, **kw)
    with sdpa_kernel(getattr(SDPBackend, backend)):
        return F.scaled_dot_product_attention(q, kk, vv, **kw)

def leaves(dtype, device):
    return [t.to(device, dtype).detach().clone().requires_grad_() for t in (q, k, v)]  # fresh leaves

out = {}
try:
    x = leaves(dtype, dev)
    t = time.perf_counter(); o = run(*x, form, backend); sync(); out["first_forward_s"] = time.perf_counter() - t
    t = time.perf_counter(); o.backward(dout.to(dev, dtype)); sync(); out["first_backward_s"] = time.perf_counter() - t
    grads = [t.grad.clone() for t in x]
    y = leaves(dtype, dev)
    run(*y, form, backend).backward(dout.to(dev, dtype))
    out["backward_bytes_repeat"] = all(torch.equal(a, b.grad) for a, b in zip(grads, y))
    t = time.perf_counter()
    for _ in range(repeat):
        z = leaves(dtype, dev)
        run(*z, form, backend).backward(dout.to(dev, dtype))
    sync()
    out["later_forward_backward_ms"] = (time.perf_counter() - t) / repeat * 1e3
    r = leaves(torch.float64, torch.device("cpu"))
    ref = run(*r, "mask", "MATH")
    ref.backward(dout.to(torch.float64))
    at = real[:, None, :, None].to(dev)
    out["max_abs_diff_vs_fp64_math"] = {
        "out": float(((o.double().cpu() - ref.detach()) * at.cpu()).abs().max()),
        **{n: float((a.double().cpu() - b.grad).abs().max()) for n, a, b in zip(("dq", "dk", "dv"), grads, r)}}
except RuntimeError as e:  # a backend that does not take this shape or device says so
    out["error"] = str(e).splitlines()[0][:300]
print(json.dumps(out))
"""


def markdown(res: dict) -> str:
    lines = [f"# First SDPA calls per backend ({res['device']}, torch {res['torch']})", "",
             f"Command: `{res['command']}`", "",
             "| shape | variant | first forward s | first backward s | later fwd+bwd ms | backward repeats bytes | "
             "max diff vs fp64 (out / dq / dk / dv) |", "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['variant']} | not run: {r['error']} |||||")
            continue
        d = r["max_abs_diff_vs_fp64_math"]
        lines.append(f"| {r['shape']} | {r['variant']} | {r['first_forward_s']:.4f} | {r['first_backward_s']:.4f} | "
                     f"{r['later_forward_backward_ms']:.3f} | {r['backward_bytes_repeat']} | "
                     f"{d['out']:.2e} / {d['dq']:.2e} / {d['dk']:.2e} / {d['dv']:.2e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args(argv)
    import torch

    res = {"command": " ".join(["python", *sys.argv]), "torch": torch.__version__,
           "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "rows": []}
    args.out.mkdir(parents=True, exist_ok=True)
    for shape_name, shape in SHAPES.items():
        for name in args.variants.split(","):
            p = subprocess.run([sys.executable, "-c", CHILD, json.dumps([shape, VARIANTS[name], args.device, args.repeat])],
                               capture_output=True, text=True, timeout=300)
            row = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {"error": p.stderr.strip()[-300:]}
            res["rows"].append({"shape": shape_name, "variant": name, **row})
            (args.out / "sdpa-first-call.json").write_text(json.dumps(res, indent=1) + "\n")
            (args.out / "sdpa-first-call.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
