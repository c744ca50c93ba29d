"""evaluate: on held-out prompts, mean per-token KL(teacher || student) over the full vocabulary and
top-1 agreement, for the initial (policy 0) and the final student.

A metric can improve while the answers are degenerate (a student that learned to print newlines
"lowers KL" on its own text, because the teacher then predicts newlines too), so every greedy
answer set also reports what a reader would see: the share of answers holding any non-whitespace
character, the share of distinct bigrams among all answer bigrams, and the first held-out prompts
with teacher / initial / final answers side by side.

Two views, both greedy and deterministic: on the teacher's own responses (the same tokens for
both students: the cleanest before/after comparison) and on each student's own responses (what
on-policy distillation optimises). Writes eval.json + samples.parquet in the store, and in the run
view eval.json (that record, less the answer text), metrics.json (a few headline numbers under short
flat keys: DVC metrics, one narrow `dvc exp show` column each; stages/run/runview.py `headline`) and
answers.json (the side-by-side answers, text kept out of the metrics table). A trained student further
from the teacher than policy 0 on held-out text is one `warning:` line, and `worse` in metrics.json.

Agreement measures imitation, not correctness: held-out rows with a ground truth also score each of
the three greedy answers with the row's checker (stages/rows/checkers.py) into task accuracy per
role (`task`: correct, n, accuracy, Wilson 95% interval, checker), and list the prompts that flipped
between the initial and the final student (`flips`: gained, lost). The answers are the ones already
generated for every held-out prompt, so scoring adds no generation.

eval.every = k > 0 also measures policies k, 2k, ... on the teacher's answers (`policies`: KL and
agreement, teacher-forced, no generation); `export.policy=best` exports the one with the lowest KL.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from .engine import lmhead, sampler
from .engine.sampling import Sampling
from .run import runview
from .rows import alignment, checkers, rewards, tables
from .rows.prompts import prompt_ids
from .run.store import write_json
from .session import Session, phase


def greedy(sess: Session, model, engine, prompts: list[list[int]], tok=None) -> list[list[int]]:
    tok = tok or sess.models.tokenizer()  # (a cross-tokenizer teacher answers in its own tokens)
    kw = dict(eos=tok.eos_token_id, pad=tok.pad_token_id or tok.eos_token_id, seed=0, sampling=Sampling(greedy=True))
    out = engine.generate(prompts, sess.cfg.eval.max_new_tokens, **kw) if engine else \
        sampler.hf_generate(model, prompts, sess.cfg.eval.max_new_tokens, **kw)
    return [out.tokens[b, :int(out.lengths[b])].tolist() for b in range(len(prompts))]


def teacher_states(sess: Session, prompts, responses) -> tuple[lmhead.Packed, torch.Tensor]:
    """The rows packed, and the teacher's hidden states over them: one forward per set of answers,
    shared by every policy `measure` reads them for (the teacher's answers: two, or eval.every's)."""
    p = lmhead.pack(prompts, responses, [[1] * len(r) for r in responses], pad=0, device=sess.device)
    with torch.no_grad():
        return p, lmhead.hidden(sess.models.teacher(), p)


def measure(sess: Session, student, p: lmhead.Packed, h_t: torch.Tensor) -> dict:
    """Mean KL(teacher||student) and top-1 agreement over the response positions of `p` (teacher_states)."""
    with torch.no_grad():
        h_s = lmhead.hidden(student, p)
        kl, agree = lmhead.kl_positions(h_t, lmhead.head_weight(sess.models.teacher()), h_s, lmhead.head_weight(student),
                                        sess.cfg.eval.chunk)
    return {"kl": round(float(kl.mean()), 6), "top1_agreement": round(float(agree.mean()), 6),
            "tokens": int(kl.numel())}


def _own_scores(model, prompts, responses, chunk: int, device) -> tuple[np.ndarray, np.ndarray]:
    """(log-prob of each response token, the model's top-1 id at that position), rows end to end."""
    p = lmhead.pack(prompts, responses, [[1] * len(r) for r in responses], pad=0, device=device)
    with torch.no_grad():
        lp, ids, _, _ = lmhead.score_positions(lmhead.hidden(model, p), lmhead.head_weight(model), p.targets, chunk, 1)
    return lp.double().cpu().numpy(), ids[:, 0].cpu().numpy()


def _spelled(token_bytes: list, i) -> bytes | None:
    """A predicted id's bytes; None for a special token or an id past the tokenizer (a model's
    embedding may be larger than its vocabulary): such a prediction agrees with nothing."""
    i = int(i)
    return token_bytes[i] if i < len(token_bytes) else None


def measure_spans(sess: Session, student, s_prompts, t_prompts, responses, by: str) -> dict:
    """A cross-tokenizer run's held-out numbers (stages/align.py): `responses` (the teacher's tokens if
    `by` is "teacher", else the student's) re-tokenized by the other side and aligned on byte spans.
    kl: the log-ratio of the text's author over the other model, summed over exact spans, per student
    token (teacher text: log p_T - log p_S, a one-sample estimate of KL(teacher||student); own text:
    log p_S - log p_T, of KL(student||teacher), what on-policy distillation lowers). top1_agreement:
    over the spans that are one token on each side, the share where both models' most likely tokens
    spell the same bytes; `tokens` counts those spans (the agreement's sample size)."""
    s_bytes, t_bytes, smap = sess.models.alignment_maps()
    s_tok, t_tok = sess.models.tokenizer(), sess.models.teacher_tokenizer()
    if by == "teacher":
        tmap = alignment.special_map(t_tok, s_tok)
        rows = [alignment.align_row(r, t_bytes, s_tok, s_bytes, tmap) for r in responses]
        t_resp, s_resp = responses, [r.teacher_ids for r in rows]
        t_span, s_span = [r.student_span for r in rows], [r.teacher_span for r in rows]
    else:
        rows = [alignment.align_row(r, s_bytes, t_tok, t_bytes, smap) for r in responses]
        s_resp, t_resp = responses, [r.teacher_ids for r in rows]
        s_span, t_span = [r.student_span for r in rows], [r.teacher_span for r in rows]
    chunk = sess.cfg.eval.chunk
    lp_s, top_s = _own_scores(student, s_prompts, s_resp, chunk, sess.device)
    lp_t, top_t = _own_scores(sess.models.teacher(), t_prompts, t_resp, chunk, sess.device)
    gap = n_tok = agree = pairs = spans = 0
    a_s = a_t = 0
    for row, ss, ts in zip(rows, s_span, t_span):
        S = len(row.span_exact)
        sums_s, sums_t = np.zeros(S), np.zeros(S)
        np.add.at(sums_s, np.asarray(ss, dtype=np.int64), lp_s[a_s:a_s + len(ss)])
        np.add.at(sums_t, np.asarray(ts, dtype=np.int64), lp_t[a_t:a_t + len(ts)])
        exact = np.asarray(row.span_exact, dtype=bool)
        n_s, n_t = np.bincount(ss, minlength=S), np.bincount(ts, minlength=S)
        diff = (sums_t - sums_s) if by == "teacher" else (sums_s - sums_t)
        gap += diff[exact].sum()
        n_tok += int(n_s[exact].sum())
        spans += int(exact.sum())
        pos_s, pos_t = np.cumsum(n_s) - 1, np.cumsum(n_t) - 1  # each span's last position, per side
        for j in np.flatnonzero(exact & (n_s == 1) & (n_t == 1)):
            pairs += 1
            a, b = _spelled(s_bytes, top_s[a_s + pos_s[j]]), _spelled(t_bytes, top_t[a_t + pos_t[j]])
            agree += a is not None and a == b
        a_s, a_t = a_s + len(ss), a_t + len(ts)
    return {"kl": round(float(gap / max(n_tok, 1)), 6), "top1_agreement": round(agree / max(pairs, 1), 6),
            "tokens": pairs, "student_tokens": n_tok, "spans": spans,
            "kl_estimate": "exact spans, log-ratio of the text's author over the other model, per student token"}


SIDE_BY_SIDE = 4  # held-out prompts shown with all three answers in answers.json and the report
ROLES = ("teacher", "initial", "final")
# samples.parquet: every greedy answer, with the checker's credit and name where its row has a ground truth
SAMPLES = pa.schema([("policy", pa.string()), ("prompt", pa.string()), ("response", pa.string()),
                     ("score", pa.float64()), ("checker", pa.string())])


def answers(tok, responses: list[list[int]]) -> dict:
    """What the greedy answers look like: `nonblank` = share holding a non-whitespace character,
    `distinct_bigrams` = distinct token bigrams / all token bigrams (1.0 = no bigram repeats; a
    run of newlines gives almost 0), mean length in tokens."""
    text = [tok.decode(r, skip_special_tokens=True) for r in responses]
    bigrams = [tuple(r[i:i + 2]) for r in responses for i in range(len(r) - 1)]
    return {"nonblank": round(sum(bool(t.strip()) for t in text) / max(len(text), 1), 6),
            "distinct_bigrams": round(len(set(bigrams)) / len(bigrams), 6) if bigrams else 0.0,
            "mean_tokens": round(sum(map(len, responses)) / max(len(responses), 1), 3)}


def task(rows: list[dict], text: dict[str, list[str]], prompt_key: str = "prompt") -> tuple[dict, dict | None]:
    """Each role's decoded greedy answers (`text[role][i]` answers rows[i], a held-out row) scored by
    the row's checker: ({role: [Score, or None where the row has no ground truth]}, the record), the
    record None when no row has a ground truth, else {"accuracy": {role: checkers.accuracy},
    "flips": {"gained": [...], "lost": [...]}}: gained = wrong before (initial) and right after
    (final), lost = the reverse, each with the prompt, the truth, both answers and the checker."""
    scores = {who: [checkers.score(t, r) for t, r in zip(text[who], rows)] for who in ROLES}
    kept = [i for i, s in enumerate(scores["teacher"]) if s is not None]  # (None iff the row has no truth)
    if not kept:
        return scores, None
    flips: dict = {"gained": [], "lost": []}
    for i in kept:
        before, after = scores["initial"][i], scores["final"][i]
        if before.correct != after.correct:
            flips["gained" if after.correct else "lost"].append({
                "prompt": _user_text(rows[i][prompt_key]), "truth": rewards.ground_truth(rows[i]),
                "initial": text["initial"][i], "final": text["final"][i], "checker": after.checker})
    return scores, {"accuracy": {who: checkers.accuracy([scores[who][i] for i in kept]) for who in ROLES},
                    "flips": flips}


def trajectory(sess: Session, result: dict, prompts, t_prompts, teacher_resp, on_teacher) -> list[dict]:
    """Every eval.every-th policy's KL and agreement on the teacher's held-out answers, beside the
    initial and the final ones already measured: [{"policy": k, "kl", "top1_agreement", "tokens"}].
    on_teacher: teacher_states of the teacher's answers (None for a cross-tokenizer run)."""
    K, out = sess.cfg.train.updates, []
    for k in sess.cfg.eval.policies(K):
        if k in (0, K):
            m = result["initial" if k == 0 else "final"]["on_teacher_text"]
        elif sess.cfg.objective.cross_tokenizer != "off":
            m = measure_spans(sess, sess.models.use_policy(k), prompts, t_prompts, teacher_resp, "teacher")
        else:
            m = measure(sess, sess.models.use_policy(k), *on_teacher)
        out.append({"policy": k, "kl": m["kl"], "top1_agreement": m["top1_agreement"], "tokens": m["tokens"]})
    return out


def run(sess: Session) -> dict:
    cfg, K = sess.cfg, sess.cfg.train.updates
    dig = sess.chain.evaluate()
    runview.check_same_run(sess, "evaluating it")  # the view's evaluation files describe its run, no other

    def produce(tmp: Path) -> None:
        tok = sess.models.tokenizer()
        ev = tables.read(sess.store.path("prompts", sess.prepared["prompts"]) / "eval.parquet")
        msgs = ev.column(cfg.data.prompt_key).to_pylist()
        prompts = [prompt_ids(tok, m, cfg.data) for m in msgs]
        cross = cfg.objective.cross_tokenizer != "off"  # the teacher reads and writes its own tokens
        t_tok = sess.models.teacher_tokenizer() if cross else tok
        t_prompts = [prompt_ids(t_tok, m, cfg.data) for m in msgs] if cross else prompts
        held = ev.to_pylist()
        checkers.require(held)  # a checker that cannot run fails before the answers are generated
        state: dict = {"stage": "evaluate", "digest": dig}
        with phase(sess.device, state) as ph:
            engine = sampler.make(sess.models.teacher(), cfg.rollout.cuda_graphs, sess.models.compiled_decode, sess.store.flush)
            teacher_resp = greedy(sess, sess.models.teacher(), engine, t_prompts, t_tok)
            result, said = {"teacher": {"answers": answers(t_tok, teacher_resp)}}, {"teacher": teacher_resp}
            on_teacher = None if cross else teacher_states(sess, prompts, teacher_resp)
            for name, k in (("initial", 0), ("final", K)):
                student = sess.models.use_policy(k)
                own = said[name] = greedy(sess, student, sess.models.engine(), prompts)
                if cross:
                    result[name] = {"on_teacher_text": measure_spans(sess, student, prompts, t_prompts, teacher_resp,
                                                                     "teacher"),
                                    "on_own_text": measure_spans(sess, student, prompts, t_prompts, own, "student")}
                else:
                    result[name] = {"on_teacher_text": measure(sess, student, *on_teacher),
                                    "on_own_text": measure(sess, student, *teacher_states(sess, prompts, own))}
                result[name]["answers"] = answers(tok, own)
            if cfg.eval.every:
                result["policies"] = trajectory(sess, result, prompts, t_prompts, teacher_resp, on_teacher)
            ph["tokens"] = sum(map(len, teacher_resp))
        decoder = {"teacher": t_tok, "initial": tok, "final": tok}
        text = {who: [decoder[who].decode(r, skip_special_tokens=True) for r in said[who]] for who in ROLES}
        scores, record = task(held, text, cfg.data.prompt_key)
        if record is not None:  # (a record without task keys where no held-out row has a ground truth)
            for who in ROLES:
                result[who]["task"] = record["accuracy"][who]
            result["flips"] = record["flips"]
        asked = {"teacher": t_prompts, "initial": prompts, "final": prompts}
        rows = [{"policy": who, "prompt": decoder[who].decode(p), "response": decoder[who].decode(r),
                 "score": s.value if s else None, "checker": s.checker if s else None}
                for who in ("initial", "final", "teacher") for p, r, s in zip(asked[who], said[who], scores[who])]
        result["side_by_side"] = [
            {"prompt": _user_text(ev.column(cfg.data.prompt_key)[i].as_py()), **{who: text[who][i] for who in ROLES}}
            for i in range(min(SIDE_BY_SIDE, len(prompts)))]
        for view in ("on_teacher_text", "on_own_text"):
            a, b = result["initial"][view]["kl"], result["final"][view]["kl"]
            result[f"kl_reduction_{view}"] = round((a - b) / a, 6) if a > 0 else 0.0
        write_json(tmp / "eval.json", result)
        tables.write(tmp / "samples.parquet", pa.Table.from_pylist(rows, SAMPLES), {"digest": dig})
        write_json(tmp / "state.json", state)

    d, _ = sess.store.ensure("evaluate", dig, produce)
    result = json.loads((d / "eval.json").read_text())
    # the run view's copies: the whole record (the store's eval.json is not edited), the headline numbers
    # DVC compares, the answers (the side-by-side ones and the flipped prompts: text, kept out of eval.json)
    prose = ("side_by_side", "flips")
    write_json(sess.run_dir / "eval.json", {"updates": K, **{k: v for k, v in result.items() if k not in prose}})
    write_json(sess.run_dir / "metrics.json", runview.headline(result, K))
    write_json(sess.run_dir / "answers.json", {"updates": K, **{k: result[k] for k in prose if k in result}})
    return result


def _user_text(messages) -> str:
    """The last user turn of a chat prompt (what a reader asked), or the prompt itself if a string."""
    if isinstance(messages, str):
        return messages
    return next((m["content"] for m in reversed(messages) if m.get("role") == "user"), str(messages))


def main(sess: Session) -> dict:
    reused = (sess.store.path("evaluate", sess.chain.evaluate()) / "manifest.json").is_file()
    r = run(sess)
    t = r["initial"]["on_teacher_text"]["kl"], r["final"]["on_teacher_text"]["kl"]
    o = r["initial"]["on_own_text"]["kl"], r["final"]["on_own_text"]["kl"]
    a = r["initial"]["on_teacher_text"]["top1_agreement"], r["final"]["on_teacher_text"]["top1_agreement"]
    what = "span log-ratio (cross-tokenizer)" if "spans" in r["final"]["on_teacher_text"] else "KL(teacher||student)"
    print(f"evaluate: held-out {what} on teacher text {t[0]:.4f} -> {t[1]:.4f}; "
          f"on own text {o[0]:.4f} -> {o[1]:.4f}; top-1 agreement on teacher text {a[0]:.3f} -> {a[1]:.3f}; "
          f"non-blank answers {r['final']['answers']['nonblank']:.0%}" + _accuracy_note(r)
          + (" (published by an earlier run: reused)" if reused else ""))
    if "policies" in r:
        best = runview.best_policy(r, sess.cfg.train.updates)["policy"]
        print("evaluate: held-out KL on teacher text by policy: "
              + ", ".join(f"{p['policy']}: {p['kl']:.4f}" for p in r["policies"]) + f"; the lowest at policy {best}")
    warning = runview.worse_warning(runview.headline(r, sess.cfg.train.updates))
    if warning:
        print(warning, file=sys.stderr)
    return r


def _accuracy_note(r: dict) -> str:
    """The summary line's task accuracy, where the record has one."""
    if "task" not in r["final"]:
        return ""
    t = {who: r[who]["task"] for who in ROLES}
    return (f"; task accuracy ({t['final']['checker']}, n={t['final']['n']}) {t['initial']['accuracy']:.3f} -> "
            f"{t['final']['accuracy']:.3f} (teacher {t['teacher']['accuracy']:.3f})")
