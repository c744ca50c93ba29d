"""report: one self-contained HTML page for a run — config summary, training curves, per-phase time
and memory, sampled trajectories with each token coloured by the teacher-student log-prob gap, and
the evaluation results.

    opd report RUN [--out report.html]

RUN is a run name (`artifacts/runs/<RUN>`) or a run directory. The page loads nothing: curves are
PNGs embedded as base64, styles are inline, there is no script, and a Content-Security-Policy that
forbids every fetch makes the "no network" promise one the browser enforces. It reads only the run
view (history.csv, step-*/state.json, step-*/{rollout,scores}.parquet, metrics.json, train.json,
prepare.json, config.json), so it works on any finished or partial run.
"""
from __future__ import annotations

import base64
import csv
import html
import io
import json
import math
from pathlib import Path

from . import inspection, runview, tables
from .errors import UserError

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
# Config groups shown in the summary, in this order (anything else follows).
CONFIG_ORDER = ["run", "student", "teacher", "objective", "rollout", "train", "optim", "lora", "data", "eval",
                "runtime"]
GAP_CLIP = 4.0  # nats: a token whose |gap| reaches this gets the full colour


# ---- reading the run view ----

def locate(run: str | None, artifacts: str | None = None) -> Path:
    """NAME, run=NAME or a run directory -> the run directory (stages/runview.py; UserError if none)."""
    return runview.locate(run, artifacts)


def _json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        raise UserError(f"{path}: not valid JSON") from None


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
    return _json(run_dir / "config.json")


def step_dirs(run_dir: Path) -> list[Path]:
    """The update steps (k > 0) the run lists (stages/runview.py): never a step another run left."""
    return [runview.step_dir(run_dir, k) for k in runview.steps(run_dir) if k > 0]


def phase_stats(run_dir: Path, skip: set[int] = frozenset()) -> list[dict]:
    """Per phase over the steps computed by the run (not those in `skip`: reused ones, timed by an
    earlier run): total and median wall time, median tokens/s, peak memory."""
    phases: dict[str, list[dict]] = {}
    for d in step_dirs(run_dir):
        if int(d.name.split("-")[1]) in skip:
            continue
        st = _json(d / "state.json") or {}
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
        rows = inspection.trajectories(d / "rollout.parquet")
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

def _esc(x) -> str:
    return html.escape(str(x), quote=True)


def _num(x, digits: int = 4) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return str(x).lower()
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if math.isnan(x):
            return "–"
        return f"{x:.{digits}g}" if abs(x) < 1e5 else f"{x:,.0f}"
    return _esc(x)


def _pct(x) -> str:
    return "–" if not isinstance(x, (int, float)) else f"{100 * x:.1f}%"


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


def _table(header: list[str], rows: list[list[str]], cls: str = "") -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _flat(d, prefix: str = "") -> list[tuple[str, object]]:
    if isinstance(d, dict):
        out = []
        for k, v in d.items():
            out += _flat(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    return [(prefix, d)]


def config_section(cfg: dict | None, prepared: dict | None, train: dict | None) -> str:
    if cfg is None:
        return '<p class="muted">No config.json in the run view and no matching params.yaml here.</p>'
    parts = []
    s, t, o, ro, tr = (cfg.get(k, {}) or {} for k in ("student", "teacher", "objective", "rollout", "train"))
    lead = (f"student <b>{_esc(s.get('name'))}</b> (keep_layers {_esc(s.get('keep_layers'))}, quant "
            f"{_esc(s.get('quant'))}) distilled from teacher <b>{_esc(t.get('name'))}</b> with "
            f"<b>{_esc(o.get('name'))}</b> (top-k {_esc(o.get('topk'))}); {_esc(tr.get('updates'))} updates of "
            f"{_esc(ro.get('batch_size'))} prompts &times; {_esc(ro.get('n'))} samples, up to "
            f"{_esc(ro.get('max_new_tokens'))} new tokens")
    parts.append(f"<p>{lead}.</p>")
    keys = [k for k in CONFIG_ORDER if k in cfg] + sorted(k for k in cfg if k not in CONFIG_ORDER)

    def kv(pairs):
        return _table(["key", "value"], [[_esc(n), f"<code>{_esc(json.dumps(v))}</code>"] for n, v in pairs], "kv")

    scalars = [(k, cfg[k]) for k in keys if not isinstance(cfg[k], dict)]
    cells = [f"<details open><summary>top level</summary>{kv(scalars)}</details>"] if scalars else []
    cells += [f"<details><summary>{_esc(k)}</summary>{kv(_flat(cfg[k]))}</details>"
              for k in keys if isinstance(cfg[k], dict)]
    parts.append('<div class="cfg">' + "".join(cells) + "</div>")
    dig = [["final policy", train.get("final_policy")] if train else None,
           ["initial policy", train.get("initial_policy")] if train else None]
    dig += [[f"prepare: {k}", v] for k, v in (prepared or {}).items() if isinstance(v, str)]
    dig = [r for r in dig if r and r[1]]
    if dig:
        parts.append("<details><summary>digests (store addresses)</summary>"
                     + _table(["what", "digest"], [[_esc(a), f"<code>{_esc(b)}</code>"] for a, b in dig], "kv")
                     + "</details>")
    return "".join(parts)


def phase_section(stats: list[dict], history: list[dict], train: dict | None) -> str:
    if not stats:
        return '<p class="muted">No step-*/state.json in the run view.</p>'
    rows = []
    for s in stats:
        rows.append([_esc(s["phase"]), _num(s["steps"]), _num(s["total_wall_s"]), _num(s["median_wall_s"]),
                     _num(s["median_tokens_per_s"]), _num(s.get("peak_allocated_gib")),
                     _num(s.get("peak_reserved_gib")), _num(s.get("peak_rss_gib"))])
    out = _table(["phase", "steps", "total wall s", "median wall s", "median tokens/s", "peak allocated GiB",
                  "peak reserved GiB", "peak RSS GiB"], rows, "num")
    timings = (train or {}).get("timings") or {}
    if timings:
        out += "<p>" + "; ".join(f"{_esc(k)}: {_num(v)}" for k, v in sorted(timings.items())) + \
               " <span class=\"muted\">(this process, train.json)</span></p>"
    if history:
        out += f'<p class="muted">{len(history)} updates recorded in history.csv.</p>'
    return out


def _gap_style(gap: float | None, masked: bool) -> str:
    if masked:
        return "background:#e6e6e6;color:#777"
    if gap is None or not math.isfinite(gap):
        return ""
    a = min(abs(gap) / GAP_CLIP, 1.0) * 0.85
    # teacher likes the token more than the student did (gap > 0): blue; less (gap < 0): red
    rgb = "37,99,235" if gap > 0 else "220,38,38"
    return f"background:rgba({rgb},{a:.2f})"


def trajectory_section(samples: list[tuple[int, list[dict]]]) -> str:
    if not samples:
        return '<p class="muted">No step-*/rollout.parquet in the run view.</p>'
    legend = ('<p class="legend">Each response token is coloured by <code>gap = teacher log-prob − student '
              'log-prob</code> of the sampled token: <span class="tok" style="background:rgba(37,99,235,.7)">'
              'teacher prefers it</span> <span class="tok" style="background:rgba(220,38,38,.7)">teacher '
              f'disagrees</span>, full colour at |gap| ≥ {GAP_CLIP:g} nats; grey: not generated by the model '
              '(tool output or padding). Hover a token for its numbers.</p>')
    parts = [legend]
    for step, rows in samples:
        parts.append(f"<h3>step {step}: {len(rows)} trajectories with the largest mean |gap|</h3>")
        for r in rows:
            teacher, student = r.get("teacher_logprobs"), r.get("sample_logprobs") or []
            mask = r.get("response_mask")
            spans = []
            for j, piece in enumerate(r["tokens"]):
                s = student[j] if j < len(student) else None
                t = teacher[j] if teacher is not None and j < len(teacher) else None
                gap = (t - s) if t is not None and s is not None else None
                masked = bool(mask is not None and j < len(mask) and not mask[j])
                tip = f"#{j} student {_num(s)} teacher {_num(t)} gap {_num(gap)}"
                spans.append(f'<span class="tok" style="{_gap_style(gap, masked)}" title="{_esc(tip)}">'
                             f"{_esc(piece)}</span>")
            head = (f"<code>{_esc(r['uid'])}</code> finish={_esc(r.get('finish_reason'))} "
                    f"tokens={len(r['tokens'])} mean |gap|={_num(r.get('mean_gap'))}")
            parts.append(f'<div class="traj"><div class="meta">{head}</div>'
                         f'<div class="prompt">{_esc(r.get("prompt_text", ""))}</div>'
                         f'<div class="resp">{"".join(spans)}</div></div>')
    return "".join(parts)


def eval_section(metrics: dict | None) -> str:
    if metrics is None:
        return '<p class="muted">No metrics.json yet (run the evaluate stage).</p>'
    ev = metrics.get("eval", metrics)
    parts = []
    views = [v for v in ("on_teacher_text", "on_own_text")
             if isinstance(ev.get("initial"), dict) and v in ev["initial"]]
    if views:
        rows = []
        for v in views:
            a, b = ev["initial"][v], (ev.get("final") or {}).get(v, {})
            rows.append([_esc(v.replace("_", " ")), _num(a.get("kl")), _num(b.get("kl")),
                         _pct(ev.get(f"kl_reduction_{v}")), _num(a.get("top1_agreement")),
                         _num(b.get("top1_agreement")), _num(b.get("tokens", a.get("tokens")))])
        parts.append(_table(["held-out view", "KL initial", "KL final", "KL reduction", "top-1 initial",
                             "top-1 final", "tokens"], rows, "num"))
    shown = {f"{p}.{v}" for p in ("initial", "final") for v in views} | {f"kl_reduction_{v}" for v in views}
    rest = [(k, v) for k, v in _flat(metrics) if not any(k.removeprefix("eval.").startswith(s) for s in shown)]
    if rest:
        parts.append(_table(["metric", "value"], [[_esc(k), _num(v)] for k, v in rest], "kv"))
    return "".join(parts)


STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1f2328;background:#fff}
main{max-width:1180px;margin:0 auto;padding:16px 24px 48px}
h1{font-size:22px;margin:8px 0 4px}h2{font-size:17px;border-bottom:1px solid #d0d7de;padding-bottom:4px;margin-top:28px}
h3{font-size:14px;margin:16px 0 6px}
.muted{color:#656d76}.note{background:#fff8c5;border:1px solid #d4a72c;border-radius:6px;padding:6px 10px}.summary{display:flex;flex-wrap:wrap;gap:12px;margin:12px 0}
.card{border:1px solid #d0d7de;border-radius:6px;padding:8px 12px;min-width:140px;background:#f6f8fa}
.card b{display:block;font-size:18px}
table{border-collapse:collapse;margin:6px 0 10px}td,th{border:1px solid #d0d7de;padding:3px 8px;text-align:left}
th{background:#f6f8fa}table.num td{text-align:right}table.num td:first-child{text-align:left}
.cfg{display:flex;flex-wrap:wrap;gap:6px 18px;align-items:flex-start}.cfg details{min-width:200px}summary{cursor:pointer;font-weight:600}
.curves{display:flex;flex-wrap:wrap;gap:10px}.curves img{border:1px solid #d0d7de;border-radius:4px;width:560px;max-width:100%}
.traj{border:1px solid #d0d7de;border-radius:6px;margin:8px 0;padding:6px 10px}
.meta{font-size:12px;color:#656d76}.prompt{white-space:pre-wrap;color:#656d76;font-size:12px;margin:4px 0;
max-height:7em;overflow:auto}
.resp{white-space:pre-wrap;font:13px/1.7 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
.tok{border-radius:2px;padding:0 1px}code{font:12px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
"""
# Nothing may be fetched: the page is one file (images are data: URIs, styles inline, no script).
CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"


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
    metrics = _json(run_dir / "metrics.json")
    train = _json(run_dir / "train.json")
    prepared = _json(run_dir / "prepare.json")
    reused = [r["step"] for r in history if r.get("reused")]
    stats = phase_stats(run_dir, set(reused))
    samples = sample_trajectories(run_dir, samples_per_step)
    imgs = curve_images(history)

    cards = [("updates", _num(len(history)))]
    if history:
        last = history[-1]
        cards += [("final loss", _num(last.get("loss"))), ("final KL (train)", _num(last.get("kl")))]
    ev = (metrics or {}).get("eval", {})
    if "kl_reduction_on_teacher_text" in ev:
        cards.append(("held-out KL reduction", _pct(ev["kl_reduction_on_teacher_text"])))
    mem = [s.get("peak_allocated_gib") or s.get("peak_rss_gib") for s in stats]
    mem = [m for m in mem if m is not None]
    if mem:
        cards.append(("peak memory GiB", _num(max(mem))))
    summary = "".join(f'<div class="card"><span class="muted">{_esc(k)}</span><b>{v}</b></div>' for k, v in cards)
    curves = "".join(f'<img alt="{_esc(t)}" src="data:image/png;base64,{b}">' for t, b in imgs) \
        or '<p class="muted">No history.csv yet.</p>'
    name = (cfg or {}).get("run") or run_dir.name
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{CSP}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>opd report: {_esc(name)}</title><style>{STYLE}</style></head>
<body><main>
<h1>opd report: {_esc(name)}</h1>
<div class="muted">run view <code>{_esc(run_dir)}</code></div>
{status_note(run_dir, reused)}
<div class="summary">{summary}</div>
<h2 id="config">Config</h2>{config_section(cfg, prepared, train)}
<h2 id="curves">Training curves</h2><div class="curves">{curves}</div>
<h2 id="phases">Time and memory per phase</h2>{phase_section(stats, history, train)}
<h2 id="trajectories">Trajectories</h2>{trajectory_section(samples)}
<h2 id="evaluation">Evaluation (held-out)</h2>{eval_section(metrics)}
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
