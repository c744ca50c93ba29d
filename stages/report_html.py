"""The HTML of `opd report` (stages/report.py reads the run view): the sections of the page, its
inline style and the Content-Security-Policy that forbids every fetch."""
from __future__ import annotations

import html
import json
import math

# Config groups shown in the summary, in this order (anything else follows).
CONFIG_ORDER = ["run", "student", "teacher", "objective", "rollout", "train", "optim", "lora", "data", "eval",
                "runtime"]
GAP_CLIP = 4.0  # nats: a token whose |gap| reaches this gets the full colour


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
    legend = ('<p class="legend">Each response token (in a cross-tokenizer run, each aligned span: both '
              'log-probs summed over its tokens) is coloured by <code>gap = teacher log-prob − student '
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


def eval_section(record: dict | None, answers: dict | None = None) -> str:
    """The evaluation: `record` is the run view's eval.json (or the `eval` of a metrics.json written
    before eval.json existed), `answers` its answers.json."""
    if record is None:
        return '<p class="muted">No eval.json yet (run the evaluate stage).</p>'
    ev = record.get("eval", record)
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
    # what the greedy answers look like: a falling KL with blank or repeating answers is no result
    who = [w for w in ("teacher", "initial", "final") if isinstance(ev.get(w), dict) and "answers" in ev[w]]
    if who:
        parts.append(_table(["greedy answers of", "non-blank", "distinct bigrams", "mean tokens"],
                            [[_esc(w), _pct(ev[w]["answers"].get("nonblank")),
                              _num(ev[w]["answers"].get("distinct_bigrams")), _num(ev[w]["answers"].get("mean_tokens"))]
                             for w in who], "num"))
    # task accuracy where the held-out rows have a ground truth: correctness next to the imitation figures
    scored = [w for w in ("teacher", "initial", "final") if isinstance(ev.get(w), dict) and "task" in ev[w]]
    if scored:
        label = {"teacher": "teacher", "initial": "student before", "final": "student after"}
        parts.append(_table(["task accuracy of", "correct / n", "accuracy", "95% interval (Wilson)", "checker"],
                            [[_esc(label[w]), f"{_num(t.get('correct'))} / {_num(t.get('n'))}", _pct(t.get("accuracy")),
                              " – ".join(_pct(x) for x in t.get("ci95") or []), f"<code>{_esc(t.get('checker'))}</code>"]
                             for w in scored for t in [ev[w]["task"]]], "num"))
    flips = (answers or {}).get("flips") or ev.get("flips") or {}
    flipped = [(d, r) for d in ("gained", "lost") for r in flips.get(d) or []]
    if scored or flipped:
        parts.append(f"<h3>Held-out prompts that flipped: {len(flips.get('gained') or [])} wrong before and right "
                     f"after, {len(flips.get('lost') or [])} right before and wrong after</h3>")
    if flipped:
        arrow = {"gained": "wrong → right", "lost": "right → wrong"}
        parts.append(_table(["flip", "prompt", "truth", "student before", "student after"],
                            [[_esc(arrow[d]), _esc(r.get("prompt")), f"<code>{_esc(r.get('truth'))}</code>"]
                             + [f'<span class="resp">{_esc(r.get(k) or "")}</span>' for k in ("initial", "final")]
                             for d, r in flipped]))
    side = (answers or {}).get("side_by_side") or []
    if side:
        parts.append("<h3>Held-out prompts, answers side by side (greedy)</h3>")
        parts.append(_table(["prompt", "teacher", "student before", "student after"],
                            [[_esc(r["prompt"])] + [f'<span class="resp">{_esc(r[k])}</span>' if r[k].strip()
                                                    else '<span class="muted">(blank)</span>'
                                                    for k in ("teacher", "initial", "final")] for r in side]))
    shown = ({f"{p}.{v}" for p in ("initial", "final") for v in views} | {f"kl_reduction_{v}" for v in views}
             | {f"{w}.answers" for w in who} | {f"{w}.task" for w in scored} | {"flips"})
    rest = [(k, v) for k, v in _flat(record) if not any(k.removeprefix("eval.").startswith(s) for s in shown)]
    if rest:
        parts.append(_table(["metric", "value"], [[_esc(k), _num(v)] for k, v in rest], "kv"))
    return "".join(parts)


STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1f2328;background:#fff}
main{max-width:1180px;margin:0 auto;padding:16px 24px 48px}
h1{font-size:22px;margin:8px 0 4px}h2{font-size:17px;border-bottom:1px solid #d0d7de;padding-bottom:4px;margin-top:28px}
h3{font-size:14px;margin:16px 0 6px}
.warn{background:#ffebe9;border:1px solid #cf222e;border-radius:6px;padding:6px 10px;margin:8px 0;color:#82071e;font-weight:600}
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
