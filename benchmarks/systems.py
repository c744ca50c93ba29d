"""Systems benchmark: our pipeline and the peers on identical workloads, in one run on one machine.

    python benchmarks/systems.py --workload a --peers trl --tokenizer DIR --out benchmarks/results
    (also: opd benchmark systems ...)

Workload (a), the seed workload shape: SmolLM2-360M student / SmolLM2-1.7B teacher, random-init
weights of the real shapes (conf/arch/), bf16, 4 prompts x (128 prompt + 64 response) tokens per
update, LoRA r16 on 7 projections, forward_kl_topk k=32, 8 updates. Ours runs the real pipeline
(`opd stage train` in a fresh process: store, Parquet, adapters, everything). TRL 1.16
`DistillationTrainer` runs the same models, prompts and lengths (beta=0 forward KL) in a fresh
process. Workload (b), throughput: Qwen3-0.6B / Qwen3-1.7B shapes (vocab 151,936), 64 prompts x
(128 + 512) tokens, 4 updates, through the same real pipeline (prompts tokenized by the SmolLM2
tokenizer, a subset of the Qwen3 vocabulary: no tokenizer ships for these random models).

Writes <out>/<date>-<gpu>-systems.json and .md. Random weights emit EOS at random, so every side
forces the response length (min_new_tokens).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import shutil
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # cpu_peer (miniVERL recipe and launcher)
from stages.tools.process import process_settings  # noqa: E402
import roofline  # noqa: E402

process_settings()  # before torch anywhere in this process, as `opd` does (stages/cli.py)

WORKLOAD_A = dict(student="smollm2-360m", teacher="smollm2-1.7b", prompts=4, prompt_tokens=128, response=64,
                  updates=8, topk=32)
# --smoke: the driver end to end on CPU in a minute (tiny random Llamas; no TRL, whose runner needs CUDA)
WORKLOAD_SMOKE = dict(student="tiny-llama", teacher="tiny-llama-teacher", prompts=2, prompt_tokens=48, response=8,
                      updates=3, topk=8)
DEVICE = "cuda"  # "cpu" under --smoke
WORKLOAD_B = dict(student="qwen3-0.6b", teacher="qwen3-1.7b", prompts=64, prompt_tokens=128, response=512,
                  updates=4, topk=32)


def median(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 4) if xs else None


# ---------------------------------------------------------------- prompts of an exact token length
def exact_prompts(tok, n: int, length: int, seed: int = 0) -> list[list[dict]]:
    """Chat prompts whose templated token count is exactly `length` (words added until it fits)."""
    import random

    words = "river stone light cloud garden paper music window ocean forest signal winter".split()
    rng, out = random.Random(seed), []
    for i in range(n):
        text = f"Prompt {i}:"
        while True:
            msgs = [{"role": "user", "content": text}]
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            if len(ids) >= length:
                break
            text += " " + rng.choice(words)
        if len(ids) > length:  # overshot by a multi-token word: trim characters until exact
            while len(ids) > length:
                text = text[:-1]
                msgs = [{"role": "user", "content": text}]
                ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
                ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        out.append(msgs)
    return out


# ---------------------------------------------------------------- ours, workload (a): the pipeline
def overrides_for(w: dict, work: Path, tokenizer: str, artifacts: Path, name: str, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        f"student.name=arch:{w['student']}", "student.init=random", "student.keep_layers=0", f"student.tokenizer={tokenizer}",
        f"teacher.name=arch:{w['teacher']}", "teacher.init=random", f"teacher.tokenizer={tokenizer}",
        f"data.path={work / 'prompts.parquet'}", f"data.num_train={w['prompts'] * w['updates']}", "data.num_eval=4",
        f"data.max_prompt_tokens={w['prompt_tokens']}", f"rollout.batch_size={w['prompts']}",
        f"rollout.max_new_tokens={w['response']}", f"rollout.min_new_tokens={w['response']}",
        f"objective.topk={w['topk']}", f"train.updates={w['updates']}", f"runtime.device={DEVICE}",
        f"artifacts={artifacts}", "eval.max_new_tokens=8", f"run={name}", *extra,
    ]


def seed_store(w: dict, work: Path, tokenizer: str) -> dict:
    """Prompts of exact length (verl Parquet: all rows for ours, the train rows alone for miniVERL)
    and the random-init model dirs, materialised once by our prepare stage into work/seed (like a
    download; not timed as part of any system). Each system then starts from a fresh store that
    holds only these entries (hard links), so nothing of an earlier system can be reused."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from stages import train
    from stages.run import config
    from stages.rows import tables

    tok = AutoTokenizer.from_pretrained(tokenizer)
    n_train = w["prompts"] * w["updates"]
    prompts = exact_prompts(tok, n_train + 4, w["prompt_tokens"])
    rows = [{"data_source": "bench", "prompt": p, "ability": "chat", "reward_model": {"style": "rule", "ground_truth": ""},
             "extra_info": {"split": "train" if i < n_train else "test", "index": i}} for i, p in enumerate(prompts)]
    table = pa.Table.from_pylist(rows, tables.PROMPTS)
    tables.write(work / "prompts.parquet", table, {"purpose": "benchmark"})
    pq.write_table(table.slice(0, n_train), work / "prompts-train.parquet")
    t = time.perf_counter()
    prepared = train.session(config.compose(overrides_for(w, work, tokenizer, work / "seed", "seed"))).prepared
    store = work / "seed" / "store" / "model"
    return {"materialize_random_weights_s": round(time.perf_counter() - t, 2), "prepared": dict(prepared),
            "student_dir": str(store / prepared["student"]), "teacher_dir": str(store / prepared["teacher"])}


def fresh_artifacts(work: Path, name: str) -> Path:
    art = work / name / "artifacts"
    if art.exists():
        raise SystemExit(f"error: {art} exists: every system runs in a fresh store (give a fresh --work)")
    # the seed's entries only (tokenizer, models, prompts), linked: nothing computed by another system
    shutil.copytree(work / "seed" / "store", art / "store", symlinks=True, copy_function=os.link)
    return art


def ours_pipeline(w: dict, work: Path, tokenizer: str, python: str, profile: Path | None = None,
                  extra: tuple[str, ...] = (), name: str = "opd-stages") -> dict:
    from stages.run import config

    tokenizer = str(Path(tokenizer).resolve())
    art = fresh_artifacts(work, name)
    overrides = overrides_for(w, work, tokenizer, art, name, extra)
    params = work / name / "params.yaml"
    params.write_text(json.dumps(config.to_dict(config.compose(overrides))))  # JSON is YAML
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    cmd = [python, "-m", "stages.cli", "stage", "train", "--params", str(params)]
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=work / name, env=env, capture_output=True, text=True)
    train_proc_s = time.perf_counter() - t
    if r.returncode:
        raise RuntimeError(f"ours failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    run_dir = art / "runs" / name
    train_json = json.loads((run_dir / "train.json").read_text())
    walls = train_json["timings"].get("step_wall_s", [])
    if len(walls) != w["updates"]:  # a step read back from a store is not a measurement
        raise RuntimeError(f"ours ({name}): {w['updates'] - len(walls)} of {w['updates']} steps were reused from "
                           f"the store in {art}, not computed: the benchmark needs a fresh store")
    steps = [json.loads((run_dir / f"step-{k:04d}" / "state.json").read_text()) for k in range(1, w["updates"] + 1)]
    # resume: the same command again; every stage is published, so this is pure resumption overhead
    t = time.perf_counter()
    r2 = subprocess.run(cmd, cwd=work / name, env=env, capture_output=True, text=True)
    resume_proc_s = time.perf_counter() - t
    resume_json = json.loads((run_dir / "train.json").read_text())
    phases = {ph: [s[key]["wall_s"] for s in steps] for ph, key in (("rollout", "rollout"), ("score", "score"),
                                                                     ("update", "policy"))}
    per = lambda ph: phases[ph][1:]  # noqa: E731  medians skip update 1 (warm-up)
    phase_sum = [sum(t) for t in zip(*phases.values())]
    outside = [w_ - p for w_, p in zip(walls, phase_sum)]
    pos = w["prompts"] * w["response"]  # response tokens = scored = trained positions per update
    rate = lambda xs: round(pos / median(xs), 1) if median(xs) else None  # noqa: E731
    out = {
        "name": name, "settings": list(extra),
        # a whole step as the user waits for it (phases + Parquet/adapter IO + publishing), update 1 excluded
        "median_update_s": median(walls[1:]), "median_phase_sum_s": median(phase_sum[1:]), "step_wall_s": walls,
        "store_seconds_total": train_json["timings"].get("store_seconds"),
        "median_rollout_s": median(per("rollout")), "median_score_s": median(per("score")),
        "median_update_phase_s": median(per("update")),
        # a cross-tokenizer run's align stage (host work between rollout and score; else absent)
        **({"median_align_s": median([s["align"]["wall_s"] for s in steps][1:])} if "align" in steps[0] else {}),
        # the step outside the three phases (wall - phases), and the recorded pieces of it per stage
        # (inputs, Parquet, adapter/optimizer serialisation, the wait for the previous background publish)
        "median_outside_phases_s": median(outside[1:]),
        # every step's phases and the rest of its wall time, update 1 included: where a slow step's time went
        "per_step_s": {**phases, "outside": [round(x, 4) for x in outside]},
        "median_io_s": {f"{ph}.{key}": median([(s[ph].get("io_s") or {}).get(key) for s in steps[1:]])
                        for ph in ("rollout", "score", "policy")
                        for key in sorted({kk for s in steps for kk in (s[ph].get("io_s") or {})})},
        "rollout_tok_per_s": rate(per("rollout")),
        "scored_positions_per_s": rate(per("score")),
        "update_positions_per_s": rate(per("update")),
        # (CPU, --smoke: the phase's peak RSS stands in)
        "peak_allocated_gib": {ph: max(s[ph].get("peak_allocated_gib", s[ph].get("peak_rss_gib", 0)) for s in steps)
                               for ph in ("rollout", "score", "policy")},
        "peak_reserved_gib": {ph: max(s[ph].get("peak_reserved_gib", 0) for s in steps) for ph in ("rollout", "score", "policy")},
        "first_update_incl_construction_s": train_json["timings"].get("first_update_s"),
        "first_update_since_process_start_s": train_json["timings"].get("first_update_since_process_start_s"),
        # when each piece of that construction was first done, s since the session opened
        "startup_s": train_json["timings"].get("startup_s"),
        "train_process_wall_s": round(train_proc_s, 2),
        "resume_s": resume_json["timings"]["total_s"], "resume_process_wall_s": round(resume_proc_s, 2),
        "resume_recomputed_nothing": r2.returncode == 0 and "first_update_s" not in resume_json["timings"],
        "losses": [s["policy"]["loss"] for s in steps],
    }
    out["peak_allocated_gib"]["overall"] = max(out["peak_allocated_gib"].values())
    out["peak_reserved_gib"]["overall"] = max(out["peak_reserved_gib"].values())
    if profile:  # (a failure here is recorded beside the measurement above, which stands)
        try:
            out["profiled_phases_s"] = profile_steps(overrides, w["updates"], profile)
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            out["profile_error"] = f"{type(e).__name__}: {e}"[-2000:]
    return out


def one_update_run(w: dict, work: Path, tokenizer: str, tag: str, extra: tuple[str, ...] = ()) -> tuple[list[str], Path, dict, Path]:
    """A fresh `opd stage train` of one update on workload `w` in a fresh store (the construction and
    first update alone, benchmarks/first_update.py): (command, its working dir, env, artifacts dir)."""
    from stages.run import config

    art = fresh_artifacts(work, tag)
    over = [o for o in overrides_for(w, work, tokenizer, art, tag, extra) if not o.startswith("train.updates=")]
    params = work / tag / "params.yaml"
    params.write_text(json.dumps(config.to_dict(config.compose([*over, "train.updates=1"]))))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    return [sys.executable, "-m", "stages.cli", "stage", "train", "--params", str(params)], work / tag, env, art


def pieces(startup_s: dict) -> str:
    """train.json's timings.startup_s in the order the pieces finished: 'prepared 0.03, student_loaded 3.3, ...'."""
    return ", ".join(f"{k} {v}" for k, v in sorted(startup_s.items(), key=lambda kv: kv[1]))


def profile_steps(overrides: list[str], done: int, out_file: Path) -> dict:
    """Where the time of a step goes, over four more steps after an unprofiled warm-up step:
    one under torch.profiler (device kernels and host ops), one under cProfile (the host's Python:
    what the main thread waits in outside the phases), one timed call by call as the train loop
    runs it, and one whose phases each run under a profiler of their own (kernels per phase).
    Writes the tables to `out_file`; returns the torch-profiled stages' wall times."""
    import cProfile
    import io
    import pstats

    import torch
    from torch.profiler import ProfilerActivity, profile

    from stages import rollout, score, train, update
    from stages.run import config, runview

    # its own run name: the profiled run has more updates, and a run view holds one run
    over = [o for o in overrides if not o.startswith("run=")] + ["run=profile", f"train.updates={done + 5}"]
    sess = train.session(config.compose(over))
    train.ensure_policy(sess, done + 1)  # warm: models resident, graphs captured
    sess.store.flush()

    def step(sess, k: int, walls: dict) -> None:  # one step as train.run runs it, each call timed
        for name, fn in (("rollout", rollout.run), ("score", score.run), ("update", update.run),
                         ("flush (join the publish)", lambda s, _k: s.store.flush()),
                         ("run view", lambda s, kk: (runview.link_step(s, kk), runview.add_step(s, kk))),
                         ("history row", train.history_row)):
            t = time.perf_counter()
            fn(sess, k)
            walls[name] = round(time.perf_counter() - t, 4)

    k, walls = done + 2, {}
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with profile(activities=acts) as prof:
        step(sess, k, walls)
    print(f"profiled step {k}: {walls}", flush=True)
    ka = prof.key_averages()
    cp, cp_walls = cProfile.Profile(), {}
    cp.enable()
    step(sess, k + 1, cp_walls)
    cp.disable()
    plain: dict = {}
    step(sess, k + 2, plain)
    # each phase again under a profiler of its own: which kernels each phase spends its time in
    by_phase, phase_walls = {}, {}
    for name, fn in (("rollout", rollout.run), ("score", score.run), ("update", update.run)):
        with profile(activities=acts) as pp:
            t = time.perf_counter()
            fn(sess, k + 3)
            phase_walls[name] = round(time.perf_counter() - t, 4)
        by_phase[name] = pp.key_averages().table(sort_by="self_cuda_time_total" if DEVICE == "cuda" else
                                                 "self_cpu_time_total", row_limit=22)
        del pp
    sess.store.flush()
    # the rollout split: prefill (+ two tokens) against the whole response, same prompts and engine
    ro = sess.table("rollout", sess.chain.rollout(k + 2), "rollout.parquet")
    ids, split = ro.column("prompt_ids").to_pylist(), {}
    n = sess.cfg.rollout.max_new_tokens
    if ids and n > 2:
        # two new tokens, not one: one new token is the prefill alone, which the engine runs eager
        # (nothing to replay), while a longer rollout replays the captured prefill
        for new in (2, n, 2, n):  # each twice: the first call of a length captures its graphs
            t = time.perf_counter()
            sess.models.generate(ids, new, seed=0, min_new=new)
            split[new] = time.perf_counter() - t
        per_step = (split[n] - split[2]) / (n - 2)
        split = {"prefill_and_2_tokens_s": round(split[2], 4), f"prefill_and_{n}_tokens_s": round(split[n], 4),
                 "per_decode_step_ms": round(per_step * 1000, 3), "prefill_s": round(split[2] - per_step, 4)}
    plain["rollout_split"] = split
    buf = io.StringIO()
    st = pstats.Stats(cp, stream=buf)
    st.sort_stats("tottime").print_stats(45)
    st.sort_stats("cumulative").print_stats(60)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(
        f"step {k + 2} timed call by call (no profiler): " + json.dumps(plain) + "\n" +
        f"step {k + 1} under cProfile: " + json.dumps(cp_walls) + "\n" +
        f"step {k} under torch.profiler: " + json.dumps(walls) + "\n\n" +
        (ka.table(sort_by="self_cuda_time_total", row_limit=25) + "\n\n" if DEVICE == "cuda" else "") +
        ka.table(sort_by="cpu_time_total", row_limit=40) + "\n\n" +
        "".join(f"step {k + 3}, {name} alone under torch.profiler ({phase_walls[name]} s):\n{t}\n\n"
                for name, t in by_phase.items()) + buf.getvalue())
    del sess, prof
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return {**walls, "timed_step": plain, "phases_alone": phase_walls}


# ---------------------------------------------------------------- peers
def trl_peer(w: dict, work: Path, python: str, seed: dict, **extra) -> dict:
    """TRL 1.16 DistillationTrainer on the same model dirs and prompts, in a fresh process. extra:
    peer_trl.py's options (micro_batch, gradient_checkpointing)."""
    spec = {"student": seed["student_dir"], "teacher": seed["teacher_dir"],
            "prompts": str(work / "prompts.parquet"), "n_prompts": w["prompts"], "response": w["response"],
            "updates": w["updates"], "out": str(work / "trl.json"), **extra}
    r = subprocess.run([python, str(ROOT / "benchmarks" / "peer_trl.py"), json.dumps(spec)], capture_output=True,
                       text=True, cwd=work)
    if r.returncode:
        return {"name": "TRL 1.16 DistillationTrainer", "error": (r.stderr or r.stdout)[-2000:]}
    return json.loads((work / "trl.json").read_text())


# miniVERL 0.16's rollout backends on CUDA without vLLM (not carried; its managed engine needs a
# server): hf_reference (the default), hf_cached (batched KV cache) and hf_cached with
# rollout.compile_backend (torch.compile of the cached decode backbone, CUDA only; its compile time
# lands in the first cycle), in that order (under --deadline-s the last ones are the first to go)
MINIVERL_ARMS = (("hf_reference", "hf_reference", False), ("hf_cached", "hf_cached", False),
                 ("hf_cached+compile", "hf_cached", True))


def miniverl_peer(w: dict, work: Path, python: str, seed: dict, arms: list[str], deadline: float,
                  peer_updates: int = 0) -> list[dict]:
    """`miniverl train` with its native recipe (benchmarks/cpu_peer.py's, here device cuda and bf16)
    on the same model dirs and train prompts, one fresh process per rollout backend."""
    import cpu_peer

    try:
        import miniverl  # noqa: F401
    except ImportError:
        return [{"name": "miniVERL 0.16", "error": "miniverl is not importable here: carry its wheel and runtime "
                 "deps (../shared/device/wheels.sh miniverl==0.16.0 pydantic pydantic-core ...)"}]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "CPU_PEER_THREADS": str(os.cpu_count() or 1)}
    out = []
    todo = [a for a in MINIVERL_ARMS if a[0] in arms]
    for i, (arm, backend, compiled) in enumerate(todo):
        left = deadline - time.perf_counter()
        if left < 30:
            out.append({"name": f"miniVERL 0.16 ({arm})", "error": f"skipped: {left:.0f} s left before --deadline-s"})
            continue
        # what is left, less ~60 s for each arm still to come (on the H200 its default arm needs ~4 min
        # for 8 cycles, hf_cached ~1.5 min): an arm that finishes early leaves the rest to the next
        timeout = max(30.0, left - 60.0 * (len(todo) - i - 1))

        def adjust(rec: dict, compiled=compiled) -> None:
            rec["run"]["name"] = "systems"
            rec["models"]["device"] = DEVICE
            for role in ("student", "teacher"):
                rec["models"][role]["dtype"] = "bfloat16" if DEVICE == "cuda" else "float32"
            rec["rollout"]["compile_backend"] = compiled

        # fewer updates than ours when asked (--peer-updates): its rollouts take seconds each here
        mw = {**w, "threads": os.cpu_count() or 1, "updates": peer_updates or w["updates"]}
        try:
            s = cpu_peer.miniverl(mw, work, python, Path(seed["student_dir"]), Path(seed["teacher_dir"]),
                                  work / "prompts-train.parquet", env, backend, adjust, arm, timeout)
        except Exception as e:  # noqa: BLE001  one arm's failure is recorded, the next arm runs
            s = {"name": f"miniVERL 0.16 ({arm})", "error": f"{type(e).__name__}: {e}"}
        s.pop("prompt_ids_used", None)
        if "error" not in s:
            cpu_peer.summarize(s)
            ph = s["median_phase_s"]
            n = w["prompts"] * w["response"]
            s["updates_run"] = mw["updates"]
            s.update(median_rollout_s=ph["rollout"], median_score_s=ph["score"], median_update_phase_s=ph["update"],
                     rollout_tok_per_s=round(n / ph["rollout"], 1) if ph["rollout"] else None,
                     scored_positions_per_s=round(n / ph["score"], 1) if ph["score"] else None,
                     update_positions_per_s=round(n / ph["update"], 1) if ph["update"] else None,
                     peak_allocated_gib=s.get("cuda_peak_allocated_gib"))
        out.append(s)
    return out


# ---------------------------------------------------------------- report
def markdown(result: dict) -> str:
    lines = [f"# Systems benchmark — {result['date']} — {result['device']}", "",
             f"Command: `{result['command']}`", ""]
    for wname, wres in result["workloads"].items():
        lines += [f"## Workload {wname}: {json.dumps(wres['shape'])}", "",
                  "| system | median s/update | rollout s | score s | update s | rollout tok/s | scored pos/s | "
                  "update pos/s | peak alloc GiB (rollout/score/update) | first update incl. construction s | resume s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for s in wres["systems"]:
            if "error" in s:
                lines.append(f"| {s['name']} | not run: {s['error'][:160].splitlines()[0]} |||||||||| ")
                continue
            pa_ = s.get("peak_allocated_gib", {})
            peaks = "/".join(str(round(pa_.get(k, 0), 2)) for k in ("rollout", "score", "policy")) if isinstance(pa_, dict) else pa_
            lines.append(f"| {s['name']} | {s.get('median_update_s')} | {s.get('median_rollout_s')} | {s.get('median_score_s')} | "
                         f"{s.get('median_update_phase_s')} | {s.get('rollout_tok_per_s')} | {s.get('scored_positions_per_s')} | "
                         f"{s.get('update_positions_per_s')} | {peaks} | {s.get('first_update_incl_construction_s', s.get('construction_s'))} | "
                         f"{s.get('resume_s', '')} |")
        for s in wres["systems"]:
            if s.get("median_outside_phases_s") is not None:
                io = ", ".join(f"{k} {v}" for k, v in s["median_io_s"].items() if v)
                lines += ["", f"{s['name']}: {s['median_outside_phases_s']} s of each step outside the three phases "
                          f"(recorded pieces, median s: {io})"]
            if s.get("gradient_accumulation_steps", 1) > 1:
                ckpt = "on" if s["gradient_checkpointing"] else "off"
                lines += ["", f"{s['name']}: {s['micro_batch']} prompts per forward, "
                          f"{s['gradient_accumulation_steps']} accumulated per update, gradient checkpointing {ckpt}"]
            if s.get("startup_s"):  # the first update's construction, piece by piece (train.json timings)
                lines += ["", f"{s['name']}: the construction before the first update, s since the session opened "
                          f"when each was first done: {pieces(s['startup_s'])}"]
        if wres.get("ratios"):
            lines += ["", "Ratios (peer median s/update ÷ ours): " + ", ".join(f"{k}: {v}x" for k, v in wres["ratios"].items())]
        lines += roofline.markdown(wres.get("roofline"), result.get("peaks"))
        lines.append("")
    return "\n".join(lines) + "\n"


K1 = ("objective.name=k1", "objective.use_policy_gradient=true")
# the teacher's own tokenizer of the cross_qwen arm (Qwen2.5's: `AutoTokenizer.from_pretrained(...)
# .save_pretrained(...)` of a Qwen2.5 GGUF or Hub model); carried to the GPU machine beside SmolLM2's
CROSS_TOKENIZER = Path(os.environ.get("OPD_CROSS_TOKENIZER", ROOT / ".bench" / "qwen-tokenizer"))
# our arms beside the default: overrides, and the seconds one needs before the deadline
OURS_ARMS = {
    "nographs": (("runtime.cuda_graphs=false",), 45),  # score and update forwards eager (what the graphs save)
    "peft_lora": (("runtime.lora_kernels=false",), 45),  # the LoRA branch as PEFT computes it (the kernels' gain)
    "nographs_peft": (("runtime.cuda_graphs=false", "runtime.lora_kernels=false"), 45),  # the kernels' gain, eager
    "layers": (("runtime.compile_layers=true",), 60),  # compiled decoder layers for update and score (long runs)
    "eager": (("runtime.compile=false",), 45),  # the decode step without torch.compile (the fallback path)
    "ckpt": (("train.activation_checkpointing=true",), 45),  # one more forward for less update-phase memory
    "nf4": (("student.quant=nf4", "teacher.quant=nf4"), 45),  # QLoRA: NF4 student (LoRA on it) and teacher
    # the least memory: both NF4 sampled through transformers over the 4-bit weights (no dense copy), no
    # captured graphs (their pools), activation checkpointing and half the loss chunk (what `opd plan` suggests)
    "nf4small": (("student.quant=nf4", "teacher.quant=nf4", "student.dense_copy=false", "teacher.dense_copy=false",
                  "runtime.cuda_graphs=false", "train.activation_checkpointing=true", "train.chunk=128"), 60),
    "nf4teacher": (("teacher.quant=nf4",), 45),  # bf16 student, NF4 teacher: the teacher's memory only
    "nf4teacher_ckpt": (("teacher.quant=nf4", "train.activation_checkpointing=true"), 45),  # the least memory with a bf16 student
    # the rollout samples from the student's own weights, LoRA merged in place (no engine copy)
    "inplace_ckpt": (("memory.merge_in_place=true", "train.activation_checkpointing=true"), 45),
    "inplace_nf4teacher_ckpt": (("memory.merge_in_place=true", "teacher.quant=nf4",
                                 "train.activation_checkpointing=true"), 45),
    # cross-tokenizer OPD (objective.cross_tokenizer=spans) against the same sampled-token objective
    # with one tokenizer: k1 alone; spans over the same tokenizer (the align stage and span sums, every
    # span one token); a Qwen3-1.7B-shaped teacher with the Qwen tokenizer (CROSS_TOKENIZER's files)
    "k1": (K1, 45),
    "cross_same": ((*K1, "objective.cross_tokenizer=spans"), 45),
    "cross_qwen": ((*K1, "objective.cross_tokenizer=spans", "teacher.name=arch:qwen3-1.7b",
                    "teacher.tokenizer={cross_tokenizer}"), 75),
}


def peer_ratios(systems: list[dict]) -> dict:
    """Each peer's median s/update over ours (the first system, "opd-stages"); our other arms are no peers."""
    ours = systems[0].get("median_update_s") if systems and systems[0]["name"] == "opd-stages" else None
    return {x["name"]: round(x["median_update_s"] / ours, 2) for x in systems[1:]
            if ours and x.get("median_update_s") and not x["name"].startswith("opd-stages")}


def run_system(fn, name: str, deadline: float, need_s: float, *a, **kw):
    """One system; its failure (or no time left before the deadline) is recorded, not fatal."""
    left = deadline - time.perf_counter()
    if left < need_s:
        return {"name": name, "error": f"skipped: {left:.0f} s left before --deadline-s, it needs ~{need_s:.0f} s"}
    t = time.perf_counter()
    try:
        out = fn(*a, **kw)
    except Exception as e:  # noqa: BLE001  recorded in the result, the run goes on to the next system
        import traceback

        traceback.print_exc()
        out = {"name": name, "error": f"{type(e).__name__}: {e}"[-3000:]}
    print(f"{name}: {time.perf_counter() - t:.1f} s", flush=True)
    return out

# workload b's run: activation checkpointing (64 x 640 positions of activations would otherwise hold
# ~100 GiB through the backward), the LM head and loss over 1,024 positions at a time
B_DEFAULT = ("train.activation_checkpointing=true", "train.chunk=1024")
# our arms on workload b beside that: overrides (on top of B_DEFAULT)
B_ARMS = {
    "layers": ("runtime.compile_layers=true",),  # compiled decoder layers for update and score
    "chunk4096": ("train.chunk=4096",),  # the LM head and loss over 4,096 positions at a time
    "peft_lora": ("runtime.lora_kernels=false",),  # the LoRA branch as PEFT computes it (the kernels' gain)
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=("a", "b", "all"), default="all")
    ap.add_argument("--peers", default="trl,miniverl")
    ap.add_argument("--ours", default="default,nographs,layers,eager,ckpt,nf4",
                    help="our arms: default (the configuration as shipped: compiled decode step on CUDA, "
                         "teacher-forced forwards replayed from CUDA graphs), nographs (runtime.cuda_graphs=false), "
                         "nographs_peft (that with runtime.lora_kernels=false), "
                         "peft_lora (runtime.lora_kernels=false: PEFT's LoRA branch), "
                         "layers (runtime.compile_layers=true: compiled decoder layers for update and score), "
                         "eager (runtime.compile=false), ckpt (activation checkpointing), nf4 (NF4 student and "
                         "teacher; bitsandbytes), nf4small (those without dense copies or graphs, checkpointing, chunk 128), nf4teacher (NF4 teacher only), nf4teacher_ckpt (with activation checkpointing), "
                         "inplace_ckpt and inplace_nf4teacher_ckpt (those with memory.merge_in_place=true), k1, "
                         "cross_same and cross_qwen (cross-tokenizer OPD against k1 with one tokenizer)")
    ap.add_argument("--ours-b", default="", help=f"our arms on workload b beside the default: {', '.join(B_ARMS)}")
    ap.add_argument("--updates", type=int, default=0,
                    help="workload a's updates for every system (0: the workload's, 8); the result's shape records it")
    ap.add_argument("--peer-updates", type=int, default=0,
                    help="updates for miniVERL's arms and TRL's on workload b (0: the workload's); medians skip the first")
    ap.add_argument("--miniverl-arms", default=",".join(a for a, _, _ in MINIVERL_ARMS))
    ap.add_argument("--tokenizer", required=True, help="a SmolLM2 tokenizer dir (workload a)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--work", type=Path, default=None, help="a fresh (absent or empty) working dir")
    ap.add_argument("--profile", type=Path, default=None, help="write a torch.profiler table of one step to this file")
    ap.add_argument("--profile-b", type=Path, default=None, help="the same for workload b's default (~80 s more)")
    ap.add_argument("--date", default=dt.date.today().isoformat(), help="date in the result's name")
    ap.add_argument("--smoke", action="store_true", help="the driver end to end on CPU with tiny models (no TRL)")
    ap.add_argument("--deadline-s", type=float, default=float("inf"),
                    help="skip (and record as skipped) systems that would start too close to this many seconds")
    args = ap.parse_args(argv)
    ours_b = [a for a in args.ours_b.split(",") if a]
    if unknown := [a for a in ours_b if a not in B_ARMS]:  # (before any GPU time is spent)
        ap.error(f"--ours-b: unknown {unknown}; expected some of {','.join(B_ARMS)}")
    global DEVICE
    if args.smoke:
        DEVICE = "cpu"
    t0 = time.perf_counter()
    deadline = t0 + args.deadline_s
    work = (args.work or Path(tempfile.mkdtemp(prefix="opd-bench-"))).resolve()
    if work.exists() and any(work.iterdir()):  # an earlier run's store would turn measured steps into reads
        print(f"error: --work {work} is not empty; give a fresh dir", file=sys.stderr)
        return 2
    work.mkdir(parents=True, exist_ok=True)
    import torch

    device = torch.cuda.get_device_name(0) if DEVICE == "cuda" and torch.cuda.is_available() else "cpu"
    result = {"date": args.date, "device": device, "command": " ".join(["python", *sys.argv]),
              "torch": torch.__version__, "workloads": {},
              "peaks": None if args.smoke else roofline.measure_peaks()}  # (before any model: the whole device)
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = device.replace("NVIDIA ", "").replace(" ", "-").lower()
    stem = args.out / (f"{result['date']}-smoke" if args.smoke else f"{result['date']}-{gpu}-systems")

    def save() -> None:  # after every system: a run cut short still leaves what it measured
        result["driver_wall_s"] = round(time.perf_counter() - t0, 1)
        stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        stem.with_suffix(".md").write_text(markdown(result))

    peers = [p for p in args.peers.split(",") if p]
    py = sys.executable
    if args.workload in ("a", "all"):
        w = {**(WORKLOAD_SMOKE if args.smoke else WORKLOAD_A), **({"updates": args.updates} if args.updates else {})}
        tok = str(Path(args.tokenizer).resolve())
        seed = seed_store(w, work, tok)
        systems: list[dict] = []
        wa = result["workloads"]["a"] = {"shape": w, "materialize_random_weights_s": seed["materialize_random_weights_s"],
                                         "systems": systems, "ratios": {}}

        def add(s) -> None:
            systems.extend(s if isinstance(s, list) else [s])
            wa["ratios"] = peer_ratios(systems)
            if systems[0]["name"] == "opd-stages":
                wa["roofline"] = roofline.table(w, systems[0], result["peaks"])
            save()

        ours_arms = args.ours.split(",")
        if "default" in ours_arms:  # first: the ratios are against it
            add(run_system(ours_pipeline, "opd-stages", deadline, 60, w, work, tok, py, args.profile))
        for arm, (over, need) in OURS_ARMS.items():
            if arm in ours_arms and not (args.smoke and arm.startswith("nf4")):  # (bitsandbytes on CUDA only here)
                over = tuple(o.format(cross_tokenizer=CROSS_TOKENIZER.resolve()) for o in over)
                add(run_system(ours_pipeline, f"opd-stages-{arm}", deadline, need, w, work, tok, py, None, over,
                               f"opd-stages-{arm}"))
        if "trl" in peers and not args.smoke:
            add(run_system(trl_peer, "TRL 1.16 DistillationTrainer", deadline, 60, w, work, py, seed))
        if "miniverl" in peers:
            arms = [a for a in args.miniverl_arms.split(",") if a]
            add(run_system(miniverl_peer, "miniVERL 0.16", deadline, 45, w, work, py, seed, arms, deadline,
                           args.peer_updates))
        print(json.dumps(wa, indent=1), flush=True)
    if args.workload in ("b", "all") and not args.smoke:
        # the real pipeline (`opd stage train`) on the Qwen3 shapes, prompts tokenized by the SmolLM2
        # tokenizer (its ids are a subset of the 151,936-token vocabulary), with B_DEFAULT's settings
        wb = work / "b"
        wb.mkdir()
        tok = str(Path(args.tokenizer).resolve())
        systems_b: list[dict] = []
        result["workloads"]["b"] = {"shape": WORKLOAD_B, "systems": systems_b}

        seed_b: dict = {}

        def seeded_then_ours() -> dict:
            seed_b.update(seed_store(WORKLOAD_B, wb, tok))
            result["workloads"]["b"]["materialize_random_weights_s"] = seed_b["materialize_random_weights_s"]
            return ours_pipeline(WORKLOAD_B, wb, tok, py, args.profile_b, B_DEFAULT)

        # ~130 s: the random weights' ~40 s come before the run's ~90 (2026-12-04: with the seed outside
        # the deadline's check, it started with 5 s left and ran the call past its limit)
        systems_b.append(run_system(seeded_then_ours, "opd-stages", deadline, 130 + (80 if args.profile_b else 0)))
        result["workloads"]["b"]["roofline"] = roofline.table(WORKLOAD_B, systems_b[0], result["peaks"])
        save()
        for arm in ours_b if seed_b else ():  # variants on the same seed
            over = dict(o.split("=", 1) for o in (*B_DEFAULT, *B_ARMS[arm]))  # the arm's values win
            systems_b.append(run_system(ours_pipeline, f"opd-stages-{arm}", deadline, 100, WORKLOAD_B, wb, tok, py,
                                        None, tuple(f"{k}={v}" for k, v in over.items()), f"opd-stages-{arm}"))
            save()
        if "trl" in peers and seed_b:
            # TRL as it fits: 16 prompts per forward, accumulated to the 64 of an update, with gradient
            # checkpointing as ours has; --peer-updates of them (the median skips the first)
            wt = {**WORKLOAD_B, "updates": max(2, args.peer_updates or WORKLOAD_B["updates"])}
            systems_b.append(run_system(trl_peer, "TRL 1.16 DistillationTrainer", deadline, 150, wt, wb, py, seed_b,
                                        micro_batch=16, gradient_checkpointing=True))
            result["workloads"]["b"]["ratios"] = peer_ratios(systems_b)
            save()
        print(json.dumps(result["workloads"]["b"], indent=1), flush=True)
    save()
    print(markdown(result))
    return exit_code(result)


def exit_code(result: dict) -> int:
    """1 when a system failed; a system skipped by --deadline-s did what the caller asked (listed, 0)."""
    missed = [s for wres in result["workloads"].values() for s in wres["systems"] if "error" in s]
    if missed:
        print(f"not measured: {', '.join(s['name'] for s in missed)}", file=sys.stderr)
    return 1 if any(not s["error"].startswith("skipped:") for s in missed) else 0


if __name__ == "__main__":
    sys.exit(main())
