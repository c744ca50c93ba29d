"""Trajectories as a reader sees them: a rollout Parquet joined with its scores by uid, each response
as decoded tokens with the student's sampled and the teacher's log-prob per token (`opd inspect`
and the report read them). In a cross-tokenizer run (a spans.parquet beside them: stages/align.py)
the units are the aligned spans: each span's text, the student's log-prob summed over its tokens and
the teacher's over its own, and under `spans` both tokenizations of every span."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from ..errors import UserError
from . import tables


def _locate(path: Path, step: int | None) -> tuple[Path, Path | None]:
    """A rollout/scores Parquet or a step dir -> (rollout, scores or None)."""
    if path.is_dir():
        if step is not None and not (path / "rollout.parquet").exists():
            path = path / f"step-{step:04d}"
        if not (path / "rollout.parquet").exists():
            raise UserError(f"{path}: no rollout.parquet in it")
        path = path / "rollout.parquet"
    if path.name == "scores.parquet":
        path = path.with_name("rollout.parquet")
    sc = path.with_name("scores.parquet")
    return path, sc if sc.exists() else None


def _unique_uids(t, path: Path) -> None:
    """Scores are joined to trajectories by uid: a repeated one would pair the wrong rows."""
    seen: set = set()
    for u in t.column("uid").to_pylist():
        if u in seen:
            raise UserError(f"{path}: duplicate uid {u!r} (each trajectory needs its own)")
        seen.add(u)


def trajectories(path: Path, step: int | None = None) -> list[dict]:
    ro_path, sc_path = _locate(path, step)
    ro = tables.read(ro_path, {"uid": None, "response_ids": None, "sample_logprobs": None})
    _unique_uids(ro, ro_path)
    lps = tables.lists(ro, "sample_logprobs")
    teacher = {}
    if sc_path:
        sc = tables.read(sc_path, {"uid": None, "teacher_logprobs": None})
        _unique_uids(sc, sc_path)
        teacher = dict(zip(sc.column("uid").to_pylist(), tables.lists(sc, "teacher_logprobs")))
    decode = _decoder(ro_path)
    out = []
    for i, row in enumerate(ro.select([c for c in ("uid", "step", "prompt_text", "response_text", "response_ids",
                                                    "finish_reason") if c in ro.column_names]).to_pylist()):
        t = teacher.get(row["uid"])
        s = lps[i]
        if t is not None and len(t) != len(s):  # a cross-tokenizer step's: over the teacher's tokens (_by_span)
            t = None
        gap = (t - s) if t is not None else None
        pieces = [decode([x]) for x in row["response_ids"]] if decode else [str(x) for x in row["response_ids"]]
        scored = None if gap is None else np.isfinite(gap)  # position selection leaves NaN where unscored
        out.append({**row, "tokens": pieces, "sample_logprobs": s.tolist(),
                    "teacher_logprobs": None if t is None else [float(x) if np.isfinite(x) else None for x in t],
                    "mean_gap": None if gap is None or not scored.any() else float(np.abs(gap[scored]).mean())})
    al_path = ro_path.with_name("spans.parquet")
    return _by_span(out, al_path, sc_path, _decoder(ro_path, "teacher")) if al_path.exists() else out


def _by_span(rows: list[dict], al_path: Path, sc_path: Path | None, t_decode) -> list[dict]:
    """A cross-tokenizer step's trajectories with the aligned spans as their units."""
    al = {r["uid"]: r for r in tables.read(al_path).to_pylist()}
    span_lp = {}
    if sc_path:
        sc = tables.read(sc_path, {"uid": None, "span_logprobs": None})
        span_lp = dict(zip(sc.column("uid").to_pylist(), sc.column("span_logprobs").to_pylist()))
    for r in rows:
        a = al.get(r["uid"])
        if a is None:
            continue
        n = len(a["span_exact"])
        s_lp = np.zeros(n)
        np.add.at(s_lp, np.asarray(a["student_span"], dtype=np.int64), np.asarray(r["sample_logprobs"]))
        t_lp = [x if x is not None and np.isfinite(x) else None for x in span_lp.get(r["uid"], [None] * n)]
        tp = [t_decode([x]) if t_decode else str(x) for x in a["teacher_response_ids"]]
        r["spans"] = [{"text": a["span_text"][j], "exact": bool(a["span_exact"][j]),
                       "student": [p for p, sp in zip(r["tokens"], a["student_span"]) if sp == j],
                       "teacher": [p for p, sp in zip(tp, a["teacher_span"]) if sp == j]} for j in range(n)]
        gaps = [abs(t - s) for t, s in zip(t_lp, s_lp) if t is not None]
        r.update(tokens=list(a["span_text"]), sample_logprobs=s_lp.tolist(),
                 teacher_logprobs=t_lp if span_lp else None,
                 mean_gap=float(np.mean(gaps)) if gaps else None)
    return rows


def _decoder(ro_path: Path, role: str = "student"):
    """The student's (or the teacher's) tokenizer's decode (list of ids -> text), found through the run
    view's prepare.json (None if unavailable)."""
    run_dir = ro_path.parent.parent
    prep = run_dir / "prepare.json"
    if not prep.exists():
        return None
    dig = json.loads(prep.read_text())[role]
    store = run_dir.parent.parent / "store" / "model" / dig
    return _load_decode(str(store)) if (store / "tokenizer_config.json").exists() else None


@functools.lru_cache(maxsize=4)
def _load_decode(path: str):
    """The `tokenizers` library's decode of the saved tokenizer.json where it is the whole story (no
    clean-up of spaces), which is transformers' decode without importing transformers: that import
    would be most of `opd inspect`'s time (docs/architecture.md, "Startup"). Else transformers' own."""
    d = Path(path)
    conf = json.loads((d / "tokenizer_config.json").read_text())
    if (d / "tokenizer.json").exists() and not conf.get("clean_up_tokenization_spaces"):
        from tokenizers import Tokenizer

        tk = Tokenizer.from_file(str(d / "tokenizer.json"))
        return lambda ids: tk.decode(ids, skip_special_tokens=False)  # (transformers' default; tokenizers' is True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path).decode
