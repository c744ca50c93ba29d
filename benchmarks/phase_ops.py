"""Which ATen ops the score and update phases spend their time in, per step (torch.profiler, CPU
host time per op, steps 2..N), on the workload of a finished `benchmarks/cpu_peer.py` run.

    python benchmarks/phase_ops.py CPU_PEER_RESULT.json [--top 18] [--out FILE.md]

It reruns our side of that result (its `opd stage train` command) in a fresh store seeded with the
run's prepared entries (models, tokenizer, prompts, policy 0), so the same models and prompts are
computed again, and profiles each score and update stage after the first step.
"""
from __future__ import annotations

import argparse
import collections
import json
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from stages.tools.process import process_settings  # noqa: E402

process_settings()  # before torch, as `opd` does (stages/cli.py)

SEEDED = ("model", "tokenizer", "prompts", "prepared", "init")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", type=Path, help="a cpu_peer result JSON (its work dir must still exist)")
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--out", type=Path, default=None, help="also write the tables here (Markdown)")
    args = ap.parse_args(argv)
    res = json.loads(args.result.read_text())
    cmd = next(s["command"] for s in res["systems"] if s.get("command", "").startswith("opd stage train"))
    words = shlex.split(cmd)[1:]
    store = Path(next(w for w in words if w.startswith("artifacts=")).split("=", 1)[1]) / "store"
    work = Path(tempfile.mkdtemp(prefix="opd-phase-ops-"))
    for d in SEEDED:
        shutil.copytree(store / d, work / "store" / d, symlinks=True)
    words = [w for w in words if not w.startswith(("artifacts=", "run="))] + [f"artifacts={work}", "run=phase-ops"]

    import torch
    from torch.profiler import ProfilerActivity, profile

    from stages import cli, score, update

    acc = {"score": collections.Counter(), "update": collections.Counter()}
    steps = collections.Counter()

    def profiled(mod, name):
        orig = mod.run

        def run(sess, k, *a, **kw):
            if k < 2:  # step 1: model loads and warm-up
                return orig(sess, k, *a, **kw)
            with profile(activities=[ProfilerActivity.CPU]) as p:
                out = orig(sess, k, *a, **kw)
            for e in p.key_averages():
                acc[name][e.key] += e.self_cpu_time_total  # microseconds
            steps[name] += 1
            return out
        mod.run = run

    profiled(score, "score")
    profiled(update, "update")
    code = cli.main(words)
    lines = ["# Score and update phases by ATen op, per step (steps 2..)", "",
             f"Workload: ours from `{args.result}` (`{cmd}`), rerun in {work}; torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads. Host time per op (self CPU of torch.profiler: wall time of each "
             "op on the calling thread, its own threads included), medians not taken: totals / steps.", ""]
    for name, ops in acc.items():
        per = {k: v / max(steps[name], 1) / 1000 for k, v in ops.items()}
        lines += [f"## {name}: {sum(per.values()):.1f} ms of ops per step ({steps[name]} steps)", "",
                  "| op | ms per step |", "|---|---|"]
        lines += [f"| {k} | {v:.2f} |" for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:args.top]]
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text)
    shutil.rmtree(work, ignore_errors=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
