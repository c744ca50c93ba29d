"""A real pair on a checkable task: on-policy distillation beside its off-policy control, one record.

    python benchmarks/realpair.py --student S --teacher T --data rows.parquet --work DIR \
        --name NAME [--out benchmarks/results] [-- override ...]

Runs, in DIR (its own artifacts store, so a rerun reuses every published stage and only rewrites the
record), two arms with the same overrides, models, prompts and update budget:
- `opd`: `opd run` as a user would, with the defaults (the student samples, the teacher grades);
- `sft`: the off-policy control, `rollout.sampler=teacher objective.name=nll`: the teacher samples
  the same prompts with the same settings and the student learns them by maximum likelihood.
Then writes <out>/<NAME>.json (both arms' evaluation records, the history, the commands, the machine)
and <NAME>.md: task accuracy with its 95% interval for the teacher and the student before and after
each arm, held-out KL and agreement on the teacher's text, answer quality, the exact McNemar test of
each arm's flips, and the answers side by side. Models and data are the caller's (a GGUF path works):
this records a measurement; nothing here downloads.
"""
from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"opd": [], "sft": ["rollout.sampler=teacher", "objective.name=nll"]}


def mcnemar(gained: int, lost: int) -> float:
    """Exact two-sided McNemar p-value: the flips as a fair coin's binomial draws."""
    n = gained + lost
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(0, min(gained, lost) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def run_arm(opd: str, work: Path, run: str, args: list[str]) -> dict:
    argv = [opd, "run", f"run={run}", *args]
    t0 = time.perf_counter()
    r = subprocess.run(argv, cwd=work, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    (work / f"{run}.log").write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        sys.exit(f"{shlex.join(argv)} failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    view = work / "artifacts" / "runs" / run
    with open(view / "history.csv") as f:
        history = list(csv.DictReader(f))
    ev = json.loads((view / "eval.json").read_text())
    # the time each stage took when it was computed (a rerun reuses them: its own wall is near zero)
    store = work / "artifacts" / "store" / "evaluate"
    done = [d for d in sorted(store.iterdir()) if (d / "manifest.json").is_file()]  # (not the store's locks)
    ev_state = next(json.loads((d / "state.json").read_text()) for d in done
                    if json.loads((d / "eval.json").read_text())["final"] == ev["final"])
    phases = ("rollout", "score", "update")
    return {"command": "opd " + shlex.join(argv[1:]), "wall_s": round(wall, 1),
            "computed_s": {p: round(sum(float(h[f"{p}_wall_s"]) for h in history), 1) for p in phases}
            | {"evaluate": round(ev_state["wall_s"], 1)},
            "peak_rss_gib": {"train": max(float(h["peak_memory_gib"]) for h in history),
                             "evaluate": ev_state["peak_rss_gib"]},
            "warning": [ln for ln in r.stderr.splitlines() if ln.startswith("warning:")],
            "eval": ev, "answers": json.loads((view / "answers.json").read_text()),
            "loss": [float(h["loss"]) for h in history if h.get("loss")]}


def _acc(t: dict) -> str:
    lo, hi = t["ci95"]
    return f"{t['accuracy']:.3f} ({t['correct']}/{t['n']}, 95% CI {lo:.3f}-{hi:.3f})"


LABEL = {"opd": "after OPD", "sft": "after SFT on teacher samples"}


def _q(prompt: str) -> str:
    """A prompt's first paragraph (the question, not the answer-format instruction every row repeats)."""
    return prompt.split("\n\n")[0]


def markdown(rec: dict) -> str:
    arms = rec["arms"]
    o = next(iter(arms.values()))["eval"]  # policy 0 and the teacher are the same in every arm
    walls = "; ".join(f"{n}: " + ", ".join(f"{p} {t / 60:.1f} min" for p, t in a["computed_s"].items())
                      + f", peak RSS {max(a['peak_rss_gib'].values()):.1f} GiB" for n, a in arms.items())
    lines = [f"# {rec['title']}", "", rec["setting"], "",
             "```", *[a["command"] for a in arms.values()], "```", "",
             f"Machine: {rec['machine']}; commit {rec['commit'][:7]}. Time each stage took when computed: {walls}.", "",
             "| | before (policy 0) | " + " | ".join(LABEL[n] for n in arms) + " | teacher |",
             "|---|---|" + "---|" * len(arms) + "---|"]

    def row(label: str, first: str, after, teacher: str = "") -> None:
        cells = " | ".join(after(a["eval"]) for a in arms.values())
        lines.append(f"| {label} | {first} | {cells} | {teacher} |")

    row(f"task accuracy, greedy ({o['final']['task']['checker']})", _acc(o["initial"]["task"]),
        lambda e: _acc(e["final"]["task"]), _acc(o["teacher"]["task"]))
    for view, label in (("on_teacher_text", "on the teacher's greedy answers"),
                        ("on_own_text", "on the student's own greedy answers")):
        row(f"KL(teacher‖student) {label}, nats/token", f"{o['initial'][view]['kl']:.3f}",
            lambda e, v=view: f"{e['final'][v]['kl']:.3f}")
    t = o["initial"]["on_teacher_text"]
    row(f"top-1 agreement on the teacher's answers (n={t['tokens']})", f"{t['top1_agreement']:.3f}",
        lambda e: f"{e['final']['on_teacher_text']['top1_agreement']:.3f}")
    row("distinct bigrams of the answers", f"{o['initial']['answers']['distinct_bigrams']:.3f}",
        lambda e: f"{e['final']['answers']['distinct_bigrams']:.3f}",
        f"{o['teacher']['answers']['distinct_bigrams']:.3f}")
    lines += ["", rec.get("summary") or "", ""]
    for name, arm in arms.items():
        f = arm["flips"]
        lines.append(f"- {name}: {f['gained']} prompts gained, {f['lost']} lost (exact McNemar p = {f['p']:.3f}); "
                     f"loss per update {arm['loss'][0]:.3f} first, {arm['loss'][-1]:.3f} last; "
                     + ("ended with: `" + arm["warning"][0] + "`" if arm["warning"] else "no `warning:` line"))
    lines += ["", "## Answers side by side (held-out, greedy)", ""]
    side = {n: {x["prompt"]: x["final"] for x in a["answers"].get("side_by_side", [])} for n, a in arms.items()}
    for x in next(iter(arms.values()))["answers"].get("side_by_side", []):
        lines.append(f"- {_q(x['prompt'])}: teacher `{x['teacher']}`, before `{x['initial']}`, "
                     + ", ".join(f"{LABEL[n]} `{side[n].get(x['prompt'], '')}`" for n in arms))
    for name, arm in arms.items():
        fl = arm["answers"].get("flips", {})
        if fl.get("gained") or fl.get("lost"):
            lines += ["", f"## Flipped prompts, {name}", ""]
            for kind in ("gained", "lost"):
                for x in fl.get(kind, []):
                    lines.append(f"- {kind}: {_q(x['prompt'])} (truth {x['truth']}): before `{x['initial']}`, "
                                 f"after `{x['final']}`")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--student", required=True)
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--data", required=True, help="verl-schema Parquet with ground truths and test rows")
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--name", required=True, help="the record's file name, also the runs' prefix")
    ap.add_argument("--title", default="A real pair on a checkable task: on-policy distillation and its control")
    ap.add_argument("--setting", default="", help="a paragraph on the models, data and machine")
    ap.add_argument("--summary", default="", help="a paragraph on what the numbers say, printed under the table")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--arms", default="opd,sft", help="which arms to run and record (opd, sft)")
    ap.add_argument("overrides", nargs="*", help="the overrides both arms share (after --)")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    opd = str(Path(sys.executable).with_name("opd"))
    common = [f"student.name={a.student}", f"teacher.name={a.teacher}", f"data.path={Path(a.data).resolve()}",
              "student.keep_layers=0", *a.overrides]
    arms = {}
    for name in a.arms.split(","):
        extra = ARMS[name]
        arm = arms[name] = run_arm(opd, a.work, f"{a.name}-{name}", common + extra)
        acc = {w: arm["eval"][w]["task"]["correct"] for w in ("initial", "final")}
        g, lost = len(arm["answers"]["flips"]["gained"]), len(arm["answers"]["flips"]["lost"])
        assert acc["final"] - acc["initial"] == g - lost, "flips disagree with the counts"
        arm["flips"] = {"gained": g, "lost": lost, "p": round(mcnemar(g, lost), 4)}
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    rec = {"schema": "opd-stages/realpair", "date": os.environ.get("OPD_BENCH_DATE", dt.date.today().isoformat()),
           "commit": head, "title": a.title, "setting": a.setting, "summary": a.summary,
           "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "arms": arms}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{a.name}.json").write_text(json.dumps(rec, indent=1) + "\n")
    (a.out / f"{a.name}.md").write_text(markdown(rec))
    print(f"wrote {a.out / a.name}.json and .md")


if __name__ == "__main__":
    main()
