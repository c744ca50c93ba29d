"""Where the NF4 seed workload's GPU memory goes (CUDA): random-init SmolLM2-360M / 1.7B saved as
bf16, loaded NF4 through `stages.weights.models.load`, then one rollout (transformers fallback, as
the pipeline samples a quantized base), one teacher scoring pass and one LoRA update forward+backward
of the seed shapes (4 x (128 + 64) tokens). Per step: allocated after it, its peak, and the largest
live allocations at the peak (torch's allocator history, with the Python frame that made them).

    python benchmarks/nf4_memory.py --out FILE.json [--probe TOKENIZER_DIR]

--probe also runs `opd plan --probe`'s measurement (stages/tools/probe.py) on the same shapes with
NF4 student and teacher, and records at the end of each of its phases what is allocated and the
largest live blocks (the plan test found 4.35 GiB in its rollout phase against 1.42 here).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from stages.tools.process import process_settings  # noqa: E402

process_settings()  # before torch, as `opd` does (stages/cli.py)
import torch  # noqa: E402

from stages.engine import lmhead, sampler
from stages.weights import lora, models  # noqa: E402
from stages.run.config import LoraCfg, ModelCfg  # noqa: E402

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
    ap.add_argument("--probe", default=None, help="a SmolLM2 tokenizer dir: also run the pipeline's probe")
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
    student = step("load student nf4", lambda: lora.add(models.load(tmp / "smollm2-360m", nf4, dev, dt),
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
    if args.probe:
        del student, teacher, out, p
        torch.cuda.empty_cache()
        rec["probe"] = probe_phases(args.probe, tmp)
        args.out.write_text(json.dumps(rec, indent=1) + "\n")
    return 0


def probe_phases(tokenizer: str, tmp: Path) -> dict:
    """The pipeline probe with NF4 both, its `phase` wrapped to snapshot what is live at each exit."""
    from contextlib import contextmanager

    from stages.run import config
    from stages.memory import plan
    from stages.tools import probe

    tok = str(Path(tokenizer).resolve())
    cfg = config.compose([
        "student.name=arch:smollm2-360m", "student.init=random", "student.keep_layers=0", f"student.tokenizer={tok}",
        "teacher.name=arch:smollm2-1.7b", "teacher.init=random", f"teacher.tokenizer={tok}",
        "data.max_prompt_tokens=128", "rollout.max_new_tokens=64", "rollout.batch_size=4", "runtime.device=cuda",
        "student.quant=nf4", "teacher.quant=nf4", "memory.placement=resident", f"artifacts={tmp / 'artifacts'}"])
    est = plan.estimate(cfg)
    seen: dict = {}
    inner = probe.phase

    @contextmanager
    def watched(device, record, tokens=0):
        torch.cuda.memory._record_memory_history(max_entries=200000)
        with inner(device, record, tokens) as box:
            yield box
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        seen[len(seen)] = {"record": dict(record), "allocated_gib": round(torch.cuda.memory_allocated() / GIB, 4),
                           "largest_live_at_end": largest_at_peak(snap, 12)}
        print(json.dumps(seen[len(seen) - 1]), flush=True)

    probe.phase = watched
    try:
        before = round(torch.cuda.memory_allocated() / GIB, 4)
        out = probe.measure(cfg, est)
    finally:
        probe.phase = inner
    return {"allocated_before_gib": before, "plan_peak_gib": est.get("peak_gib"), "phases": seen,
            "measured": out["phases"]}


if __name__ == "__main__":
    raise SystemExit(main())
