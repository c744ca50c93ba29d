"""align(k): in a cross-tokenizer run (objective.cross_tokenizer=spans), the student's responses of
rollout(k) in the teacher's tokens, aligned with the student's on byte spans.

The teacher cannot read the student's token ids, but both tokenizers spell the same bytes: each
response is decoded to its bytes, re-tokenized by the teacher's tokenizer, and cut into the shortest
spans whose ends are token boundaries on both sides (stages/rows/alignment.py). On such a span both
models score the same text, so log p(span) is a sum over each side's own tokens and the two compare
exactly. The teacher's prompt is the same chat messages under the teacher's own chat template.
spans.parquet holds one row per trajectory (uid, the teacher's prompt and response ids, each
token's span index on both sides, which spans are exact, and each span's text) for people to open.
Host work on any device: the stage's bytes depend on the two tokenizers and the rollout only, so its
digest holds no runtime slice.
"""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import torch

from .rows import alignment, prompts
from .session import Session, phase

NEEDS = {"uid": pa.string(), "prompt_index": pa.int32(), "response_ids": pa.list_(pa.int32())}


def run(sess: Session, k: int) -> Path:
    dig = sess.chain.align(k)

    def produce(tmp: Path) -> None:
        cfg = sess.cfg
        ro = sess.table("rollout", sess.chain.rollout(k), "rollout.parquet", NEEDS)
        rows_in = sess.table("prompts", sess.prepared["prompts"], "train.parquet")
        t_tok = sess.models.teacher_tokenizer()
        s_bytes, t_bytes, smap = sess.models.alignment_maps()
        messages = rows_in.take(ro.column("prompt_index")).column(cfg.data.prompt_key).to_pylist()
        t_prompts = [prompts.prompt_ids(t_tok, m, cfg.data) for m in messages]
        state: dict = {"stage": "align", "step": k, "digest": dig}
        with phase(torch.device("cpu"), state) as ph:  # (host work on any device)
            rows = [alignment.align_row(ids, s_bytes, t_tok, t_bytes, smap)
                    for ids in ro.column("response_ids").to_pylist()]
            ph["tokens"] = s_n = sum(len(r.student_span) for r in rows)
        table = alignment.table(ro.column("uid").to_pylist(), rows, t_prompts)
        spans = sum(len(r.span_exact) for r in rows)
        exact_tokens = sum(sum(r.span_exact[j] for j in r.student_span) for r in rows)
        state.update(student_tokens=s_n, teacher_tokens=sum(len(r.teacher_ids) for r in rows), spans=spans,
                     # the share of student tokens in spans both sides spell alike: the exact part of the loss
                     exact_token_share=round(exact_tokens / max(s_n, 1), 6),
                     student_tokens_per_span=round(s_n / max(spans, 1), 4))
        meta = {"teacher_tokenizer": sess.prepared.get("teacher_tokenizer")}
        return sess.hand_on("align", dig, "spans.parquet", table, meta, state)

    d, _ = sess.store.ensure("align", dig, produce, background=sess.background_publish)
    return d

