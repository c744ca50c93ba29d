"""`opd inspect`: trajectories readably — prompt, response, per-token sampled log-prob and teacher
log-prob, the largest teacher-student gaps highlighted. `--format json` for scripts."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np

from ..errors import UserError
from ..rows.trajectories import trajectories
from ..run import runview


def run_steps(run_dir: Path, step: int | None) -> list[Path]:
    """The step dirs of the run the view holds (stages/run/runview.py): --step N, else all of them."""
    ks = [k for k in runview.steps(run_dir) if k > 0 and (runview.step_dir(run_dir, k) / "rollout.parquet").exists()]
    if not ks:
        raise UserError(f"{run_dir}: the run has no sampled step yet")
    if step is not None:
        if step not in ks:
            raise UserError(f"--step {step}: not a step of the run in {run_dir} ({runview.ranges(ks)})")
        ks = [step]
    return [runview.step_dir(run_dir, k) for k in ks]


def select(spec: str | None, step: int | None, every_step: bool) -> list[Path]:
    """What `opd inspect` reads: a rollout/scores Parquet or a step dir as given; a run (NAME,
    run=NAME, a run dir, or nothing: the run of ./params.yaml or `default`) -> its steps: --step N,
    else every step when searching (--worst, --uid), else its last step (said on stderr)."""
    p = Path(spec) if spec and not spec.startswith("run=") else None
    if p is not None and (p.is_file() or (p / "rollout.parquet").exists()):
        return [p]
    if p is not None and p.suffix == ".parquet":
        raise UserError(f"{p}: Parquet file not found")
    dirs = run_steps(runview.locate(spec), step)
    if step is None and not every_step and len(dirs) > 1:
        print(f"inspect: {dirs[-1].name}, the run's last step ({runview.ranges([int(d.name[5:]) for d in dirs])}: "
              "--step N for another, --worst N searches all)", file=sys.stderr)
        dirs = dirs[-1:]
    return dirs


def main(args) -> None:
    step = args.step
    if step is None and args.uid and (m := re.match(r"s(\d+)-", args.uid)):
        step = int(m.group(1))  # a uid names its step: read only that one
    try:
        dirs = select(args.path, step, bool(args.worst))
    except UserError as e:
        if args.step is None and step is not None:
            raise UserError(f"--uid {args.uid}: its step {step} is not a step of this run") from None
        raise e
    rows = [r for d in dirs for r in trajectories(d)]
    if args.uid:
        rows = [r for r in rows if r["uid"] == args.uid]
        if not rows:
            raise UserError(f"--uid {args.uid}: no such trajectory in {args.path}")
    if args.worst:
        rows = sorted(rows, key=lambda r: -(r["mean_gap"] or 0))[:args.worst]
    elif not args.uid:
        rows = rows[:args.limit]
    if args.format == "json":
        json.dump(rows, sys.stdout, indent=1)
        print()
        return
    from rich.console import Console
    from rich.table import Table

    con = Console()
    for r in rows:
        con.rule(f"[bold]{r['uid']}[/]  finish={r.get('finish_reason')}  mean |gap|={r['mean_gap'] or 0:.3f}")
        for label in ("prompt", "response"):
            con.print(f"[bold]{label}[/]")
            con.print(r.get(f"{label}_text", ""), markup=False, highlight=False)
        if r.get("spans"):  # a cross-tokenizer run: both tokenizations of each span, and its log-probs
            _spans_table(con, r)
            continue
        t = Table("pos", "token", "sampled logp", "teacher logp", "gap")
        teacher = r["teacher_logprobs"]
        gaps = [abs(a - b) if a is not None else -1.0 for a, b in zip(teacher, r["sample_logprobs"])] if teacher else []
        worst = set(np.argsort(gaps)[-3:].tolist()) if gaps else set()
        for j, piece in enumerate(r["tokens"]):
            scored = bool(teacher) and teacher[j] is not None  # None: not a selected position
            tl = f"{teacher[j]:.3f}" if scored else "-"
            g = f"{teacher[j] - r['sample_logprobs'][j]:+.3f}" if scored else "-"
            style = "bold red" if j in worst else None
            t.add_row(str(j), repr(piece), f"{r['sample_logprobs'][j]:.3f}", tl, g, style=style)
        con.print(t)


def _spans_table(con, r: dict) -> None:
    from rich.table import Table

    t = Table("span", "student tokens", "teacher tokens", "student logp", "teacher logp", "gap")
    teacher, student = r["teacher_logprobs"] or [None] * len(r["spans"]), r["sample_logprobs"]
    gaps = [abs(a - b) if a is not None else -1.0 for a, b in zip(teacher, student)]
    worst = set(np.argsort(gaps)[-3:].tolist())
    for j, sp in enumerate(r["spans"]):
        tl = f"{teacher[j]:.3f}" if teacher[j] is not None else "-" if sp["exact"] else "(not exact)"
        g = f"{teacher[j] - student[j]:+.3f}" if teacher[j] is not None else "-"
        t.add_row(str(j), " ".join(map(repr, sp["student"])), " ".join(map(repr, sp["teacher"])),
                  f"{student[j]:.3f}", tl, g, style="bold red" if j in worst else None)
    con.print(t)
