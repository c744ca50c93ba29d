"""report: one self-contained HTML page for a run — config summary, training curves, per-phase time
and memory, sampled trajectories with each token coloured by the teacher-student log-prob gap, and
the evaluation results. A run whose final student is worse than policy 0 on held-out text (metrics.json's
`worse`) says so in the page's first line, as the evaluate stage's warning does.

    opd report RUN [--out report.html]

RUN is a run name (`artifacts/runs/<RUN>`) or a run directory. The page loads nothing: curves are
PNGs embedded as base64, styles are inline, there is no script, and a Content-Security-Policy that
forbids every fetch makes the "no network" promise one the browser enforces. It reads only the run
view (history.csv, step-*/state.json, step-*/{rollout,scores}.parquet, metrics.json, eval.json,
answers.json, train.json, prepare.json, config.json), so it works on any finished or partial run.
"""
from __future__ import annotations

import base64
import csv
import io
import math
from pathlib import Path

from .report_html import (
    CSP,
    STYLE,
    _esc,
    _num,
    _pct,
    config_section,
    eval_section,
    phase_section,
    trajectory_section,
)
from .rows import tables
from .rows.trajectories import trajectories
from .run import runview
from .run.store import read_json

# Curves drawn from history.csv: (title, y label, columns). A column missing from the file, or
# empty in every row, is skipped; a figure with nothing left is not drawn.
CURVES = [
    ("KL and loss per update", "nats / token", ["loss", "kl"]),
    ("Gradient norm (before clipping)", "L2 norm", ["grad_norm"]),
    ("Throughput per phase", "tokens / s", ["rollout_tokens_per_s", "score_tokens_per_s", "update_tokens_per_s"]),
    ("Wall time per phase", "seconds", ["rollout_wall_s", "score_wall_s", "update_wall_s"]),
    ("Peak memory", "GiB", ["peak_memory_gib"]),
    ("Teacher top-k mass and overlap", "fraction", ["teacher_topk_mass", "student_topk_mass", "topk_overlap"]),
]


# ---- reading the run view ----

def locate(run: str | None, artifacts: str | None = None) -> Path:
    """NAME, run=NAME or a run directory -> the run directory (stages/run/runview.py; UserError if none)."""
    return runview.locate(run, artifacts)


def read_history(run_dir: Path) -> list[dict]:
    """history.csv as rows of floats (None for empty cells); step as int; only the view's run's steps."""
    f = run_dir / "history.csv"
    if not f.is_file():
        return []
    rows = []
    with open(f, newline="") as fh:
        for raw in csv.DictReader(fh):
            row = {}
            for k, v in raw.items():
                try:
                    row[k] = float(v) if v not in ("", None) else None
                except ValueError:
                    row[k] = None
            if row.get("step") is not None:
                row["step"] = int(row["step"])
                rows.append(row)
    listed = set(runview.steps(run_dir))
    return [r for r in rows if r["step"] in listed]


def read_config(run_dir: Path) -> dict | None:
    """The run's resolved config: config.json in the run view (never a params file of another run)."""
    return read_json(run_dir / "config.json")


def step_dirs(run_dir: Path) -> list[Path]:
    """The update steps (k > 0) the run lists (stages/run/runview.py): never a step another run left."""
    return [runview.step_dir(run_dir, k) for k in runview.steps(run_dir) if k > 0]


def phase_stats(run_dir: Path, skip: set[int] = frozenset()) -> list[dict]:
    """Per phase over the steps computed by the run (not those in `skip`: reused ones, timed by an
    earlier run): total and median wall time, median tokens/s, peak memory."""
    phases: dict[str, list[dict]] = {}
    for d in step_dirs(run_dir):
        if int(d.name.split("-")[1]) in skip:
            continue
        st = read_json(d / "state.json") or {}
        for name, rec in st.items():
            if isinstance(rec, dict) and "wall_s" in rec:
                phases.setdefault("update" if name == "policy" else name, []).append(rec)
    order = {"rollout": 0, "score": 1, "update": 2}
    out = []
    for name in sorted(phases, key=lambda n: (order.get(n, 9), n)):
        recs = phases[name]
        walls = [r["wall_s"] for r in recs if r.get("wall_s") is not None]
        tps = [r["tokens_per_s"] for r in recs if r.get("tokens_per_s") is not None]
        mem = {key: max((r[key] for r in recs if r.get(key) is not None), default=None)
               for key in ("peak_allocated_gib", "peak_reserved_gib", "peak_rss_gib")}
        out.append({"phase": name, "steps": len(recs), "total_wall_s": sum(walls),
                    "median_wall_s": _median(walls), "median_tokens_per_s": _median(tps), **mem})
    return out


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2


def sample_trajectories(run_dir: Path, per_step: int = 3) -> list[tuple[int, list[dict]]]:
    """The first and the last step's trajectories with the largest mean |teacher - student| gap."""
    steps = step_dirs(run_dir)
    steps = [d for d in steps if (d / "rollout.parquet").exists()]
    chosen = list(dict.fromkeys([steps[0], steps[-1]])) if steps else []
    out = []
    for d in chosen:
        rows = trajectories(d / "rollout.parquet")
        masks = {}
        ro = tables.read(d / "rollout.parquet")
        if "response_mask" in ro.column_names:
            masks = dict(zip(ro.column("uid").to_pylist(), ro.column("response_mask").to_pylist()))
        for r in rows:
            r["response_mask"] = masks.get(r["uid"])
        rows.sort(key=lambda r: (-(r["mean_gap"] or 0.0), r["uid"]))
        out.append((int(d.name.split("-")[1]), rows[:per_step]))
    return out


# ---- rendering ----

# curves of how fast a step ran: a reused step (computed by an earlier run) is left out of them
TIMED = {"Throughput per phase", "Wall time per phase", "Peak memory"}


def curve_images(history: list[dict]) -> list[tuple[str, str]]:
    """[(title, base64 PNG)] for each CURVES entry with data."""
    if not history:
        return []
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt

    out = []
    for title, ylabel, cols in CURVES:
        rows = [r for r in history if not (title in TIMED and r.get("reused"))]
        steps = [r["step"] for r in rows]
        series = [(c, [r.get(c) for r in rows]) for c in cols]
        series = [(c, ys) for c, ys in series if any(y is not None and math.isfinite(y) for y in ys)]
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(5.6, 3.2), dpi=100)
        for c, ys in series:
            pts = [(s, y) for s, y in zip(steps, ys) if y is not None and math.isfinite(y)]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, linewidth=1.5, label=c)
        ax.set_title(title, fontsize=11)
        ax.set_xlabel("update (step)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
        if len(series) > 1 or series[0][0] != cols[0]:
            ax.legend(fontsize=8)
        fig.tight_layout()
        buf = io.BytesIO()
        # no Software/date metadata: the same history gives the same bytes
        fig.savefig(buf, format="png", metadata={"Software": None})
        plt.close(fig)
        out.append((title, base64.b64encode(buf.getvalue()).decode("ascii")))
    return out


def status_note(run_dir: Path, reused: list[int]) -> str:
    """What the view holds, when it is not simply a finished run computed in one go."""
    notes = []
    rec = runview.read(run_dir)
    if rec is not None and not rec.get("complete"):
        done = len([k for k in rec["steps"] if k > 0])
        notes.append(f"Incomplete run: {done} of {rec['updates']} updates linked (stopped, or still running).")
    if reused:
        notes.append(f"{runview.ranges(reused).capitalize()} published by an earlier run and reused: their times "
                     "and memory are from then, so they are left out of the timing curves and the phase table.")
    return "".join(f'<p class="note">{_esc(n)}</p>' for n in notes)


def render(run_dir: Path, samples_per_step: int = 3) -> str:
    history = read_history(run_dir)
    cfg = read_config(run_dir)
    metrics = read_json(run_dir / "metrics.json")  # the headline numbers (and `worse`)
    # the whole evaluation record; a view written before eval.json existed kept it in metrics.json
    evaluation = read_json(run_dir / "eval.json") or (metrics or {}).get("eval")
    answers = read_json(run_dir / "answers.json")
    train = read_json(run_dir / "train.json")
    prepared = read_json(run_dir / "prepare.json")
    reused = [r["step"] for r in history if r.get("reused")]
    stats = phase_stats(run_dir, set(reused))
    samples = sample_trajectories(run_dir, samples_per_step)
    imgs = curve_images(history)

    cards = [("updates", _num(len(history)))]
    if history:
        last = history[-1]
        cards += [("final loss", _num(last.get("loss"))), ("final KL (train)", _num(last.get("kl")))]
    ev = evaluation or {}
    if "kl_reduction_on_teacher_text" in ev:
        cards.append(("held-out KL reduction", _pct(ev["kl_reduction_on_teacher_text"])))
        agree = [ev[p]["on_teacher_text"].get("top1_agreement") for p in ("initial", "final")]
        cards.append(("held-out top-1 agreement", f"{_num(agree[0])} → {_num(agree[1])}"))
    mem = [s.get("peak_allocated_gib") or s.get("peak_rss_gib") for s in stats]
    mem = [m for m in mem if m is not None]
    if mem:
        cards.append(("peak memory GiB", _num(max(mem))))
    summary = "".join(f'<div class="card"><span class="muted">{_esc(k)}</span><b>{v}</b></div>' for k, v in cards)
    curves = "".join(f'<img alt="{_esc(t)}" src="data:image/png;base64,{b}">' for t, b in imgs) \
        or '<p class="muted">No history.csv yet.</p>'
    name = (cfg or {}).get("run") or run_dir.name
    worse = runview.worse_warning(metrics)
    warning = f'<p class="warn">{_esc(worse)}</p>' if worse else ""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{CSP}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>opd report: {_esc(name)}</title><style>{STYLE}</style></head>
<body><main>
{warning}<h1>opd report: {_esc(name)}</h1>
<div class="muted">run view <code>{_esc(run_dir)}</code></div>
{status_note(run_dir, reused)}
<div class="summary">{summary}</div>
<h2 id="config">Config</h2>{config_section(cfg, prepared, train)}
<h2 id="curves">Training curves</h2><div class="curves">{curves}</div>
<h2 id="phases">Time and memory per phase</h2>{phase_section(stats, history, train)}
<h2 id="trajectories">Trajectories</h2>{trajectory_section(samples)}
<h2 id="evaluation">Evaluation (held-out)</h2>{eval_section(evaluation, answers)}
</main></body></html>
"""


def write(run_dir: Path, out: Path, samples_per_step: int = 3) -> Path:
    import os

    page = render(run_dir, samples_per_step)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, out)
    return out


def main(args) -> Path:
    run_dir = locate(args.run, getattr(args, "artifacts", None))
    out = Path(args.out) if args.out else run_dir / "report.html"
    write(run_dir, out, args.samples)
    print(f"report: {out}")
    return out
