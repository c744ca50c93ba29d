"""Where the NF4 seed workload's GPU memory goes (CUDA): random-init SmolLM2-360M / 1.7B saved as
bf16, loaded NF4 through `stages.blocks.models.load`, then one rollout (transformers fallback, as
the pipeline samples a quantized base), one teacher scoring pass and one LoRA update forward+backward
of the seed shapes (4 x (128 + 64) tokens). Per step: allocated after it, its peak, and the largest
live allocations at the peak (torch's allocator history, with the Python frame that made them).

    python benchmarks/nf4_memory.py --out FILE.json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import stages  # noqa: E402,F401  (before torch: MKL's mode)
import torch  # noqa: E402

from stages.blocks import lmhead, models, sampler  # noqa: E402
from stages.blocks.config import LoraCfg, ModelCfg  # noqa: E402

GIB = 2**30


def largest_at_peak(snapshot: dict, n: int = 8) -> list[dict]:
    """The biggest blocks alive in the allocator's segments at snapshot time, with their frame."""
    blocks = []
    for seg in snapshot["segments"]:
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                fr = next((f for f in b.get("frames", []) if "/stages/" in f["filename"] or "/transformers/" in f["filename"]
                           or "/bitsandbytes/" in f["filename"] or "/peft/" in f["filename"]), None)
                blocks.append({"gib": round(b["size"] / GIB, 4),
                               "where": f"{fr['filename'].split('site-packages/')[-1]}:{fr['line']} {fr['name']}" if fr else "?"})
    blocks.sort(key=lambda x: -x["gib"])
    return blocks[:n]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    dev, dt = torch.device("cuda"), torch.bfloat16
    tmp = Path(tempfile.mkdtemp())
    for name, seed in (("smollm2-360m", 0), ("smollm2-1.7b", 1)):
        torch.manual_seed(seed)
        spec = {k: v for k, v in models.arch_config(name).items() if k != "_comment"}
        AutoModelForCausalLM.from_config(AutoConfig.for_model(**spec), dtype=dt).save_pretrained(tmp / name)
    rec: dict = {"steps": []}

    def step(label, fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=200000)
        out = fn()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        rec["steps"].append({"step": label, "allocated_gib": round(torch.cuda.memory_allocated() / GIB, 4),
                             "peak_gib": round(torch.cuda.max_memory_allocated() / GIB, 4),
                             "largest_live_at_end": largest_at_peak(snap)})
        print(json.dumps(rec["steps"][-1]), flush=True)
        return out

    nf4 = ModelCfg(quant="nf4")
    student = step("load student nf4", lambda: models.add_lora(models.load(tmp / "smollm2-360m", nf4, dev, dt),
                                                               LoraCfg(r=16, alpha=32), seed=1))
    teacher = step("load teacher nf4", lambda: models.load(tmp / "smollm2-1.7b", nf4, dev, dt))
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 49000, (4, 128), generator=g).tolist()
    out = step("rollout 4 x 64 (hf_generate)", lambda: sampler.hf_generate(student, prompts, 64, eos=-1, pad=0,
                                                                           seed=0, min_new=64))
    resp = out.tokens.tolist()
    p = lmhead.pack(prompts, resp, [[1] * len(r) for r in resp], 0, "cuda")

    def score():
        with torch.no_grad():
            h = lmhead.hidden(teacher, p)
            return lmhead.score_positions(h, lmhead.head_weight(teacher), p.targets, 256, 32)
    step("teacher score", score)

    def update():
        student.train()
        h = lmhead.hidden(student, p)
        logits = torch.nn.functional.linear(h, lmhead.head_weight(student)).float()
        logits.logsumexp(-1).mean().backward()
        student.eval()
    step("student forward+backward", update)
    args.out.write_text(json.dumps(rec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
