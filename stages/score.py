"""score(k): the frozen teacher reads prompt+response once and records, per response token, the
log-prob of the sampled token and (when the objective needs it) the top-k ids and log-probs.

One teacher forward per batch; the LM head and top-k run in position chunks.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from . import objectives
from .engine import batch, lmhead
from .memory import placement
from .run import selection
from .rows import alignment, tables, tooluse
from .run.config import logit_temperature
from .errors import UserError
from .run.store import seed_of
from .session import Session, phase


def select_positions(sess: Session, ro: pa.Table, seed: int) -> np.ndarray:
    """[n] bool over the packed response positions (row-major, as `packed`): which reach the LM head."""
    cfg = sess.cfg.selection
    spans = None
    if cfg.mode == "hybrid":
        tok = sess.models.tokenizer()
        spans = [selection.token_spans(tok, ids, cfg.keep_patterns) for ids in tables.lists(ro, "response_ids", np.int64)]
    sel = selection.select(cfg, tables.lists(ro, "response_mask", np.int8), seed, spans)
    return np.concatenate(sel).astype(bool) if sel else np.zeros(0, dtype=bool)


def _spread(values: np.ndarray, sel: np.ndarray, fill) -> np.ndarray:
    out = np.full((sel.size, *values.shape[1:]), fill, dtype=values.dtype)
    out[sel] = values
    return out


def teacher_rows(al: pa.Table) -> pa.Table:
    """A cross-tokenizer run's align table as the rows the teacher reads: its own prompt and response ids."""
    resp = al.column("teacher_response_ids")
    ones = [[1] * len(r) for r in resp.to_pylist()]
    return pa.table({"uid": al.column("uid"), "prompt_ids": al.column("teacher_prompt_ids"), "response_ids": resp,
                     "response_mask": pa.array(ones, pa.list_(pa.int8()))})


def span_sums(lp: np.ndarray, al: pa.Table) -> pa.Array:
    """Per row, log p_teacher of each aligned span: the sum over its teacher tokens (float64, then
    float32); NaN where the span is not exact (its bytes are not text the teacher read). lp: [n] over
    the teacher's response tokens, rows end to end -> list<float32> per row."""
    t_span, exact = al.column("teacher_span").to_pylist(), al.column("span_exact").to_pylist()
    out, at = [], 0
    for spans, ex in zip(t_span, exact):
        s = np.zeros(len(ex))
        np.add.at(s, np.asarray(spans, dtype=np.int64), lp[at:at + len(spans)].astype(np.float64))
        at += len(spans)
        out.append(np.where(np.asarray(ex, dtype=bool), s, np.nan).astype(np.float32))
    return pa.array(out, pa.list_(pa.float32()))


def student_topk(ids: np.ndarray, tlp: np.ndarray, al: pa.Table, t2s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A cross-tokenizer run's teacher top-k moved onto the student's positions: at each exact span of
    one token on each side (the same text before it, the same bytes in it), the teacher's candidates
    whose bytes are a single student token, as student ids (-1 elsewhere, log-prob NaN). ids, tlp
    [n_t, k] over the teacher's response tokens -> [n_s, k] over the student's (rows end to end)."""
    k = ids.shape[1]
    s_rows, t_rows = al.column("student_span").to_pylist(), al.column("teacher_span").to_pylist()
    n_s = sum(map(len, s_rows))
    out_ids, out_lp = np.full((n_s, k), -1, np.int32), np.full((n_s, k), np.nan, np.float32)
    at_s = at_t = 0
    for ss, ts, ex in zip(s_rows, t_rows, al.column("span_exact").to_pylist()):
        c_s, c_t = np.bincount(ss, minlength=len(ex)), np.bincount(ts, minlength=len(ex))
        one = np.flatnonzero(np.asarray(ex, dtype=bool) & (c_s == 1) & (c_t == 1))  # one-token spans
        ps = at_s + (np.cumsum(c_s) - c_s)[one]  # each such span's student position...
        pt = at_t + (np.cumsum(c_t) - c_t)[one]  # ...and teacher position
        cand = ids[pt]  # [m, k] teacher ids (a model's vocabulary may run past its tokenizer's)
        mapped = np.where(cand < len(t2s), t2s[np.minimum(cand, len(t2s) - 1)], -1)
        out_ids[ps], out_lp[ps] = mapped, np.where(mapped >= 0, tlp[pt], np.nan)
        at_s, at_t = at_s + len(ss), at_t + len(ts)
    return out_ids, out_lp


def run(sess: Session, k: int) -> Path:
    dig = sess.chain.score(k)
    cross = sess.cfg.objective.cross_tokenizer != "off"  # the teacher reads its own tokens of the text

    def produce(tmp: Path) -> None:
        cfg = sess.cfg
        ro = sess.table("rollout", sess.chain.rollout(k), "rollout.parquet", batch.ROLLOUT_NEEDS)
        if cross:
            # (the driver ran align(k) first: stages/align.py)
            al = sess.table("align", sess.chain.align(k), "spans.parquet", alignment.NEEDS)
            ro = teacher_rows(al)
        needs = objectives.needs(cfg.objective)
        kk = cfg.objective.topk if "topk" in needs else 0
        sess.models.activate("teacher")  # placement swap: the student waits in host memory
        teacher = sess.models.teacher()
        if cfg.teacher_mode == "privileged_context":  # the teacher's prompt carries the oracle block
            ro = tooluse.with_teacher_prompts(sess, ro)
        p = batch.packed(ro, sess.device)
        # [n] bool over packed positions (a cross-tokenizer run scores every teacher position)
        sel = np.ones(int(p.targets.numel()), dtype=bool) if cross else select_positions(sess, ro, seed_of(dig))
        ps = batch.subset(p, torch.as_tensor(sel, device=p.rows.device))
        state: dict = {"stage": "score", "step": k, "digest": dig, "selected_positions": int(sel.sum()),
                       "response_positions": int(sel.size)}
        def attempt(chunk: int):  # run again with a halved chunk after a CUDA OOM (placement.chunk_retry)
            h = lmhead.hidden(teacher, ps)  # [n_sel, H]: only selected positions reach the LM head
            return lmhead.score_positions(h, lmhead.head_weight(teacher), ps.targets, chunk,
                                          kk, logit_temperature(cfg.rollout), want_topk=kk > 0)

        with phase(sess.device, state, tokens=int(ps.targets.numel())), torch.no_grad():
            lp, ids, tlp, ent = placement.chunk_retry(sess, "score", k, state, attempt)
        lp, ids, tlp, ent = (t.numpy() for t in lmhead.to_host(lp, ids, tlp, ent))  # one sync for all four
        if not np.isfinite(lp).all() or (kk and not np.isfinite(tlp).all()):
            raise UserError(f"score step {k}: teacher {cfg.teacher.name!r} gives NaN/inf log-probs (its weights?); "
                            "nothing published")
        # back onto every response position; unselected ones were never scored: NaN (ids -1)
        lp, ent = _spread(lp, sel, np.nan), _spread(ent, sel, np.nan)
        ids, tlp = _spread(ids.astype(np.int32), sel, -1), _spread(tlp, sel, np.nan)
        # per-row lists over the flat per-position buffers: one offsets array, each values array made
        # once from its contiguous numpy buffer
        offs = pa.array(np.array(p.offsets + [len(lp)], dtype=np.int32))
        lst = lambda flat: pa.ListArray.from_arrays(offs, flat)  # noqa: E731
        cols = {"uid": ro.column("uid"), "teacher_logprobs": lst(pa.array(lp.astype(np.float32))),
                "teacher_entropy": lst(pa.array(ent.astype(np.float32))),
                "selected": lst(pa.array(sel.astype(np.int8)))}
        if kk and cross:  # over the student's positions, in student ids
            s_bytes, t_bytes, _ = sess.models.alignment_maps()
            ids, tlp = student_topk(ids, tlp, al, alignment.vocab_map(t_bytes, s_bytes))
            s_len = [len(x) for x in al.column("student_span").to_pylist()]
            offs_s = pa.array(np.r_[0, np.cumsum(s_len)].astype(np.int32))
            lst_k = lambda flat: pa.ListArray.from_arrays(offs_s, flat)  # noqa: E731
        else:
            lst_k = lst
        if kk:
            cols["topk_ids"] = lst_k(pa.FixedSizeListArray.from_arrays(pa.array(ids.reshape(-1)), kk))
            cols["topk_logprobs"] = lst_k(pa.FixedSizeListArray.from_arrays(pa.array(tlp.reshape(-1)), kk))
            mass = np.nansum(np.exp(tlp), -1) if cross else np.exp(tlp).sum(-1)  # (cross: unmapped entries NaN)
            cols["topk_mass"] = lst_k(pa.array(mass.astype(np.float32)))
        if cross:
            cols["span_logprobs"] = span_sums(lp, al)
        table = pa.Table.from_pydict(cols, tables.scores_schema(kk, spans=cross))
        return sess.hand_on("score", dig, "scores.parquet", table, {"topk": kk, "selection": cfg.selection.mode}, state)

    d, _ = sess.store.ensure("score", dig, produce, background=sess.background_publish)
    return d
