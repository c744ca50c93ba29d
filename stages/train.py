"""The driver: opens a run (prepare first), publishes policy 0, and runs the rollout -> score ->
update loop in one process with the models resident. The CLI calls it; it calls the stage modules,
which never call each other or it (docs/architecture.md, "dependency direction").

Each step's three stages are content-addressed: a published step is read back, never recomputed,
so a killed run resumes at the first unpublished stage and ends byte-identical to an uninterrupted
one. Models load lazily, only when a stage actually has to run.
"""
from __future__ import annotations

import csv
import dataclasses
import os
import sys
import time

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from . import align, prepare, rollout, score, sft, update
from .weights import ahead
from .memory import hostmem, phases
from .engine import kernels, warmup
from .run import codepaths, identity, runview
from .run.config import Config, logit_temperature
from .run.store import fault, read_state, write_json
from .session import Session

HISTORY_COLS = ["step", "loss", "kl", "grad_norm", "teacher_topk_mass", "student_topk_mass", "topk_overlap",
                "rollout_tokens_per_s", "score_tokens_per_s", "update_tokens_per_s", "rollout_wall_s",
                "score_wall_s", "update_wall_s", "peak_memory_gib", "response_tokens", "reused"]


def session(cfg: Config, placement: str | None = None, origin: str = "overrides") -> Session:
    """A Session with prepare's record in place (models materialised, prompts and tasks published).
    origin: how the config was given (stages/run/runview.py): "params" (a params file) or "overrides"."""
    sess = Session(cfg, placement, origin)
    prepare.run(sess)
    return sess


def policy0(sess: Session) -> None:
    """Publish policy 0: the fresh LoRA (init), and with sft.steps > 0 the SFT cold start trained from
    it; with teacher_mode=protocol_sft also the teacher adapter the teacher is built from."""
    update.init(sess)
    if sess.cfg.sft.steps:
        sft.cold_start(sess)
    ensure_teacher(sess)


def ensure_teacher(sess: Session) -> None:
    if sess.cfg.teacher_mode == "protocol_sft":
        sft.teacher_adapter(sess)


def sft_continued(sess: Session, steps: int) -> tuple[str, str]:
    """`steps` more SFT steps from policy 0 (the benchmark's sft-continued arm); (stage, digest)."""
    policy0(sess)
    return sft.continued(sess, steps)


def aligned(sess: Session, k: int) -> None:
    """A cross-tokenizer run's align(k), between rollout(k) and score(k) (stages/align.py); else nothing."""
    if sess.cfg.objective.cross_tokenizer != "off":
        align.run(sess, k)


def ensure_policy(sess: Session, k: int) -> None:
    """Make policy version k exist in the store (runs the earlier steps if needed). Returns with
    everything it computed published: a publish that failed on the worker thread raises here."""
    policy0(sess)
    for j in range(1, k + 1):
        if sess.store.get("update", sess.chain.update(j)) is None:
            rollout.run(sess, j)
            aligned(sess, j)
            score.run(sess, j)
            update.run(sess, j)
    sess.store.flush()


def published_steps(sess: Session) -> list[int]:
    """The steps of this run whose update an earlier run published (by its manifest; not content-checked)."""
    return [k for k in range(1, sess.cfg.train.updates + 1)
            if (sess.store.path("update", sess.chain.update(k)) / "manifest.json").is_file()]


def plan_line(sess: Session, published: list[int]) -> str:
    """One line before the loop: which steps earlier runs published (`published_steps`; reused) and what is left."""
    K = sess.cfg.train.updates
    todo = K - len(published)
    if not K:
        return "train: 0 updates (policy 0 only)"
    if not todo:
        return f"train: all {K} steps published by an earlier run: reusing them, nothing to compute"
    if not published:
        return f"train: {K} step{'s' if K > 1 else ''} to compute"
    first = next(k for k in range(1, K + 1) if k not in published)
    partial = [name for name, dig in (("rollout", sess.chain.rollout(first)), ("score", sess.chain.score(first)))
               if (sess.store.path(name, dig) / "manifest.json").is_file()]
    where = f" (its {' and '.join(partial)} published)" if partial else ""
    done = runview.ranges(published)
    if published == list(range(1, first)):
        return f"train: resuming at step {first}{where}: {done} published; {todo} to compute"
    return f"train: {done} published (reused); {runview.ranges([k for k in range(1, K + 1) if k not in published])} " \
           f"to compute, from step {first}{where}"


def history_row(sess: Session, k: int) -> dict:
    st = {name: read_state(sess.store.path(name, dig)) for name, dig in
          (("rollout", sess.chain.rollout(k)), ("score", sess.chain.score(k)), ("update", sess.chain.update(k)))}
    u = st["update"]
    mem = [s.get("peak_allocated_gib", s.get("peak_rss_gib")) for s in st.values()]
    row = {"step": k, "loss": u.get("loss"), "kl": u.get("kl"), "grad_norm": u.get("grad_norm"),
           "teacher_topk_mass": u.get("teacher_topk_mass"), "student_topk_mass": u.get("student_topk_mass"),
           "topk_overlap": u.get("topk_overlap"), "peak_memory_gib": max(m for m in mem if m is not None),
           "response_tokens": st["rollout"].get("tokens")}
    for name, s in st.items():
        row[f"{name}_tokens_per_s"] = s.get("tokens_per_s")
        row[f"{name}_wall_s"] = s.get("wall_s")
    return row


def warm_up(sess: Session) -> None:
    """Start the first calls of the loop's GPU work on a thread (stages/engine/warmup.py), at its shapes."""
    cfg, r = sess.cfg, sess.cfg.rollout
    configs = [sess.store.path("model", sess.prepared[role]) / "config.json" for role in ("student", "teacher")]
    warmup.start(*configs, rows=r.batch_size * r.n, prompt=-(-cfg.data.max_prompt_tokens // 16) * 16,
                 new=r.max_new_tokens, length=sess.models.forward_length(), rank=cfg.lora.r,
                 sampling=(logit_temperature(r), r.top_p, r.temperature == 0), min_new=r.min_new_tokens,
                 dtype=sess.dtype, device=sess.device, compiled=sess.models.compiled_decode,
                 precompile=cfg.runtime.precompile,
                 engine=phases.engine_weights(cfg.teacher if phases.teacher_samples(cfg) else cfg.student),
                 lora_kernels=codepaths.lora_kernels(cfg, "student", sess.device.type))


def run(sess: Session) -> dict:
    cfg = sess.cfg
    # validate early and set up in dependency order: prepared inputs -> policy 0 -> loop
    prepared = sess.prepared
    published = published_steps(sess)
    if len(published) < cfg.train.updates:
        # steps to compute, so both models will load: hash their dirs now, beside the student's load
        # and its first rollout, not in line before each load, where hashing gigabytes would hold it up
        for role in ("student", "teacher"):
            sess.store.verify_soon(sess.store.path("model", prepared[role]))
        if sess.device.type == "cuda":  # and Triton's cache key, which the first rollout's kernels need
            kernels.cache_key_soon()
            if cfg.runtime.warmup and cfg.memory.vram_gib is None:  # (a set budget does not plan its bytes)
                warm_up(sess)
            if cfg.runtime.warmup:  # the tokenizer, pandas and the teacher read beside the student's load
                sess.models.load_ahead()
                ahead.favour_main_thread()  # until the first update: the threads wait for the main one
    sess.mark("prepared")
    policy0(sess)
    sess.mark("policy0_published")
    runview.begin(sess)  # the view is this run's from here (another run's steps are removed)
    write_json(sess.run_dir / "config.json", dataclasses.asdict(cfg))
    runview.link_step(sess, 0)
    runview.add_step(sess, 0)
    print(plan_line(sess, published), flush=True)
    rows, reused = [], set()
    quiet = not sys.stderr.isatty()
    with Progress(TextColumn("[bold]train[/] {task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), disable=quiet) as bar:
        task = bar.add_task("", total=cfg.train.updates)

        def record(k: int) -> None:
            """Run view + history for step k (joins its background publish first)."""
            runview.link_step(sess, k)
            runview.add_step(sess, k)
            # a step an earlier run published: its timings are from then, not from this process
            row = {**history_row(sess, k), "reused": int(k in reused)}
            rows.append(row)
            bar.update(task, advance=1, description=(
                f"step {k} loss {row['loss']:.4f} | rollout {row['rollout_tokens_per_s'] or 0:.0f} tok/s "
                f"score {row['score_tokens_per_s'] or 0:.0f} tok/s update {row['update_tokens_per_s'] or 0:.0f} tok/s"))
            if quiet:
                print(f"step {k}/{cfg.train.updates}: loss {row['loss']:.4f} grad_norm {row['grad_norm']:.3f} "
                      f"rollout {row['rollout_tokens_per_s'] or 0:.0f} tok/s", file=sys.stderr)

        waiting: list[int] = []  # computed steps whose update may still be publishing in the background
        for k in range(1, cfg.train.updates + 1):
            t_step = time.perf_counter()
            if sess.store.get("update", sess.chain.update(k)) is None:  # else: published, reuse
                rollout.run(sess, k)
                sess.mark("rollout_done")
                aligned(sess, k)
                score.run(sess, k)
                sess.mark("score_done")
                update.run(sess, k)
                sess.mark("update_done")
                if k < cfg.train.updates and not sess.store.path("rollout", sess.chain.rollout(k + 1)).exists():
                    sess.models.premerge()  # the next rollout samples policy k (memory.merge_in_place: merged now;
                    # whatever reads the weights first instead undoes it, decoder.base_ready)
                if k == 1:  # construction (model loads, graph capture) + the first update
                    sess.timings["first_update_s"] = round(time.perf_counter() - sess.t0, 4)
                    # and as the user waits for it: from the process's start (interpreter, imports, CLI)
                    sess.timings["first_update_since_process_start_s"] = hostmem.process_age_s()
                    sess.timings.update(warmup.report())
                    if (read := sess.models.loaded_ahead()) is not None:  # (stages/weights/ahead.py)
                        sess.timings["loaded_ahead"] = read
                    ahead.restore_switch_interval()
                # the whole step as a user waits for it: phases + Parquet/adapter IO + publishing
                sess.timings.setdefault("step_wall_s", []).append(round(time.perf_counter() - t_step, 4))
            else:  # a reused step's rollout and scores are content-checked too before they are linked
                reused.add(k)
                rollout.run(sess, k)  # (and recomputed, to the same bytes, if damaged)
                aligned(sess, k)
                score.run(sess, k)
            for j in waiting:  # the previous step's publish overlapped this step's compute
                record(j)
            waiting = [k]
            fault("train.between_steps")
        sess.store.flush()
        ahead.restore_switch_interval()  # (a run with no update to compute)
        for j in waiting:
            record(j)
    sess.run_dir.mkdir(parents=True, exist_ok=True)
    tmp = sess.run_dir / f".history.csv.tmp-{os.getpid()}"  # atomic: two runs of one view never interleave
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=HISTORY_COLS)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, sess.run_dir / "history.csv")
    final = sess.chain.policy(cfg.train.updates)
    out = {"updates": cfg.train.updates, "final_policy": final, "initial_policy": sess.chain.init(),
           "prepared": prepared, "final_loss": rows[-1]["loss"] if rows else None,
           # process-local timings (not part of any identity): session start -> first update published
           "timings": {**sess.timings, "total_s": round(time.perf_counter() - sess.t0, 4),
                       "store_seconds": sess.store.seconds}}
    write_json(sess.run_dir / "train.json", out)
    runview.finish(sess)  # complete: every step linked, history and train record written
    # how this process got there (reused steps are marked in history.csv too): not in train.json, whose
    # content a resumed run must write exactly as an uninterrupted one
    return {**out, "reused": len(reused)}


def main(sess: Session) -> dict:
    out = run(sess)
    K, n = out["updates"], out["reused"]
    what = f"{n} reused, {K - n} computed" if n else "all computed"
    print(f"train: {K} updates ({what}), final policy {sess.chain.policy_stage(K)}/{out['final_policy'][:12]} "
          f"(run view {sess.run_dir})")
    return out
