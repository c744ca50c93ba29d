"""The real `opd` command on tiny random Llamas with the real SmolLM2 tokenizer: outputs, cross-run
reuse, and the run view. (Resume after SIGKILL at 31 points, byte-identical: tests/reliability.)"""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from support import TINY, opd, session


def store_dirs(root: Path) -> set[str]:
    return {f"{p.parent.name}/{p.name}" for p in (root / "artifacts" / "store").glob("*/*") if not p.name.startswith(".")}


def test_run_produces_a_complete_run_view(work):
    r = opd("run", *TINY, cwd=work)
    assert "evaluate:" in r.stdout
    run = work / "artifacts" / "runs" / "default"
    ro = pq.read_table(run / "step-0002" / "rollout.parquet")
    sc = pq.read_table(run / "step-0002" / "scores.parquet")
    assert ro.num_rows == 4 and sc.column("uid").to_pylist() == ro.column("uid").to_pylist()
    assert ro.column_names[:4] == ["uid", "step", "policy_version", "prompt_index"]
    assert set(ro.column("policy_version").to_pylist()) == {1} and set(ro.column("step").to_pylist()) == {2}
    for ids, mask, lps, tl, top in zip(*(ro.column(c).to_pylist() for c in ("response_ids", "response_mask",
                                                                              "sample_logprobs")),
                                       sc.column("teacher_logprobs").to_pylist(), sc.column("topk_ids").to_pylist()):
        assert 1 <= len(ids) <= 8 and len(mask) == len(ids) == len(lps) == len(tl) == len(top)
        assert all(x <= 0 for x in lps) and all(np.isfinite(tl)) and all(len(t) == 8 for t in top)
    md = pq.read_schema(run / "step-0002" / "rollout.parquet").metadata
    assert md[b"opd.schema_version"] == b"1" and len(md[b"opd.digest"]) == 32
    hist = list(csv.DictReader(open(run / "history.csv")))
    assert [int(h["step"]) for h in hist] == [1, 2, 3] and all(float(h["loss"]) > 0 for h in hist)
    # where the construction before the first update went: first times, in the loop's order
    timings = json.loads((run / "train.json").read_text())["timings"]
    up = timings["startup_s"]
    order = ["prepared", "student_base_loaded", "lora_built", "student_loaded", "policy0_published", "engine_built",
             "rollout_done", "score_done", "update_done"]
    assert [up[e] for e in order] == sorted(up[e] for e in order) and up["prepared"] >= 0, up
    assert up["rollout_done"] <= up["teacher_loaded"] <= up["score_done"], up
    assert up["update_done"] <= timings["first_update_s"] <= timings["total_s"]
    # the same moment counted from the process's start: the interpreter, imports and the CLI before it
    assert timings["first_update_s"] < timings["first_update_since_process_start_s"] < timings["first_update_s"] + 60
    st = json.loads((run / "step-0003" / "state.json").read_text())
    for phase in ("rollout", "score", "policy"):
        assert st[phase]["wall_s"] > 0 and st[phase]["tokens_per_s"] > 0 and "peak_rss_gib" in st[phase]
    metrics = json.loads((run / "eval.json").read_text())  # the whole evaluation; metrics.json its headline
    assert metrics["initial"]["on_teacher_text"]["kl"] > 0 and metrics["final"]["on_teacher_text"]["tokens"] > 0
    assert json.loads((run / "metrics.json").read_text())["kl_after"] == metrics["final"]["on_teacher_text"]["kl"]
    # what the answers look like, next to the numbers: shares in [0, 1], and the side-by-side
    # answers are the samples the evaluate stage stored (same decoded text, same prompts)
    for who in ("teacher", "initial", "final"):
        a = metrics[who]["answers"]
        assert 0 <= a["nonblank"] <= 1 and 0 <= a["distinct_bigrams"] <= 1 and a["mean_tokens"] > 0, who
    side = json.loads((run / "answers.json").read_text())["side_by_side"]
    samples = pq.read_table(next((work / "artifacts" / "store" / "evaluate").glob("*/samples.parquet"))).to_pylist()
    assert len(side) == 4 and "side_by_side" not in metrics
    specials = session(work).models.tokenizer().all_special_tokens
    for who in ("teacher", "initial", "final"):
        stored = [r["response"] for r in samples if r["policy"] == who][:4]
        # the side-by-side text is the stored response without its special tokens (EOS, ...)
        for t in specials:
            stored = [r.replace(t, "") for r in stored]
        assert len(stored) == 4 and [s[who] for s in side] == stored, who
    exp = work / "artifacts" / "export" / "default"
    man = json.loads((exp / "manifest.json").read_text())
    assert man["versions"]["torch"] and man["digests"]["final_policy"] == json.loads(
        (run / "train.json").read_text())["final_policy"]
    # the exported adapter reloads with plain PEFT and reproduces the trained policy's log-probs
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    m = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(exp / "base"), exp / "adapter").eval()
    ids = torch.tensor([ro.column("prompt_ids").to_pylist()[0]])
    assert torch.isfinite(m(ids).logits).all()
    # a second run with nothing changed computes nothing
    before = store_dirs(work)
    opd("run", *TINY, cwd=work)
    assert store_dirs(work) == before


def test_changing_only_the_objective_reuses_rollout_1(work):
    opd("stage", "train", *TINY, cwd=work)
    before = store_dirs(work)
    opd("stage", "train", *TINY, "objective.loss_max_clamp=0.5", cwd=work)
    added = store_dirs(work) - before
    ro1 = json.loads((work / "artifacts/runs/default/step-0001/state.json").read_text())["rollout"]["digest"]
    assert f"rollout/{ro1}" in before  # rollout(1) reused
    assert not any(a.startswith("rollout/") and a.endswith(ro1) for a in added)
    assert sum(a.startswith("update/") for a in added) == 3  # every update recomputed


def test_more_updates_reuse_the_earlier_ones(work):
    opd("stage", "train", *TINY[:-2], "train.updates=4", "objective.topk=8", cwd=work)
    b4 = store_dirs(work)
    hist4 = list(csv.DictReader(open(work / "artifacts/runs/default/history.csv")))
    opd("stage", "train", *TINY[:-2], "train.updates=6", "objective.topk=8", cwd=work)
    added = store_dirs(work) - b4
    assert sorted(a.split("/")[0] for a in added) == ["rollout", "rollout", "score", "score", "update", "update"]
    hist6 = list(csv.DictReader(open(work / "artifacts/runs/default/history.csv")))
    assert [h["loss"] for h in hist6[:4]] == [h["loss"] for h in hist4]


def test_stage_runs_alone(work):
    r = opd("stage", "score", "--step", "2", *TINY, cwd=work)
    assert "scores" not in r.stderr
    assert any(p.name for p in (work / "artifacts/store/score").iterdir() if not p.name.startswith("."))
    r = opd("stage", "rollout", *TINY, cwd=work, check=False)
    assert r.returncode == 2 and "--step" in r.stderr


def test_inspect_prints_tokens_and_gaps(work):
    opd("run", *TINY, cwd=work)
    r = opd("inspect", "artifacts/runs/default", "--step", "1", "--format", "json", cwd=work)
    rows = json.loads(r.stdout)
    assert len(rows) == 4 and all(len(x["tokens"]) == len(x["teacher_logprobs"]) for x in rows)
    tok = session(work).models.tokenizer()  # the pieces are the student tokenizer's, one per sampled token
    assert [x["tokens"] for x in rows] == [[tok.decode([i]) for i in x["response_ids"]] for x in rows]
    worst = json.loads(opd("inspect", "artifacts/runs/default", "--step", "1", "--worst", "1", "--format", "json",
                           cwd=work).stdout)
    assert worst[0]["mean_gap"] == max(x["mean_gap"] for x in rows)
    text = opd("inspect", "artifacts/runs/default/step-0001/rollout.parquet", "--limit", "1", cwd=work).stdout
    assert "teacher logp" in text and "prompt" in text


def test_moving_the_prompt_files_and_the_artifacts_dir_reuses_every_stage(work):
    """Identity is content, never location: the same prompt files at other paths and the store in
    another directory give the same digests, so nothing is recomputed and the run view still works."""
    a = work / "in-a"
    a.mkdir()
    opd("data", "sample", "--out", str(a / "train.parquet"), "--rows", "12", *TINY, cwd=work)
    opd("data", "sample", "--out", str(a / "eval.parquet"), "--rows", "4", *TINY, "data.seed=3", cwd=work)
    first = [*TINY, f"data.path={a / 'train.parquet'}", f"data.eval_path={a / 'eval.parquet'}"]
    opd("run", *first, "train.updates=2", cwd=work)
    before = store_dirs(work)
    assert {d.split("/")[0] for d in before} >= {"prepared", "prompts", "init", "rollout", "score", "update", "evaluate"}
    prep = json.loads((work / "artifacts/runs/default/prepare.json").read_text())

    b = work / "elsewhere" / "prompts"
    b.mkdir(parents=True)
    (a / "train.parquet").rename(b / "renamed-train.parquet")
    (a / "eval.parquet").rename(b / "renamed-eval.parquet")
    (work / "artifacts").rename(work / "moved-artifacts")
    moved = [*TINY, f"data.path={b / 'renamed-train.parquet'}", f"data.eval_path={b / 'renamed-eval.parquet'}",
             "artifacts=moved-artifacts"]
    r = opd("run", *moved, "train.updates=2", cwd=work)
    after = {f"{p.parent.name}/{p.name}" for p in (work / "moved-artifacts/store").glob("*/*")
             if not p.name.startswith(".")}
    assert after == before  # every stage reused: nothing new in the store
    assert json.loads((work / "moved-artifacts/runs/default/prepare.json").read_text()) == prep
    assert "evaluate:" in r.stdout
    ro = pq.read_table(work / "moved-artifacts/runs/default/step-0002/rollout.parquet")  # links still resolve
    assert ro.num_rows == 4
