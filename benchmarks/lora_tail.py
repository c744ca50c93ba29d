"""The student's LoRA forward and backward over one update's tokens, PEFT's own tail against
`stages.weights.lora.one_pass_tails`, side by side in one process: milliseconds per forward +
backward (activation checkpointing on, as workload b runs it), peak memory, and whether the hidden
states and every LoRA gradient are equal to the bit.

    python benchmarks/lora_tail.py --out DIR                  # CUDA: workload b's student and batch
    python benchmarks/lora_tail.py --device cpu --arch smollm2-360m --batch 2 --length 256 --out DIR
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from stages.run.config import LoraCfg  # noqa: E402
from stages.weights import lora, models  # noqa: E402


def build(arch: str, device: str, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {k: v for k, v in models.arch_config(arch).items() if not k.startswith("_")}
    with torch.device(device):
        m = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=dtype)
    for p in m.parameters():  # realistic scales
        torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
    m = lora.add(m, LoraCfg(), seed=0)  # the defaults: r 16, alpha 32 (scale 2), the 7 projections
    with torch.no_grad():  # B away from zero (a trained policy), the same for both arms
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    return m


def step(model, ids, g, sync) -> tuple[float, torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    sync()
    t = time.perf_counter()
    h = model.get_base_model().model(input_ids=ids, use_cache=False).last_hidden_state
    h.backward(g)
    sync()
    return time.perf_counter() - t, h.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--length", type=int, default=640, help="tokens per row (workload b: 128 + 512)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--no-checkpointing", action="store_true")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dtype = torch.bfloat16
    model = build(args.arch, args.device, dtype)
    model.train()
    if not args.no_checkpointing:
        models.enable_activation_checkpointing(model.get_base_model(), preserve_rng_state=False)
    fast = {m: m.forward for m in model.modules() if "forward" in vars(m)}  # what one_pass_tails set
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.length), generator=gen).to(args.device)
    g = torch.randn(args.batch, args.length, model.config.hidden_size, generator=gen).to(args.device, dtype)

    def arm(name: str) -> dict:
        for m, f in fast.items():  # one_pass_tails' forward, or PEFT's own (the class's)
            if name == "one_pass":
                m.forward = f
            else:
                vars(m).pop("forward", None)
        times, last = [], None
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for _ in range(args.reps + 1):  # the first: warm-up
            s, h, grads = step(model, ids, g, sync)
            times.append(s)
            last = (h, {k: v.clone() for k, v in grads.items()})
        return {"ms": [round(t * 1e3, 2) for t in times], "median_ms": round(statistics.median(times[1:]) * 1e3, 2),
                "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None, "out": last}

    res = {}
    for name in ("peft", "one_pass", "peft", "one_pass"):  # interleaved: each arm twice
        r = arm(name)
        prev = res.get(name)
        res[name] = r if prev is None else {**r, "ms": prev["ms"] + r["ms"],
                                            "median_ms": round(statistics.median(prev["ms"][1:] + r["ms"][1:]), 2)}
    (h0, g0), (h1, g1) = res["peft"].pop("out"), res["one_pass"].pop("out")
    bits = lambda t: t.view(torch.int16 if t.element_size() == 2 else torch.int32)  # noqa: E731
    same = torch.equal(bits(h0), bits(h1)) and g0.keys() == g1.keys() and all(torch.equal(bits(g0[k]), bits(g1[k])) for k in g0)
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "arch": args.arch,
           "batch": args.batch, "length": args.length, "checkpointing": not args.no_checkpointing,
           "adapted_modules": len(fast), "lora_tensors": len(g0), "bytes_equal": same, "arms": res,
           "speedup": round(res["peft"]["median_ms"] / res["one_pass"]["median_ms"], 3)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lora-tail.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
