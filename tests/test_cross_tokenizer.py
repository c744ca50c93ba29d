"""Cross-tokenizer OPD end to end (objective.cross_tokenizer=spans; stages/align.py): a tiny random
student with the SmolLM2 tokenizer learns from a tiny random teacher with a byte-level BPE of its own
(tests/cross_tokenizers.py), through the real `opd run`. The published numbers are checked against
their definitions: each exact span spells the same bytes on both sides, its teacher log-prob is the
teacher's own sum over its tokens, the update counts the exact share; the refusals are one line with
exit code 2; a run killed mid-update resumes to the same bytes."""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from cross_tokenizers import bpe_tokenizer_dir
from support import TOKENIZER, opd
from transformers import AutoTokenizer

from stages.rows import alignment

STEPS = 2


def args(teacher_tok: Path, *extra: str) -> list[str]:
    return ["student.name=arch:tiny-llama", "student.init=random", "student.keep_layers=0",
            "teacher.name=arch:tiny-cross-teacher", "teacher.init=random", f"teacher.tokenizer={teacher_tok}",
            *[t for t in TOKENIZER if t.startswith("student.")], "data.num_train=8", "data.num_eval=4",
            "rollout.max_new_tokens=12", "eval.max_new_tokens=8", f"train.updates={STEPS}", "objective.name=k1",
            "objective.use_policy_gradient=true", "objective.cross_tokenizer=spans", *extra]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    return bpe_tokenizer_dir(tmp_path_factory.mktemp("bpe") / "tok")


@pytest.fixture(scope="module")
def ran(tmp_path_factory, bpe) -> Path:
    work = tmp_path_factory.mktemp("cross")
    opd("run", *args(bpe), cwd=work)
    return work


def store_files(work: Path) -> dict[str, str]:
    """sha256 of every file the loop's stages published (models and prompts aside; not state.json, which
    records timings, nor the manifest, which holds state.json's hash)."""
    root = work / "artifacts" / "store"
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
            for kind in ("init", "rollout", "align", "score", "update") for f in sorted((root / kind).rglob("*"))
            if f.is_file() and f.name not in ("state.json", "manifest.json")}


def test_every_exact_span_spells_the_same_bytes_and_its_teacher_logprob_is_the_teacher_s_sum(ran):
    run = ran / "artifacts" / "runs" / "default"
    cfg = json.loads((run / "config.json").read_text())
    dirs = {json.loads((d / "config.json").read_text())["vocab_size"]: d
            for d in (ran / "artifacts/store/model").iterdir() if (d / "tokenizer_config.json").exists()}
    s_tok, t_tok = AutoTokenizer.from_pretrained(dirs[49152]), AutoTokenizer.from_pretrained(dirs[640])
    s_bytes, t_bytes = alignment.token_bytes(s_tok), alignment.token_bytes(t_tok)
    assert cfg["objective"]["cross_tokenizer"] == "spans"
    for k in range(1, STEPS + 1):
        step = run / f"step-{k:04d}"
        ro = pq.read_table(step / "rollout.parquet").to_pylist()
        al = pq.read_table(step / "spans.parquet").to_pylist()
        sc = pq.read_table(step / "scores.parquet").to_pylist()
        assert [r["uid"] for r in ro] == [r["uid"] for r in al] == [r["uid"] for r in sc]
        exact_tokens = total = 0
        for r, a, s in zip(ro, al, sc):
            n = len(a["span_exact"])
            assert a["student_span"] and len(a["student_span"]) == len(r["response_ids"])
            assert len(s["teacher_logprobs"]) == len(a["teacher_response_ids"]) == len(a["teacher_span"])
            assert a["teacher_prompt_ids"] == t_tok.apply_chat_template(
                [{"role": "user", "content": _user(r["prompt_text"])}], add_generation_prompt=True, tokenize=True) \
                or a["teacher_prompt_ids"][-3:] == t_tok.encode("assistant\n", add_special_tokens=False)[-3:]
            for j in range(n):
                s_ids = [i for i, sp in zip(r["response_ids"], a["student_span"]) if sp == j]
                t_ids = [i for i, sp in zip(a["teacher_response_ids"], a["teacher_span"]) if sp == j]
                t_lp = [v for v, sp in zip(s["teacher_logprobs"], a["teacher_span"]) if sp == j]
                if a["span_exact"][j]:
                    assert b"".join(s_bytes[i] or b"" for i in s_ids) == b"".join(t_bytes[i] or b"" for i in t_ids) \
                        or (all(s_bytes[i] is None for i in s_ids) and len(t_ids) == 1)  # eos -> eos
                    want = np.float32(np.sum(np.asarray(t_lp, dtype=np.float64)))
                    assert s["span_logprobs"][j] == want  # the teacher's own sum over its tokens, float64 then float32
                    exact_tokens += len(s_ids)
                else:
                    assert math.isnan(s["span_logprobs"][j])
            total += len(r["response_ids"])
        st = json.loads((step / "state.json").read_text())
        assert st["align"]["exact_token_share"] == round(exact_tokens / total, 6) > 0.5
        assert st["policy"]["exact_token_share"] == st["align"]["exact_token_share"]
        assert math.isfinite(st["policy"]["loss"]) and st["policy"]["grad_norm"] > 0


def _user(prompt_text: str) -> str:
    """The user turn of a ChatML prompt the student's template wrote."""
    return prompt_text.split("<|im_start|>user\n")[-1].split("<|im_end|>")[0]


def test_the_evaluation_measures_on_aligned_spans(ran):
    ev = json.loads((ran / "artifacts/runs/default/eval.json").read_text())
    for who in ("initial", "final"):
        for view in ("on_teacher_text", "on_own_text"):
            m = ev[who][view]
            assert m["spans"] > 0 and m["student_tokens"] >= m["spans"] and math.isfinite(m["kl"])
            assert 0 <= m["top1_agreement"] <= 1
    assert ev["teacher"]["answers"]["mean_tokens"] > 0


def test_resume_after_sigkill_mid_update_is_byte_identical(ran, bpe, tmp_path):
    for point in ("align.after", "update.mid"):
        r = opd("run", *args(bpe), cwd=tmp_path, env={"OPD_FAULT": point}, check=False)
        assert r.returncode == -9, f"{point} not reached:\n{r.stderr[-2000:]}"
    opd("run", *args(bpe), cwd=tmp_path)
    got, want = store_files(tmp_path), store_files(ran)
    assert any(k.startswith("align/") for k in want) and got == want


def test_refusals_are_one_line_with_exit_code_2(bpe, tmp_path):
    same = [a for a in args(bpe) if not a.startswith("objective.")]
    r = opd("run", *same, cwd=tmp_path, check=False)
    assert r.returncode == 2 and "tokenizer mismatch" in r.stderr and "objective.cross_tokenizer=spans" in r.stderr
    assert len([ln for ln in r.stderr.splitlines() if ln.startswith("error")]) == 1
    r = opd("run", *args(bpe, "objective.name=exact_full_vocab", "objective.use_policy_gradient=false"), cwd=tmp_path,
            check=False)
    assert r.returncode == 2 and "objective.cross_tokenizer" in r.stderr and "exact_full_vocab" in r.stderr


def test_the_verl_bundle_refuses_a_cross_tokenizer_run(ran, bpe, tmp_path):
    """The bundle is written for inspection, marked not launchable with the reason (verl's own rule)."""
    r = opd("stage", "export", "--verl", str(tmp_path / "bundle"), *args(bpe, "train.updates=4"), cwd=ran)
    assert "NOT launchable" in r.stdout and "objective.cross_tokenizer = 'spans'" in r.stdout
    compat = json.loads((tmp_path / "bundle" / "compat.json").read_text())
    assert not compat["launchable"] and any(d["key"] == "objective.cross_tokenizer" and d["blocking"]
                                            for d in compat["deviations"])


def test_the_teacher_top_k_moves_to_one_token_spans_in_student_ids():
    """score.student_topk: only exact spans of one token on each side carry candidates, mapped through
    the byte map (-1 where the student has no such token); other positions stay empty."""
    import pyarrow as pa

    from stages.score import student_topk

    al = pa.table({"student_span": [[0, 1, 1, 2], [0]], "teacher_span": [[0, 1, 2, 2], [0]],
                   "span_exact": [[1, 1, 0], [1]]}).append_column("uid", pa.array(["a", "b"]))
    # row a: span 0 one token each side (exact); span 1 two student tokens, one teacher token; span 2
    # one student token against two teacher tokens, not exact; row b: one exact one-token span
    ids = np.array([[3, 4], [5, 6], [7, 8], [9, 3], [4, 5]])  # [n_t = 5, k = 2]
    tlp = np.log(np.array([[.5, .2], [.4, .3], [.6, .1], [.5, .5], [.7, .2]])).astype(np.float32)
    t2s = np.array([-1, -1, -1, 30, -1, 50, 60, 70, 80, 90], dtype=np.int32)  # teacher id -> student id
    got_ids, got_lp = student_topk(ids, tlp, al, t2s)
    assert got_ids.tolist() == [[30, -1], [-1, -1], [-1, -1], [-1, -1], [-1, 50]]
    assert got_lp[0, 0] == tlp[0, 0] and np.isnan(got_lp[0, 1]) and got_lp[4, 1] == tlp[4, 1]
    assert np.isnan(got_lp[1:4]).all()
