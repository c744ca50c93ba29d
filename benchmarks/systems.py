"""Systems benchmark: our pipeline and the peers on identical workloads, in one run on one machine.

    python benchmarks/systems.py --workload a --peers trl --tokenizer DIR --out benchmarks/results
    (also: opd benchmark systems ...)

Workload (a), the seed workload shape: SmolLM2-360M student / SmolLM2-1.7B teacher, random-init
weights of the real shapes (conf/arch/), bf16, 4 prompts x (128 prompt + 64 response) tokens per
update, LoRA r16 on 7 projections, forward_kl_topk k=32, 8 updates. Ours runs the real pipeline
(`opd stage train` in a fresh process: store, Parquet, adapters, everything). TRL 1.16
`DistillationTrainer` runs the same models, prompts and lengths (beta=0 forward KL) in a fresh
process. Workload (b), throughput: Qwen3-0.6B / Qwen3-1.7B shapes (vocab 151,936), 64 prompts x
512 response tokens, 4 updates, driven through the same engine / head / loss functions on
synthetic token ids (no tokenizer exists for these random models).

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
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORKLOAD_A = dict(student="smollm2-360m", teacher="smollm2-1.7b", prompts=4, prompt_tokens=128, response=64,
                  updates=8, topk=32)
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
def ours_pipeline(w: dict, work: Path, tokenizer: str, python: str, profile_dir: Path | None = None,
                  extra: tuple[str, ...] = (), name: str = "opd-stages") -> dict:
    import pyarrow as pa
    from transformers import AutoTokenizer

    from stages import config, tables, train

    tokenizer = str(Path(tokenizer).resolve())
    tok = AutoTokenizer.from_pretrained(tokenizer)
    n_rows = w["prompts"] * w["updates"] + 4
    prompts = exact_prompts(tok, n_rows, w["prompt_tokens"])
    rows = [{"data_source": "bench", "prompt": p, "ability": "chat", "reward_model": {"style": "rule", "ground_truth": ""},
             "extra_info": {"split": "train" if i < n_rows - 4 else "test", "index": i}} for i, p in enumerate(prompts)]
    pq_path = work / "prompts.parquet"
    tables.write(pq_path, pa.Table.from_pylist(rows, tables.PROMPTS), {"purpose": "benchmark"})
    overrides = [
        f"student.name=arch:{w['student']}", "student.init=random", "student.keep_layers=0", f"student.tokenizer={tokenizer}",
        f"teacher.name=arch:{w['teacher']}", "teacher.init=random", f"teacher.tokenizer={tokenizer}",
        f"data.path={pq_path}", f"data.num_train={n_rows - 4}", "data.num_eval=4",
        f"data.max_prompt_tokens={w['prompt_tokens']}", f"rollout.batch_size={w['prompts']}",
        f"rollout.max_new_tokens={w['response']}", f"rollout.min_new_tokens={w['response']}",
        f"objective.topk={w['topk']}", f"train.updates={w['updates']}", "runtime.device=cuda",
        f"artifacts={work / 'artifacts'}", "eval.max_new_tokens=8", f"run={name}", *extra,
    ]
    params = work / "params.yaml"
    cfg = config.compose(overrides)
    params.write_text(json.dumps(config.to_dict(cfg)))  # JSON is YAML
    t = time.perf_counter()
    train.session(cfg)  # prepare: materialise random weights once (like a download; not timed below)
    materialize_s = time.perf_counter() - t
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    cmd = [python, "-m", "stages.cli", "stage", "train", "--params", str(params)]
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    train_proc_s = time.perf_counter() - t
    if r.returncode:
        raise RuntimeError(f"ours failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    run_dir = work / "artifacts" / "runs" / name
    train_json = json.loads((run_dir / "train.json").read_text())
    (work / f"train_first-{name}.json").write_text(json.dumps(train_json))
    steps = [json.loads((run_dir / f"step-{k:04d}" / "state.json").read_text()) for k in range(1, w["updates"] + 1)]
    # resume: the same command again; every stage is published, so this is pure resumption overhead
    t = time.perf_counter()
    r2 = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    resume_proc_s = time.perf_counter() - t
    resume_json = json.loads((run_dir / "train.json").read_text())
    per = lambda ph, key: [s[ph].get(key) for s in steps[1:]]  # noqa: E731  medians skip update 1 (warm-up)
    update_total = [s["rollout"]["wall_s"] + s["score"]["wall_s"] + s["policy"]["wall_s"] for s in steps[1:]]
    resp_tok = w["prompts"] * w["response"]
    pos = w["prompts"] * w["response"]
    walls = train_json["timings"].get("step_wall_s", [])
    out = {
        "name": name, "settings": list(extra), "materialize_random_weights_s": round(materialize_s, 2),
        # a whole step as the user waits for it (phases + Parquet/adapter IO + publishing), update 1 excluded
        "median_update_s": median(walls[1:]), "median_phase_sum_s": median(update_total), "step_wall_s": walls,
        "store_seconds_total": train_json["timings"].get("store_seconds"),
        "median_rollout_s": median(per("rollout", "wall_s")), "median_score_s": median(per("score", "wall_s")),
        "median_update_phase_s": median(per("policy", "wall_s")),
        "rollout_tok_per_s": round(resp_tok / median(per("rollout", "wall_s")), 1),
        "scored_positions_per_s": round(pos / median(per("score", "wall_s")), 1),
        "update_positions_per_s": round(pos / median(per("policy", "wall_s")), 1),
        "peak_allocated_gib": {ph: max(s[ph]["peak_allocated_gib"] for s in steps) for ph in ("rollout", "score", "policy")},
        "peak_reserved_gib": {ph: max(s[ph]["peak_reserved_gib"] for s in steps) for ph in ("rollout", "score", "policy")},
        "first_update_incl_construction_s": train_json["timings"].get("first_update_s"),
        "train_process_wall_s": round(train_proc_s, 2),
        "resume_s": resume_json["timings"]["total_s"], "resume_process_wall_s": round(resume_proc_s, 2),
        "resume_recomputed_nothing": r2.returncode == 0 and "first_update_s" not in resume_json["timings"],
        "losses": [s["policy"]["loss"] for s in steps],
    }
    out["peak_allocated_gib"]["overall"] = max(out["peak_allocated_gib"].values())
    out["peak_reserved_gib"]["overall"] = max(out["peak_reserved_gib"].values())
    if profile_dir:
        profile_steps(overrides, w["updates"], profile_dir)
    return out


def profile_steps(overrides: list[str], done: int, out_dir: Path) -> None:
    """torch.profiler over one more step (after an unprofiled warm-up step): where the time goes."""
    from torch.profiler import ProfilerActivity, profile

    from stages import config, rollout, score, train, update

    sess = train.session(config.compose([*overrides, f"train.updates={done + 2}"]))
    train.ensure_policy(sess, done + 1)  # warm: models resident, graphs captured
    k = done + 2
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for name, fn in (("rollout", rollout.run), ("score", score.run), ("update", update.run)):
            t = time.perf_counter()
            fn(sess, k)
            print(f"profiled {name}: {time.perf_counter() - t:.4f} s", flush=True)
    ka = prof.key_averages()
    (out_dir / "profile.txt").write_text(
        ka.table(sort_by="self_cuda_time_total", row_limit=25) + "\n\n" + ka.table(sort_by="cpu_time_total", row_limit=40))


# ---------------------------------------------------------------- ours, workload (b): the engine
def ours_blocks(w: dict) -> dict:
    import torch
    from types import SimpleNamespace
    from transformers import AutoConfig, AutoModelForCausalLM

    from stages import adapters, config, lmhead, models, sampler, update
    from stages.config import LoraCfg

    def build(name, seed):
        spec = {k: v for k, v in models.arch_config(name).items() if k != "_comment"}
        torch.manual_seed(seed)
        with torch.device("cuda"):
            m = AutoModelForCausalLM.from_config(AutoConfig.for_model(**spec), dtype=torch.bfloat16)
        return m.eval().requires_grad_(False)

    t0 = time.perf_counter()
    student = models.add_lora(build(w["student"], 0), LoraCfg(r=16, alpha=32), seed=1)
    teacher = build(w["teacher"], 2)
    eng = sampler.Engine(student, use_graphs=True)
    construct = time.perf_counter() - t0
    cfg = config.compose([f"objective.topk={w['topk']}", "train.chunk=1024"])
    sess = SimpleNamespace(cfg=cfg, device=torch.device("cuda"))
    opt, named = adapters.make_optimizer(cfg.optim, student, None)
    V = student.config.vocab_size
    g = torch.Generator().manual_seed(0)
    rows = []
    for k in range(w["updates"]):
        prompts = torch.randint(100, V - 100, (w["prompts"], w["prompt_tokens"]), generator=g).tolist()
        rec = {}
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); t = time.perf_counter()
        out = eng.generate(prompts, w["response"], eos=-1, pad=0, seed=k, min_new=w["response"])
        torch.cuda.synchronize(); rec["rollout_s"] = time.perf_counter() - t
        rec["rollout_peak"] = torch.cuda.max_memory_allocated() / 2**30
        resp = out.tokens.tolist()
        p = lmhead.pack(prompts, resp, [[1] * len(r) for r in resp], 0, "cuda")
        torch.cuda.reset_peak_memory_stats(); t = time.perf_counter()
        with torch.no_grad():
            h = lmhead.hidden(teacher, p)
            lp, ids, tlp, _ = lmhead.score_positions(h, lmhead.head_weight(teacher), p.targets, 1024, w["topk"])
        torch.cuda.synchronize(); rec["score_s"] = time.perf_counter() - t
        rec["score_peak"] = torch.cuda.max_memory_allocated() / 2**30
        sc = {"teacher_logprobs": lp, "topk_ids": ids, "topk_logprobs": tlp}
        torch.cuda.reset_peak_memory_stats(); t = time.perf_counter()
        student.train()
        opt.zero_grad(set_to_none=True)
        stats = update.loss_and_backward(sess, student, p, out.logprobs.reshape(-1).cuda(), sc)
        torch.nn.utils.clip_grad_norm_([q for _, q in named], 1.0)
        opt.step()
        student.eval()
        eng.refresh()
        torch.cuda.synchronize(); rec["update_s"] = time.perf_counter() - t
        rec["update_peak"] = torch.cuda.max_memory_allocated() / 2**30
        rec["loss"] = stats["loss"]
        rows.append(rec)
    tail = rows[1:] if len(rows) > 1 else rows
    n = w["prompts"] * w["response"]
    return {"name": "opd-stages (engine/head/loss functions, synthetic ids)", "construction_s": round(construct, 2),
            "median_rollout_s": median([r["rollout_s"] for r in tail]), "median_score_s": median([r["score_s"] for r in tail]),
            "median_update_phase_s": median([r["update_s"] for r in tail]),
            "median_update_s": median([r["rollout_s"] + r["score_s"] + r["update_s"] for r in tail]),
            "rollout_tok_per_s": round(n / median([r["rollout_s"] for r in tail]), 1),
            "scored_positions_per_s": round(n / median([r["score_s"] for r in tail]), 1),
            "update_positions_per_s": round(n / median([r["update_s"] for r in tail]), 1),
            "peak_allocated_gib": {"rollout": round(max(r["rollout_peak"] for r in rows), 3),
                                   "score": round(max(r["score_peak"] for r in rows), 3),
                                   "policy": round(max(r["update_peak"] for r in rows), 3)},
            "losses": [round(r["loss"], 5) for r in rows]}


# ---------------------------------------------------------------- peers
def trl_peer(w: dict, work: Path, python: str) -> dict:
    """TRL 1.16 DistillationTrainer on the same model dirs and prompts, in a fresh process."""
    store = work / "artifacts" / "store" / "model"
    prep = json.loads((work / "artifacts" / "runs" / "opd-stages" / "prepare.json").read_text())
    spec = {"student": str(store / prep["student"]), "teacher": str(store / prep["teacher"]),
            "prompts": str(work / "prompts.parquet"), "n_prompts": w["prompts"], "response": w["response"],
            "updates": w["updates"], "out": str(work / "trl.json")}
    r = subprocess.run([python, str(ROOT / "benchmarks" / "peer_trl.py"), json.dumps(spec)], capture_output=True,
                       text=True, cwd=work)
    if r.returncode:
        return {"name": "TRL 1.16 DistillationTrainer", "error": (r.stderr or r.stdout)[-2000:]}
    return json.loads((work / "trl.json").read_text())


def miniverl_peer() -> dict:
    try:
        import miniverl  # noqa: F401
    except ImportError:
        return {"name": "miniVERL 0.16", "error": "miniverl is not importable on this machine: carry its wheel "
                "and pure-Python deps (../shared/device/wheels.sh miniverl==0.16.0 ...) to run it here"}
    return {"name": "miniVERL 0.16", "error": "runner not implemented"}


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
        if wres.get("ratios"):
            lines += ["", "Ratios (peer median s/update ÷ ours): " + ", ".join(f"{k}: {v}x" for k, v in wres["ratios"].items())]
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=("a", "b", "all"), default="all")
    ap.add_argument("--peers", default="trl,miniverl")
    ap.add_argument("--tokenizer", required=True, help="a SmolLM2 tokenizer dir (workload a)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--profile", type=Path, default=None, help="write a torch.profiler table of one step here")
    args = ap.parse_args(argv)
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    result = {"date": dt.date.today().isoformat(), "device": device, "command": " ".join(["python", *sys.argv]),
              "torch": torch.__version__, "workloads": {}}
    work = args.work or Path(tempfile.mkdtemp(prefix="opd-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    peers = [p for p in args.peers.split(",") if p]
    if args.workload in ("a", "all"):
        systems = [ours_pipeline(WORKLOAD_A, work, args.tokenizer, sys.executable, args.profile)]
        # the same pipeline trading one extra forward for update-phase memory
        systems.append(ours_pipeline(WORKLOAD_A, work, args.tokenizer, sys.executable, None,
                                     ("train.activation_checkpointing=true",), "opd-stages-ckpt"))
        if "trl" in peers:
            systems.append(trl_peer(WORKLOAD_A, work, sys.executable))
        if "miniverl" in peers:
            systems.append(miniverl_peer())
        ours = systems[0]["median_update_s"]
        ratios = {s["name"]: round(s["median_update_s"] / ours, 2) for s in systems[1:]
                  if s.get("median_update_s") and not s["name"].startswith("opd-stages")}
        result["workloads"]["a"] = {"shape": WORKLOAD_A, "systems": systems, "ratios": ratios}
        print(json.dumps(result["workloads"]["a"], indent=1), flush=True)
    if args.workload in ("b", "all"):
        result["workloads"]["b"] = {"shape": WORKLOAD_B, "systems": [ours_blocks(WORKLOAD_B)]}
        print(json.dumps(result["workloads"]["b"], indent=1), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = device.replace("NVIDIA ", "").replace(" ", "-").lower()
    stem = args.out / f"{result['date']}-{gpu}-systems"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
