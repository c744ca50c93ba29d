"""`opd plan` estimates beside measured peaks: reads a systems benchmark result (benchmarks/systems.py,
peak allocated GiB per phase, measured on the GPU) and puts the weight-free plan of the same
workload shapes next to it. Runs anywhere (no GPU, no weights).

    python benchmarks/plan_vs_measured.py benchmarks/results/2026-11-30-h200-systems.json

Writes <result stem>-plan.json and .md beside the input. For measured figures of the plan's own
worst case (every prompt at the limit), run `opd plan <workload overrides> --probe` on the GPU.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# the overrides that give each systems workload's shape; (b) drives the functions with chunk 1024
EXTRA = {"a": [], "b": ["train.chunk=1024"]}
PHASE = {"rollout": "rollout", "score": "score", "policy": "update"}


def overrides(shape: dict, extra: list[str]) -> list[str]:
    return [f"student.name=arch:{shape['student']}", "student.init=random", "student.keep_layers=0",
            f"teacher.name=arch:{shape['teacher']}", "teacher.init=random", "runtime.device=cuda",
            "memory.vram_gib=139", "memory.placement=resident", f"rollout.batch_size={shape['prompts']}",
            f"data.max_prompt_tokens={shape['prompt_tokens']}", f"rollout.max_new_tokens={shape['response']}",
            f"objective.topk={shape['topk']}", *extra]


def main(path: str) -> None:
    from stages.run import config
    from stages.memory import plan

    src = Path(path)
    result = json.loads(src.read_text())
    rows, out = [], {"source": str(src.relative_to(ROOT) if src.is_absolute() else src), "workloads": {}}
    for name, wl in result["workloads"].items():
        over = overrides(wl["shape"], EXTRA.get(name, []))
        est = plan.estimate(config.compose(over))
        measured = wl["systems"][0]["peak_allocated_gib"]
        system = wl["systems"][0]["name"]
        per = {}
        for key, ph in PHASE.items():
            if key in measured:
                e, m = est["phases"][ph]["total_gib"], measured[key]
                per[ph] = {"estimate_gib": e, "measured_gib": m, "ratio": round(e / m, 3)}
                rows.append(f"| {name} | {system} | {ph} | {e:.3f} | {m:.3f} | {e / m:.3f} |")
        out["workloads"][name] = {"command": "opd plan " + " ".join(over), "system": system, "phases": per}
    stem = src.with_name(src.stem + "-plan")
    stem.with_suffix(".json").write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    md = ["# `opd plan` estimate vs measured peak allocated (GiB)", "",
          f"Measured: `{out['source']}`. Estimate: `python benchmarks/plan_vs_measured.py {out['source']}` "
          "(weight-free; commands per workload in the JSON).", "",
          "| workload | measured system | phase | estimate | measured | estimate / measured |",
          "|---|---|---|---|---|---|", *rows, ""]
    stem.with_suffix(".md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(sorted((ROOT / "benchmarks/results").glob("*-systems*.json"))[-1]))
