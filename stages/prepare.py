"""prepare: resolve both models into the store, fingerprint their tokenizers, build the prompt Parquet.

Models are materialised once as safetensors + tokenizer files (`store/model/<digest>/`): the
embedded GGUF is dequantised once; a pruned student is derived from the materialised full model
(seconds, not another GGUF load). Prompts are verl-schema rows from a shipped deterministic
generator or a user's verl Parquet, checked against `data.max_prompt_tokens` (never truncated).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa

from .run import identity, runview
from .weights import models
from .rows import alignment, prompts, tables, tooluse
from .errors import UserError
from .run.store import fault, file_hash, write_json
from .session import Session
from .rows.verl_rows import read_verl_parquet


def fingerprint(model_dir: Path) -> tuple[str, int]:
    """(tokenizer fingerprint, vocab size of the model)."""
    fp, vocab, _ = _tokenizer_of(model_dir)
    return fp, vocab


def _tokenizer_of(model_dir: Path):
    """(tokenizer fingerprint, vocab size of the model, the tokenizer or None): a model dir without
    tokenizer files has a synthetic fingerprint naming its vocab size."""
    from transformers import AutoTokenizer

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    if not (model_dir / "tokenizer_config.json").exists():
        return f"synthetic-vocab-{vocab}", vocab, None
    tok = AutoTokenizer.from_pretrained(model_dir)
    return models.tokenizer_fingerprint(tok), vocab, tok


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


# The teacher scores the student's token ids, so a pair must agree on what each id is (the id -> token
# mapping: vocabulary and added tokens) and on the end-of-text token; everything else a tokenizer holds
# turns text into ids or ids back into text, which only the student's tokenizer ever does (below).
# The student's tokenizer makes every id the teacher reads, so the teacher's bos, pad and unk never
# change a number (only noted); its eos does: evaluation stops the teacher's greedy answers at the
# student's eos, which must be the teacher's end of text too.
REFUSED_SPECIAL = ("eos",)
NOTED_SPECIAL = ("bos", "pad", "unk")
SETTINGS = ("model_max_length", "padding_side", "truncation_side", "clean_up_tokenization_spaces")
# tokenizer.json's sections besides the vocabulary: how text is split and merged into ids, and decoded
BACKEND = ("normalizer", "pre_tokenizer", "post_processor", "decoder", "merges", "added_tokens")
SHOWN = 3  # differing ids named in a refusal


def tokenizer_differences(student, teacher) -> tuple[str | None, list[str]]:
    """(what makes the pair unusable, or None; what else differs). Only the first changes a computed
    number: every prompt, response and SFT trace is tokenized, and every chat template applied, by the
    student's tokenizer alone (rows/prompts.py, rows/tooluse.py and Resident.tokenizer, the
    privileged_context teacher's prompt and the protocol_sft teacher's traces included), and the
    teacher reads those ids. So the teacher's chat template, settings and text-to-ids rules are never
    used; a teacher tuned on another template then reads prompts in the student's format, a matter of
    the teacher's quality that no check of ids can settle."""
    s, t = _id_to_token(student), _id_to_token(teacher)
    if s != t:
        bad = [i for i in sorted(s.keys() | t.keys()) if s.get(i) != t.get(i)]
        size = f"vocab sizes differ (student {len(s)}, teacher {len(t)}); " if len(s) != len(t) else ""
        shown = "; ".join(f"id {i}: student {s.get(i)!r}, teacher {t.get(i)!r}" for i in bad[:SHOWN])
        return f"{size}{len(bad)} id(s) map to different tokens ({shown}{'; ...' if len(bad) > SHOWN else ''})", []
    for name in REFUSED_SPECIAL:
        a, b = _special(student, name), _special(teacher, name)
        if a != b:
            return f"{name} token differs (student {a[0]!r}, id {a[1]}; teacher {b[0]!r}, id {b[1]})", []
    other = [f"{name} token" for name in NOTED_SPECIAL if _special(student, name) != _special(teacher, name)]
    other += ["chat_template"] if _template(student) != _template(teacher) else []
    other += [k for k in SETTINGS if getattr(student, k, None) != getattr(teacher, k, None)]
    if sorted(map(str, getattr(student, "all_special_tokens", []))) != \
            sorted(map(str, getattr(teacher, "all_special_tokens", []))):
        other.append("the list of special tokens")
    a, b = _backend(student), _backend(teacher)
    other += [k for k in BACKEND if a.get(k) != b.get(k)]
    return None, other


def _id_to_token(tok) -> dict[int, str]:
    return {i: s for s, i in tok.get_vocab().items()}


def _special(tok, name: str) -> tuple[str | None, int | None]:
    return getattr(tok, f"{name}_token", None), getattr(tok, f"{name}_token_id", None)


def _template(tok):
    return getattr(tok, "chat_template", None) or ""


def _backend(tok) -> dict:
    """tokenizer.json's sections without the vocabulary (compared above), for a fast tokenizer."""
    b = getattr(tok, "backend_tokenizer", None)
    if b is None:
        return {}
    j = json.loads(b.to_str())
    return {**{k: j.get(k) for k in BACKEND if k not in ("merges", "added_tokens")},
            "merges": (j.get("model") or {}).get("merges"),
            "added_tokens": sorted(json.dumps(a, sort_keys=True) for a in j.get("added_tokens") or [])}


def require_tokenizer_match(student, teacher, fp_student: str, fp_teacher: str, s_name: str, t_name: str) -> None:
    """Refuse a pair whose ids or special tokens differ, naming what differs (UserError); print one
    `note:` line when they differ only in what changes no computed number. `student`/`teacher`: the
    tokenizers (None: a model dir without one, identified by its synthetic fingerprint alone)."""
    if fp_student == fp_teacher:
        return
    where = f"student {s_name!r} and teacher {t_name!r}"
    if student is None or teacher is None:
        raise UserError(f"tokenizer mismatch: {where} must share one tokenizer "
                        f"({'student' if student is None else 'teacher'} has no tokenizer files)")
    bad, other = tokenizer_differences(student, teacher)
    if bad:
        raise UserError(f"tokenizer mismatch: {where} must share one tokenizer: {bad} "
                        f"(or align them: objective.cross_tokenizer=spans with a sampled-token objective)")
    if other:
        print(f"note: student and teacher tokenizers differ only in {', '.join(other)} (the student's tokenizer "
              f"and chat template format every prompt, the teacher's included); ids and special tokens agree",
              file=sys.stderr)


def check_teacher_source(sess: Session, student: str) -> None:
    """Before the teacher's weights are copied into the store: a teacher read from a directory (a local
    one, or the Hugging Face cache) whose tokenizer or vocabulary the student's refuses is refused
    here, so a refused pair leaves no multi-GB copy behind. `_build` checks the materialised pair
    again (and notes what differs). Nothing is loaded when the two sources' tokenizer files agree
    byte for byte (the chat template aside), nor when the teacher's tokenizer does not load: its
    materialisation then reports why."""
    cfg = sess.cfg
    if cfg.objective.cross_tokenizer != "off":  # the teacher keeps its own tokenizer (stages/align.py)
        return
    src = _source_dir(cfg.teacher)
    sdir = sess.store.path("model", student)
    has_tokenizer = lambda d: any((d / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))  # noqa: E731
    if src is None or not has_tokenizer(src) or not has_tokenizer(sdir):
        return
    try:
        vocab_t = json.loads((src / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError):
        return
    if _tokenizer_files(src) != _tokenizer_files(_source_dir(cfg.student) or sdir):
        from transformers import AutoTokenizer

        try:
            tok_t = AutoTokenizer.from_pretrained(src, trust_remote_code=cfg.teacher.trust_remote_code)
        except Exception:  # noqa: BLE001 - any loader error: materialising the model reports it, by name
            return
        bad, _ = tokenizer_differences(AutoTokenizer.from_pretrained(sdir), tok_t)
        if bad:
            raise UserError(f"tokenizer mismatch: student {cfg.student.name!r} and teacher {cfg.teacher.name!r} "
                            f"must share one tokenizer: {bad} (or align them: objective.cross_tokenizer=spans "
                            "with a sampled-token objective)")
    _require_vocab(json.loads((sdir / "config.json").read_text())["vocab_size"], vocab_t)


def _source_dir(mcfg) -> Path | None:
    """The directory a model is materialised from: a local dir or its Hugging Face cache snapshot
    (None: the embedded model, an architecture name, or not in the cache)."""
    if mcfg.name == "embedded" or mcfg.name.startswith("arch:"):
        return None
    p = Path(mcfg.name)
    if p.is_dir():
        return p if (p / "config.json").is_file() else None
    from huggingface_hub import snapshot_download

    try:
        p = Path(snapshot_download(mcfg.name, revision=mcfg.revision, local_files_only=True))
    except Exception:  # noqa: BLE001 - not in the cache: materialising says so, by name
        return None
    return p if (p / "config.json").is_file() else None


# a tokenizer's files, as compared before loading (the chat template never makes a pair unusable)
TOKENIZER_FILES = ("tokenizer.json", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                   "tokenizer.model")


def _tokenizer_files(d: Path) -> dict:
    out: dict = {n: file_hash(d / n) for n in TOKENIZER_FILES if (d / n).is_file()}
    try:
        out["tokenizer_config.json"] = {k: v for k, v in json.loads((d / "tokenizer_config.json").read_text()).items()
                                        if k != "chat_template"}
    except (OSError, ValueError):
        out["tokenizer_config.json"] = None
    return out


def _require_vocab(vocab_s: int, vocab_t: int) -> None:
    if vocab_s != vocab_t:
        raise UserError(f"vocab mismatch: student has {vocab_s} entries, teacher {vocab_t}")


def run(sess: Session) -> dict:
    cfg = sess.cfg
    fault("prepare.before")
    student = models.ensure(sess.store, cfg.student, "student")
    check_teacher_source(sess, student)  # a refused teacher is never copied into the store
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
    fp_s, vocab_s, tok = _tokenizer_of(sdir)
    fp_t, vocab_t, tok_t = _tokenizer_of(tdir)
    cross = cfg.objective.cross_tokenizer != "off"
    if cross and tok_t is None:
        raise UserError(f"objective.cross_tokenizer=spans: teacher {cfg.teacher.name!r} has no tokenizer files "
                        "(the teacher re-tokenizes the student's text with its own)")
    if cross:  # each side keeps its own tokenizer and vocabulary; the align stage checks the pair can align
        alignment.token_bytes(tok), alignment.token_bytes(tok_t)  # a decoder it cannot spell out: refused now
        print(f"note: cross-tokenizer run: student tokenizer {fp_s[:12]} ({len(tok)} ids), teacher tokenizer "
              f"{fp_t[:12]} ({len(tok_t)} ids); responses are aligned on byte spans", file=sys.stderr)
    else:
        require_tokenizer_match(tok, tok_t, fp_s, fp_t, cfg.student.name, cfg.teacher.name)
        _require_vocab(vocab_s, vocab_t)
    if cfg.objective.topk > vocab_s:
        raise UserError(f"key 'objective.topk' = {cfg.objective.topk}; larger than the vocabulary ({vocab_s})")
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
    if cross:  # (a key only then: other runs' prepare records unchanged)
        out["teacher_tokenizer"] = fp_t
    if cfg.env.name:  # tool-use task rows (verl schema): rollouts, SFT traces, held-out evaluation
        out.update(tooluse.prepare_tasks(sess, fp_s))
    return out


def main(sess: Session) -> dict:
    out = sess.prepared
    print(f"prepare: student model/{out['student'][:12]}  teacher model/{out['teacher'][:12]}  "
          f"prompts/{out['prompts'][:12]} ({out['num_train']} train, {out['num_eval']} eval)")
    return out
