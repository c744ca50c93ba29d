"""score(k): the frozen teacher reads prompt+response once and records, per response token, the
log-prob of the sampled token and (when the objective needs it) the top-k ids and log-probs.

One teacher forward per batch; the LM head and top-k run in position chunks.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from . import lmhead, objectives, tables
from .errors import UserError
from .session import Session, phase
from .store import write_json


def read_rollout(path: Path) -> pa.Table:
    return tables.read(path, {c: tables.ROLLOUT.field(c).type for c in
                              ("uid", "prompt_ids", "response_ids", "response_mask", "sample_logprobs")})


def packed(sess: Session, t: pa.Table) -> lmhead.Packed:
    return lmhead.pack(tables.lists(t, "prompt_ids", np.int64), tables.lists(t, "response_ids", np.int64),
                       tables.lists(t, "response_mask", np.int8), pad=0, device=sess.device)


def run(sess: Session, k: int) -> Path:
    dig = sess.score_digest(k)

    def produce(tmp: Path) -> None:
        cfg = sess.cfg
        ro = read_rollout(sess.store.path("rollout", sess.rollout_digest(k)) / "rollout.parquet")
        needs = objectives.needs(cfg.objective)
        kk = cfg.objective.topk if "topk" in needs else 0
        teacher = sess.teacher()
        p = packed(sess, ro)
        state: dict = {"stage": "score", "step": k, "digest": dig}
        with phase(sess.device, state, tokens=int(p.targets.numel())), torch.no_grad():
            h = lmhead.hidden(teacher, p)  # [n, H]
            lp, ids, tlp, ent = lmhead.score_positions(h, lmhead.head_weight(teacher), p.targets, cfg.train.chunk,
                                                       kk, cfg.rollout.temperature, want_topk=kk > 0)
        if not torch.isfinite(lp).all() or (kk and not torch.isfinite(tlp).all()):
            raise UserError(f"score step {k}: teacher log-probs contain NaN/inf; nothing published")
        lp, ent = lp.cpu().numpy(), ent.cpu().numpy()
        ids, tlp = ids.cpu().numpy().astype(np.int32), tlp.cpu().numpy()
        offs = np.array(p.offsets + [len(lp)], dtype=np.int32)
        lst = lambda flat: pa.ListArray.from_arrays(pa.array(offs), flat)  # noqa: E731  per-row lists
        cols = {"uid": ro.column("uid"), "teacher_logprobs": lst(pa.array(lp.astype(np.float32))),
                "teacher_entropy": lst(pa.array(ent.astype(np.float32)))}
        if kk:
            cols["topk_ids"] = lst(pa.FixedSizeListArray.from_arrays(pa.array(ids.reshape(-1)), kk))
            cols["topk_logprobs"] = lst(pa.FixedSizeListArray.from_arrays(pa.array(tlp.reshape(-1)), kk))
            cols["topk_mass"] = lst(pa.array(np.exp(tlp).sum(-1).astype(np.float32)))
        table = pa.Table.from_pydict(cols, tables.scores_schema(kk))
        write_json(tmp / "state.json", state)
        tables.write(tmp / "scores.parquet", table, {"digest": dig, "tokenizer": sess.prepared["tokenizer"],
                                                     "topk": kk})

    d, _ = sess.store.ensure("score", dig, produce)
    return d
