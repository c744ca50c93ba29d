"""prepare: resolve both models into the store, fingerprint their tokenizers, build the prompt Parquet.

Models are materialised once as safetensors + tokenizer files (`store/model/<digest>/`): the
embedded GGUF is dequantised once; a pruned student is derived from the materialised full model
(seconds, not another GGUF load). Prompts are verl-schema rows from a shipped deterministic
generator or a user's verl Parquet, checked against `data.max_prompt_tokens` (never truncated).
"""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa

from .run import identity, runview
from .weights import models
from .rows import prompts, tables, tooluse
from .errors import UserError
from .run.store import fault, file_hash, write_json
from .session import Session
from .rows.verl_rows import read_verl_parquet


def fingerprint(model_dir: Path) -> tuple[str, int]:
    """(tokenizer fingerprint, vocab size of the model)."""
    from transformers import AutoTokenizer

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    if not (model_dir / "tokenizer_config.json").exists():
        return f"synthetic-vocab-{vocab}", vocab
    return models.tokenizer_fingerprint(AutoTokenizer.from_pretrained(model_dir)), vocab


def load_prompt_rows(sess: Session) -> tuple[pa.Table, pa.Table]:
    d = sess.cfg.data
    if d.path is None:
        train, evals = prompts.generate(d)
        return pa.Table.from_pylist(train, tables.PROMPTS), pa.Table.from_pylist(evals, tables.PROMPTS)
    t = read_verl_parquet(d.path, d.prompt_key)
    if d.eval_path is not None:  # verl's val_files: every row of that file is an evaluation row
        return t.slice(0, d.num_train), read_verl_parquet(d.eval_path, d.prompt_key).slice(0, d.num_eval)
    if "extra_info" in t.column_names and pa.types.is_struct(t.schema.field("extra_info").type) \
            and "split" in [f.name for f in t.schema.field("extra_info").type]:
        split = [(e or {}).get("split", "train") for e in t.column("extra_info").to_pylist()]
        tr = t.filter(pa.array([s != "test" for s in split]))
        ev = t.filter(pa.array([s == "test" for s in split]))
    else:  # no split column: hold out the last rows for evaluation
        n_ev = min(d.num_eval, max(1, t.num_rows // 5))
        tr, ev = t.slice(0, t.num_rows - n_ev), t.slice(t.num_rows - n_ev)
    return tr.slice(0, d.num_train), ev.slice(0, d.num_eval)


def check_prompts(t: pa.Table, key: str, tok, limit: int, source: str, truncation: str = "error") -> None:
    for i, msgs in enumerate(t.column(key).to_pylist()):
        if not msgs or not any((m.get("content") or "").strip() for m in msgs):
            raise UserError(f"{source}: row {i} has an empty prompt")
        if truncation == "error" and tok is not None and (n := len(prompts.encode_prompt(tok, msgs))) > limit:
            raise UserError(f"{source}: row {i} prompt is {n} tokens; data.max_prompt_tokens = {limit} "
                            "(raise the limit, shorten the prompt or choose data.truncation=left|right|middle)")


def require_tokenizer_match(fp_student: str, fp_teacher: str, s_name: str, t_name: str) -> None:
    if fp_student != fp_teacher:
        raise UserError(f"tokenizer mismatch: student {s_name!r} ({fp_student[:12]}) and teacher {t_name!r} "
                        f"({fp_teacher[:12]}) must share one tokenizer")


def run(sess: Session) -> dict:
    cfg = sess.cfg
    fault("prepare.before")
    student = models.ensure(sess.store, cfg.student, "student")
    teacher = models.ensure(sess.store, cfg.teacher, "teacher")
    check_context(sess, {"student": student, "teacher": teacher})
    # The checks and records below are a pure function of the models and the data settings, so they
    # are a stage too: a resumed run reads the record back instead of reloading both tokenizers.
    for key in ("data.path", "data.eval_path"):
        path = getattr(cfg.data, key.split(".")[1])
        if path is not None and not Path(path).is_file():
            raise UserError(f"{path}: Parquet file not found (key '{key}')")
    files = {"rows": file_hash(cfg.data.path) if cfg.data.path else file_hash(prompts.SEEDS)}
    if cfg.data.eval_path:
        files["eval_rows"] = file_hash(cfg.data.eval_path)
    rdig = identity.prepared(cfg, files, student, teacher)
    d, _ = sess.store.ensure("prepared", rdig, lambda tmp: write_json(tmp / "prepared.json",
                                                                     _build(sess, student, teacher)))
    out = json.loads((d / "prepared.json").read_text())
    if sess.store.get("prompts", out["prompts"]) is None:  # rollout/evaluate read it: content-check it here
        _build(sess, student, teacher)  # (missing or damaged: rebuilt, to the same digest and bytes)
    # before the view is touched: never half of another run
    runview.refuse_other_origin(sess, lambda: identity.Chain(cfg, sess.runtime_slice, out).policy(cfg.train.updates))
    write_json(sess.run_dir / "prepare.json", out)
    sess.prepared = out
    fault("prepare.after")
    return out


def check_context(sess: Session, digests: dict[str, str]) -> None:
    """A prompt plus the longest response must fit each model's positions (its config.json's
    max_position_embeddings), or rollout, score and evaluate would run past them."""
    cfg = sess.cfg
    prompt = cfg.data.max_prompt_tokens
    key, new = max(("rollout.max_new_tokens", cfg.rollout.max_new_tokens), ("eval.max_new_tokens",
                                                                         cfg.eval.max_new_tokens), key=lambda x: x[1])
    for role, dig in digests.items():
        ctx = json.loads((sess.store.path("model", dig) / "config.json").read_text()).get("max_position_embeddings")
        if isinstance(ctx, int) and prompt + new > ctx:
            raise UserError(f"key '{key}' = {new}: data.max_prompt_tokens ({prompt}) + {new} = {prompt + new} "
                            f"positions exceed the {role}'s context ({getattr(cfg, role).name!r}: "
                            f"max_position_embeddings {ctx})")


def _build(sess: Session, student: str, teacher: str) -> dict:
    cfg = sess.cfg
    sdir, tdir = sess.store.path("model", student), sess.store.path("model", teacher)
    fp_s, vocab_s = fingerprint(sdir)
    fp_t, vocab_t = fingerprint(tdir)
    require_tokenizer_match(fp_s, fp_t, cfg.student.name, cfg.teacher.name)
    if vocab_s != vocab_t:
        raise UserError(f"vocab mismatch: student has {vocab_s} entries, teacher {vocab_t}")
    if cfg.objective.topk > vocab_s:
        raise UserError(f"key 'objective.topk' = {cfg.objective.topk}; larger than the vocabulary ({vocab_s})")

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(sdir) if not fp_s.startswith("synthetic") else None
    if tok is None:
        raise UserError(f"model {cfg.student.name!r} has no tokenizer; the pipeline needs one for prompts")
    train, evals = load_prompt_rows(sess)
    src = cfg.data.path or f"generator {cfg.data.generator!r}"
    if train.num_rows == 0:
        raise UserError(f"{src}: empty prompt set (no training rows)")
    check_prompts(train, cfg.data.prompt_key, tok, cfg.data.max_prompt_tokens, src, cfg.data.truncation)
    check_prompts(evals, cfg.data.prompt_key, tok, cfg.data.max_prompt_tokens, src, cfg.data.truncation)
    files = {"rows": file_hash(cfg.data.path) if cfg.data.path else file_hash(prompts.SEEDS),
             **({"eval_rows": file_hash(cfg.data.eval_path)} if cfg.data.eval_path else {})}
    pdig = identity.prompts(cfg, fp_s, files)

    def produce(tmp: Path) -> None:
        meta = {"digest": pdig, "tokenizer": fp_s}
        tables.write(tmp / "train.parquet", train, meta)
        tables.write(tmp / "eval.parquet", evals, meta)

    sess.store.ensure("prompts", pdig, produce)
    out = {"student": student, "teacher": teacher, "prompts": pdig, "tokenizer": fp_s, "vocab": vocab_s,
           "num_train": train.num_rows, "num_eval": evals.num_rows}
    if cfg.env.name:  # tool-use task rows (verl schema): rollouts, SFT traces, held-out evaluation
        out.update(tooluse.prepare_tasks(sess, fp_s))
    return out


def main(sess: Session) -> dict:
    out = sess.prepared
    print(f"prepare: student model/{out['student'][:12]}  teacher model/{out['teacher'][:12]}  "
          f"prompts/{out['prompts'][:12]} ({out['num_train']} train, {out['num_eval']} eval)")
    return out
