"""evaluate: on held-out prompts, mean per-token KL(teacher || student) over the full vocabulary and
top-1 agreement, for the initial (policy 0) and the final student.

Two views, both greedy and deterministic: on the teacher's own responses (the same tokens for
both students: the cleanest before/after comparison) and on each student's own responses (what
on-policy distillation optimises). Writes eval.json + samples.parquet in the store and
metrics.json in the run view (DVC metrics).
"""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import torch

from . import lmhead, runview, sampler, tables
from .prompts import prompt_ids
from .session import Session, phase
from .store import write_json


def greedy(sess: Session, model, engine, prompts: list[list[int]]) -> list[list[int]]:
    tok = sess.tokenizer()
    kw = dict(eos=tok.eos_token_id, pad=tok.pad_token_id or tok.eos_token_id, seed=0, greedy=True)
    out = engine.generate(prompts, sess.cfg.eval.max_new_tokens, **kw) if engine else \
        sampler.hf_generate(model, prompts, sess.cfg.eval.max_new_tokens, **kw)
    return [out.tokens[b, :int(out.lengths[b])].tolist() for b in range(len(prompts))]


def measure(sess: Session, student, prompts, responses) -> dict:
    p = lmhead.pack(prompts, responses, [[1] * len(r) for r in responses], pad=0, device=sess.device)
    with torch.no_grad():
        h_t = lmhead.hidden(sess.teacher(), p)
        h_s = lmhead.hidden(student, p)
        kl, agree = lmhead.kl_positions(h_t, lmhead.head_weight(sess.teacher()), h_s, lmhead.head_weight(student),
                                        sess.cfg.eval.chunk)
    return {"kl": round(float(kl.mean()), 6), "top1_agreement": round(float(agree.mean()), 6),
            "tokens": int(kl.numel())}


def run(sess: Session) -> dict:
    cfg, K = sess.cfg, sess.cfg.train.updates
    dig = sess.chain.evaluate()
    runview.check_same_run(sess, "evaluating it")  # metrics.json describes the view's run, no other

    def produce(tmp: Path) -> None:
        tok = sess.tokenizer()
        ev = tables.read(sess.store.path("prompts", sess.prepared["prompts"]) / "eval.parquet")
        prompts = [prompt_ids(tok, m, cfg.data) for m in ev.column(cfg.data.prompt_key).to_pylist()]
        state: dict = {"stage": "evaluate", "digest": dig}
        with phase(sess.device, state) as ph:
            teacher_resp = greedy(sess, sess.teacher(), sampler.make(sess.teacher(), cfg.rollout.cuda_graphs),
                                  prompts)
            result, rows = {}, []
            for name, k in (("initial", 0), ("final", K)):
                student = sess.use_policy(k)
                own = greedy(sess, student, sess.engine(), prompts)
                result[name] = {"on_teacher_text": measure(sess, student, prompts, teacher_resp),
                                "on_own_text": measure(sess, student, prompts, own)}
                rows += [{"policy": name, "prompt": tok.decode(p), "response": tok.decode(r)}
                         for p, r in zip(prompts, own)]
            ph["tokens"] = sum(map(len, teacher_resp))
        rows += [{"policy": "teacher", "prompt": tok.decode(p), "response": tok.decode(r)}
                 for p, r in zip(prompts, teacher_resp)]
        for view in ("on_teacher_text", "on_own_text"):
            a, b = result["initial"][view]["kl"], result["final"][view]["kl"]
            result[f"kl_reduction_{view}"] = round((a - b) / a, 6) if a > 0 else 0.0
        write_json(tmp / "eval.json", result)
        tables.write(tmp / "samples.parquet", pa.Table.from_pylist(rows), {"digest": dig})
        write_json(tmp / "state.json", state)

    d, _ = sess.store.ensure("evaluate", dig, produce)
    result = json.loads((d / "eval.json").read_text())
    write_json(sess.run_dir / "metrics.json", {"eval": result, "updates": K})
    return result


def main(sess: Session) -> dict:
    reused = (sess.store.path("evaluate", sess.chain.evaluate()) / "manifest.json").is_file()
    r = run(sess)
    t = r["initial"]["on_teacher_text"]["kl"], r["final"]["on_teacher_text"]["kl"]
    o = r["initial"]["on_own_text"]["kl"], r["final"]["on_own_text"]["kl"]
    print(f"evaluate: held-out KL(teacher||student) on teacher text {t[0]:.4f} -> {t[1]:.4f}; "
          f"on own text {o[0]:.4f} -> {o[1]:.4f}"
          + (" (published by an earlier run: reused)" if reused else ""))
    return r
