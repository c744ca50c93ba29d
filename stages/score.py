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
from .rows import tables, tooluse
from .run.config import logit_temperature
from .errors import UserError
from .run.store import seed_of
from .session import Session, phase


def select_positions(sess: Session, ro: pa.Table, seed: int) -> np.ndarray:
    """[n] bool over the packed response positions (row-major, as `packed`): which reach the LM head."""
    cfg = sess.cfg.selection
    spans = None
    if cfg.mode == "hybrid":
        tok = sess.tokenizer()
        spans = [selection.token_spans(tok, ids, cfg.keep_patterns) for ids in tables.lists(ro, "response_ids", np.int64)]
    sel = selection.select(cfg, tables.lists(ro, "response_mask", np.int8), seed, spans)
    return np.concatenate(sel).astype(bool) if sel else np.zeros(0, dtype=bool)


def _spread(values: np.ndarray, sel: np.ndarray, fill) -> np.ndarray:
    out = np.full((sel.size, *values.shape[1:]), fill, dtype=values.dtype)
    out[sel] = values
    return out


def run(sess: Session, k: int) -> Path:
    dig = sess.score_digest(k)

    def produce(tmp: Path) -> None:
        cfg = sess.cfg
        ro = sess.table("rollout", sess.rollout_digest(k), "rollout.parquet", batch.ROLLOUT_NEEDS)
        needs = objectives.needs(cfg.objective)
        kk = cfg.objective.topk if "topk" in needs else 0
        sess.activate("teacher")  # placement swap: the student waits in host memory
        teacher = sess.teacher()
        if cfg.teacher_mode == "privileged_context":  # the teacher's prompt carries the oracle block
            ro = tooluse.with_teacher_prompts(sess, ro)
        p = batch.packed(ro, sess.device)
        sel = select_positions(sess, ro, seed_of(dig))  # [n] bool over packed positions
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
        if kk:
            cols["topk_ids"] = lst(pa.FixedSizeListArray.from_arrays(pa.array(ids.reshape(-1)), kk))
            cols["topk_logprobs"] = lst(pa.FixedSizeListArray.from_arrays(pa.array(tlp.reshape(-1)), kk))
            cols["topk_mass"] = lst(pa.array(np.exp(tlp).sum(-1).astype(np.float32)))
        table = pa.Table.from_pydict(cols, tables.scores_schema(kk))
        return sess.hand_on("score", dig, "scores.parquet", table, {"topk": kk, "selection": cfg.selection.mode}, state)

    d, _ = sess.store.ensure("score", dig, produce, background=sess.background_publish)
    return d
