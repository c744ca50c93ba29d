"""CPU peer benchmark: our pipeline and miniVERL 0.16 on one identical tiny workload, in one run.

    python benchmarks/cpu_peer.py [--mv-python /work/venv-mv/bin/python] [--out benchmarks/results]

miniVERL (PyPI `miniverl==0.16.0`) lives in its own virtualenv so the project's is untouched:

    python3 -m venv /work/venv-mv
    /work/venv-mv/bin/pip install torch==2.13.0            # the CPU build
    /work/venv-mv/bin/pip install -c <(echo torch==2.13.0) 'miniverl[train,bridge]==0.16.0'

Workload (both sides, one process each, fp32 on CPU, the same thread count): a tiny random Llama
student (conf/arch/tiny-llama.json) and teacher (tiny-llama-teacher.json) with the SmolLM2 tokenizer,
materialised once by our `opd stage prepare` into HF dirs that miniVERL loads as local models;
P prompts per update, each exactly T prompt tokens after the chat template, R sampled response
tokens forced on both sides (random weights may emit EOS), temperature 1, LoRA r16/alpha32 on the 7
projections, verl's direct forward_kl_topk with k=32 (token-mean, log-prob clamp ln 1e-8), AdamW
lr 2e-3, clip 1.0, one optimizer step per update, N updates.

Ours: `opd stage train` in a fresh process (the real pipeline: store, Parquet, adapters and optimizer
state published every step); per update `timings.step_wall_s` of train.json (the whole step
including IO) and per phase `wall_s` of step-*/state.json. It runs twice (before and after the
peer) so that drifting load on this shared CPU does not favour one side; its figure pools both.

miniVERL: `miniverl train RECIPE --offline` (its native recipe schema: run.mode=opd,
loss.mode=forward_kl_topk, source.kind=verl_parquet), run through a small launcher that (1) forces
the response length by passing eos_token_id=-1 to its generation loops (it has no min_new_tokens
option) and (2) times each `OPDTrainer._run_cycle` (one rollout + teacher scoring + update) with
perf_counter; per phase from its metrics.jsonl (rollout_seconds, teacher_scoring_seconds, the
optimizer record's seconds). Its two CPU rollout backends run as two arms: hf_reference (the
default, and what its direct forward_kl_topk profile compiles to) and hf_cached (batched static
KV cache). The headline ratio is against the faster arm.

Medians skip update 1 (warm-up). Writes <out>/<date>-cpu-peer.json and .md.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cpu_peer_report import markdown  # noqa: E402  (benchmarks/ is on sys.path when this runs as a script)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MV_PYTHON = "/work/venv-mv/bin/python"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LOGP_CLAMP = -18.420680743952367  # ln(1e-8): our objective's default, set on both sides


def med(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 4) if xs else None


def run_proc(cmd: list[str], cwd: Path, env: dict, log: Path, timeout: float | None = None) -> dict:
    """Run one process; wall time, exit code and the process's own peak RSS (wait4). Past `timeout`
    seconds it is killed (rc -9, timed_out in the record)."""
    t = time.perf_counter()
    timed_out = False
    with open(log, "w") as fh:
        p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT)
        while True:
            pid, status, usage = os.wait4(p.pid, 0 if timeout is None else os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - t > timeout:
                p.kill()
                timed_out, timeout = True, None  # the next wait4 blocks until it is gone
            else:
                time.sleep(0.2)
        p.returncode = os.waitstatus_to_exitcode(status)
    return {"rc": p.returncode, "wall_s": round(time.perf_counter() - t, 2), **({"timed_out": True} if timed_out else {}),
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
            "peak_rss_gib": round(usage.ru_maxrss / 2**20, 3), "log": str(log)}


def machine_record(threads: int) -> dict:
    """CPU model, the ISA extensions that decide the kernels torch picks, thread counts (from
    /proc/cpuinfo and lscpu where present) and torch's own CPU capability."""
    import torch

    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            if key.strip() == "model name" and model in ("", platform.machine(), platform.processor()):
                model = val.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(val.split())
    except OSError:
        pass
    isa = [f for f in ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                       "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8") if f in flags]
    rec = {"cpu": model, "arch": platform.machine(), "isa": isa, "cpu_count": os.cpu_count(),
           "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
           "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads_per_side": threads}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in lscpu.splitlines():
            key, _, val = line.partition(":")
            if key.strip() in ("Vendor ID", "Model name", "Hypervisor vendor", "Thread(s) per core", "L3 cache"):
                rec.setdefault("lscpu", {})[key.strip()] = val.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return rec


def mv_site_python(site: Path) -> tuple[str, dict]:
    """miniVERL installed with --target into `site` (no deps: it runs on this interpreter's torch,
    transformers and peft, the versions recorded beside the result). Installs it when absent."""
    if not (site / "miniverl" / "__init__.py").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site),
                        "miniverl==0.16.0"], check=True)
    return sys.executable, {"PYTHONPATH": f"{site}:{os.environ.get('PYTHONPATH', '')}"}


def tail(path: Path, n: int = 3000) -> str:
    return Path(path).read_text(errors="replace")[-n:]


# ---------------------------------------------------------------- the shared workload
def exact_length_prompts(tok, n: int, length: int, seed: int = 0) -> list[list[dict]]:
    """Single-turn chat prompts whose templated token count is exactly `length`."""
    words = "amber birch canyon delta ember fjord glacier harbor island jungle kettle lantern".split()
    rng = random.Random(seed)

    def count(text: str) -> int:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      tokenize=True)
        return len(ids["input_ids"] if hasattr(ids, "keys") else ids)

    out = []
    for i in range(n):
        text = f"Question {i}:"
        while count(text) < length:
            text += " " + rng.choice(words)
        while count(text) > length:  # a multi-token word overshot: drop characters
            text = text[:-1]
        if count(text) != length:
            raise RuntimeError(f"cannot build a prompt of exactly {length} tokens (got {count(text)})")
        out.append([{"role": "user", "content": text}])
    return out


def write_prompts(tok, w: dict, work: Path) -> tuple[Path, Path]:
    """verl-schema Parquet: all rows for ours (last 4 held out), the train rows alone for miniVERL."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from stages.rows import tables

    n_train = w["prompts"] * w["updates"]
    msgs = exact_length_prompts(tok, n_train + 4, w["prompt_tokens"])
    rows = [{"data_source": "cpu-peer", "prompt": m, "ability": "chat",
             "reward_model": {"style": "rule", "ground_truth": ""},
             "extra_info": {"split": "train" if i < n_train else "test", "index": i}} for i, m in enumerate(msgs)]
    table = pa.Table.from_pylist(rows, tables.PROMPTS)
    ours, theirs = work / "prompts.parquet", work / "prompts-train.parquet"
    tables.write(ours, table, {"purpose": "cpu-peer benchmark"})
    pq.write_table(table.slice(0, n_train), theirs)
    return ours, theirs


# ---------------------------------------------------------------- ours
def base_overrides(w: dict) -> list[str]:
    return ["student.name=arch:tiny-llama", "student.init=random", "student.keep_layers=0",
            "teacher.name=arch:tiny-llama-teacher", "teacher.init=random",
            "runtime.device=cpu", "runtime.dtype=float32", f"runtime.threads={w['threads']}"]


def workload_overrides(w: dict, prompts: Path) -> list[str]:
    return [*base_overrides(w), f"data.path={prompts}", f"data.num_train={w['prompts'] * w['updates']}",
            "data.num_eval=4", f"data.max_prompt_tokens={w['prompt_tokens']}",
            f"rollout.batch_size={w['prompts']}", "rollout.n=1", f"rollout.max_new_tokens={w['response']}",
            f"rollout.min_new_tokens={w['response']}", "rollout.temperature=1.0", "rollout.top_p=1.0",
            "lora.r=16", "lora.alpha=32", "lora.dropout=0.0",
            f"objective.topk={w['topk']}", f"objective.log_prob_min_clamp={LOGP_CLAMP}",
            "optim.lr=0.002", "optim.max_grad_norm=1.0", "optim.weight_decay=0.0",
            f"train.updates={w['updates']}", "train.chunk=256"]


OURS_LAUNCHER = r'''
"""cpu_peer.py's launcher for `opd stage train`: adds per-update process CPU time (measurement only)."""
import json, sys, time
from stages import cli, rollout, update
out_path, argv = sys.argv[1], sys.argv[2:]
from stages import score
cpu, start, phase_cpu = [], {}, {"rollout": [], "score": [], "update": []}
def timed(mod, name):
    orig = mod.run
    def run(sess, k, *a, **kw):
        c = time.process_time()
        if name == "rollout":
            start[k] = c
        try:
            return orig(sess, k, *a, **kw)
        finally:
            phase_cpu[name].append(round(time.process_time() - c, 4))
            if name == "update":
                cpu.append(round(time.process_time() - start[k], 4))
    mod.run = run
for mod, name in ((rollout, "rollout"), (score, "score"), (update, "update")):
    timed(mod, name)
code = cli.main(argv)
json.dump({"step_cpu_s": cpu, "phase_cpu_s": phase_cpu}, open(out_path, "w"))
sys.exit(code)
'''


def ours(w: dict, work: Path, prompts: Path, env: dict, name: str, artifacts: Path) -> dict:
    argv = ["stage", "train", *workload_overrides(w, prompts), f"run={name}", f"artifacts={artifacts}"]
    launcher, out = work / "ours_launcher.py", work / f"{name}.cpu.json"
    launcher.write_text(OURS_LAUNCHER)
    proc = run_proc([sys.executable, str(launcher), str(out), *argv], work, env, work / f"{name}.log")
    res = {"name": "opd-stages", "run": name, "command": "opd " + " ".join(argv), "process": proc}
    if proc["rc"]:
        res["error"] = tail(work / f"{name}.log")
        return res
    run = artifacts / "runs" / name
    tj = json.loads((run / "train.json").read_text())
    steps = [json.loads((run / f"step-{k:04d}" / "state.json").read_text()) for k in range(1, w["updates"] + 1)]
    walls = tj["timings"]["step_wall_s"]
    res.update({
        "step_wall_s": walls,
        "phases_s": {ph: [s[key]["wall_s"] for s in steps] for ph, key in
                     (("rollout", "rollout"), ("score", "score"), ("update", "policy"))},
        "first_update_incl_construction_s": tj["timings"].get("first_update_s"),
        "peak_rss_gib_per_phase": {ph: max(s[key].get("peak_rss_gib", 0) for s in steps) for ph, key in
                                   (("rollout", "rollout"), ("score", "score"), ("update", "policy"))},
        "response_tokens_per_update": [s["rollout"]["tokens"] for s in steps],
        "losses": [s["policy"]["loss"] for s in steps],
        "cpu_s_per_update": json.loads(out.read_text())["step_cpu_s"] if out.exists() else None,
        # process CPU time of each stage's run (the stage's IO and publishing included)
        "phases_cpu_s": json.loads(out.read_text()).get("phase_cpu_s") if out.exists() else None,
    })
    import pyarrow.parquet as pq

    rows = [r for k in range(1, w["updates"] + 1)
            for r in pq.read_table(run / f"step-{k:04d}" / "rollout.parquet",
                                   columns=["prompt_ids", "response_ids"]).to_pylist()]
    res["prompt_lengths"] = sorted({len(r["prompt_ids"]) for r in rows})
    res["response_lengths"] = sorted({len(r["response_ids"]) for r in rows})
    res["prompt_ids_used"] = sorted(tuple(r["prompt_ids"]) for r in rows)
    return res


# ---------------------------------------------------------------- miniVERL
LAUNCHER = r'''
"""cpu_peer.py's launcher for `miniverl train`: forces the response length, times each cycle."""
import json, os, sys, time
T0 = time.perf_counter()
import torch
torch.set_num_threads(int(os.environ["CPU_PEER_THREADS"]))
out_path, argv = sys.argv[1], sys.argv[2:]
import miniverl.models.hf as hf
def no_eos(fn):
    def wrapped(*a, **kw):
        kw["eos_token_id"] = -1  # never matches a sampled id: every row runs to its token budget
        return fn(*a, **kw)
    return wrapped
for name in ("run_generation", "run_greedy_padded_generation", "run_cached_padded_generation"):
    setattr(hf, name, no_eos(getattr(hf, name)))
from miniverl.training.trainer import OPDTrainer
cycles, marks = [], {}
orig = OPDTrainer._run_cycle
cpu = []
CUDA = torch.cuda.is_available()  # (systems.py drives this launcher on the GPU too)
def timed(self):
    c = time.process_time()
    if CUDA:
        torch.cuda.synchronize()
    t = time.perf_counter()
    marks.setdefault("first_cycle_start_s", t - T0)
    try:
        return orig(self)
    finally:
        if CUDA:
            torch.cuda.synchronize()
        cycles.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        if len(cycles) == 1:
            marks["first_cycle_end_s"] = time.perf_counter() - T0
OPDTrainer._run_cycle = timed
phase_cpu = {"rollout": [], "score": [], "update": []}
def phase_timed(meth, name):  # process CPU of its rollout collection, teacher scoring, optimizer phase
    orig_m = getattr(OPDTrainer, meth)
    def f(self, *a, **kw):
        c = time.process_time()
        try:
            return orig_m(self, *a, **kw)
        finally:
            phase_cpu[name].append(round(time.process_time() - c, 4))
    setattr(OPDTrainer, meth, f)
for meth, name in (("_collect", "rollout"), ("_build_samples", "score"), ("_optimize", "update")):
    phase_cpu[name + "_method"] = meth
    phase_timed(meth, name)
from miniverl.cli import app
code = 0
try:
    ret = app(argv, standalone_mode=False)  # (a handled error returns its exit code)
    code = ret if isinstance(ret, int) else 0
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else 1
except Exception as e:
    import traceback; traceback.print_exc(); code = 1
import importlib.metadata as md
json.dump({"cycle_wall_s": [round(c, 4) for c in cycles], "cycle_cpu_s": [round(c, 4) for c in cpu], "phase_cpu_s": phase_cpu,
           **{k: round(v, 3) for k, v in marks.items()},
           "torch_threads": torch.get_num_threads(), "rc": code,
           **({"cuda_peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
               "cuda_peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3)} if CUDA else {}),
           "versions": {p: md.version(p) for p in ("miniverl", "torch", "transformers", "peft")}},
          open(out_path, "w"))
sys.exit(code)
'''


def recipe(w: dict, student: Path, teacher: Path, prompts: Path, backend: str) -> dict:
    """miniVERL's native RunConfig for the workload (field names from miniverl/config/models.py)."""
    total = w["prompt_tokens"] + w["response"]
    lora = {"enabled": True, "r": 16, "alpha": 32, "dropout": 0.0, "target_modules": LORA_TARGETS}
    return {
        "schema_version": 1,
        "run": {"name": "cpu-peer", "mode": "opd", "seed": 0, "output_dir": "mvruns", "deterministic": True},
        "models": {
            "backend": "hf", "runtime": "dual_model", "device": "cpu",
            "student": {"model_id": str(student), "dtype": "float32", "attn_implementation": "sdpa", "lora": lora},
            "teacher": {"model_id": str(teacher), "dtype": "float32", "attn_implementation": "sdpa",
                        "mode": "standard", "toy_pretrain_steps": 0},
        },
        "source": {"kind": "verl_parquet", "train_files": [str(prompts)], "val_files": [], "prompt_key": "prompt",
                   "max_prompt_length": w["prompt_tokens"], "max_response_length": w["response"],
                   "truncation": "error", "shuffle": False, "seed": 0},
        "rollout": {"backend": backend, "max_turns": 1, "max_new_tokens_per_turn": w["response"],
                    "max_total_tokens": total, "temperature": 1.0, "top_p": 1.0, "samples_per_prompt": 1,
                    "prompt_batch_size": w["prompts"], "max_padded_tokens": total * w["prompts"]},
        "selection": {"selector": "all_model_tokens"},
        "loss": {"mode": "forward_kl_topk", "aggregation": "token-mean", "divergence": "forward_kl",
                 "temperature": 1.0, "scale_by_temperature_squared": False, "top_k": w["topk"],
                 "log_prob_min_clamp": LOGP_CLAMP, "chunk_size": 256, "sampled_token_nll_weight": 0.0},
        # one optimizer step per cycle over the whole batch, in one padded forward (as ours does)
        "train": {"cycles": w["updates"], "rollouts_per_cycle": w["prompts"],
                  "gradient_accumulation_steps": w["prompts"], "trajectory_batch_size": w["prompts"],
                  "learning_rate": 0.002, "weight_decay": 0.0, "max_grad_norm": 1.0, "save_every_cycles": 0},
        "memory": {"strategy": "resident"},
        "cache": {"dtype": "float32", "strict_policy_version": True, "reuse_across_policy_versions": False,
                  "keep_cycles": 1},
        "eval": {"enabled": False, "baseline_enabled": False},
        "report": {"enabled": False},
    }


def miniverl(w: dict, work: Path, mv_python: str, student: Path, teacher: Path, prompts: Path, env: dict,
             backend: str, adjust=None, arm: str | None = None, timeout: float | None = None) -> dict:
    """One miniVERL arm. adjust(recipe) edits the recipe in place (systems.py: cuda, bf16, compile);
    arm names it when one backend runs in two settings."""
    arm = arm or backend
    name = f"miniverl-{arm}"
    res = {"name": f"miniVERL 0.16 ({arm})", "rollout_backend": arm}
    if not Path(mv_python).exists():
        res["error"] = f"{mv_python} does not exist: install miniverl into its own venv (see this file's docstring)"
        return res
    rec = work / f"{name}.recipe.yaml"
    res["recipe"] = recipe(w, student, teacher, prompts, backend)
    if adjust:
        adjust(res["recipe"])
    rec.write_text(json.dumps(res["recipe"], indent=1))  # JSON is YAML
    launcher = work / "mv_launcher.py"
    launcher.write_text(LAUNCHER)
    out = work / f"{name}.timings.json"
    argv = ["train", str(rec), "--offline", "--no-report", "--json", "--output", str(work / "mvruns"),
            "--run-id", name, "--overwrite"]
    res["command"] = f"miniverl {' '.join(argv)}"
    proc = run_proc([mv_python, str(launcher), str(out), *argv], work, env, work / f"{name}.log", timeout)
    res["process"] = proc
    def failed(why: str) -> dict:  # first line: what happened and the log's last line; then the log's tail
        log = tail(work / f"{name}.log")
        last = next((ln for ln in reversed(log.splitlines()) if ln.strip()), "")
        res["error"] = f"{why}: {last.strip()[:200]}\n{log}"
        return res

    if proc["rc"] or not out.exists():
        return failed(f"killed after {timeout:.0f} s" if proc.get("timed_out") else f"exit code {proc['rc']}")
    timing = json.loads(out.read_text())
    run = work / "mvruns" / name
    if timing.get("rc") or not timing["cycle_wall_s"] or not (run / "metrics.jsonl").exists():
        return failed(f"no cycle ran (exit code {timing.get('rc')})")
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    cyc = [m for m in metrics if m.get("phase") == "opd_cycle"]
    opt = [m for m in metrics if m.get("phase") == "opd"]
    trajs = [json.loads(line) for line in (run / "trajectories.jsonl").read_text().splitlines() if line.strip()]
    gen_lens = sorted({sum(1 for g in t["model_generated_mask"] if g) for t in trajs})
    prompt_lens = sorted({t["spans"][0]["end"] for t in trajs})
    per_cycle_opt = {}
    for m in opt:  # one optimizer record per cycle here; sum in case a cycle ever has more
        per_cycle_opt[m["cycle"]] = per_cycle_opt.get(m["cycle"], 0.0) + m["seconds"]
    res.update({
        "step_wall_s": timing["cycle_wall_s"],
        "phases_s": {"rollout": [m["rollout_seconds"] for m in cyc],
                     "score": [m["teacher_scoring_seconds"] for m in cyc],
                     "update": [round(per_cycle_opt.get(m["cycle"], 0.0), 4) for m in cyc]},
        "own_cycle_seconds": [m["seconds"] for m in cyc],
        "first_update_incl_construction_s": timing.get("first_cycle_end_s"),
        "construction_s": timing.get("first_cycle_start_s"),
        "torch_threads": timing.get("torch_threads"), "versions": timing.get("versions"),
        "optimizer_steps": len(opt),
        "response_tokens_per_update": [m["rollouts"]["generated_tokens"] for m in cyc],
        "losses": [m.get("loss") for m in opt],
        "prompt_lengths": prompt_lens, "response_lengths": gen_lens,
        "prompt_ids_used": sorted(tuple(t["token_ids"][: t["spans"][0]["end"]]) for t in trajs),
        "cpu_s_per_update": timing.get("cycle_cpu_s"),
        # process CPU of OPDTrainer._collect / _build_samples / _optimize per cycle (launcher-measured)
        "phases_cpu_s": {ph: v for ph, v in (timing.get("phase_cpu_s") or {}).items() if not ph.endswith("_method")},
        **{k: timing[k] for k in ("cuda_peak_allocated_gib", "cuda_peak_reserved_gib") if k in timing},
    })
    return res


# ---------------------------------------------------------------- summary
def summarize(s: dict) -> None:
    if "error" in s:
        return
    tail_ = lambda xs: xs[1:] if len(xs) > 1 else xs  # noqa: E731  (update 1 is warm-up)
    s["median_update_s"] = med(tail_(s["step_wall_s"]))
    s["median_phase_s"] = {ph: med(tail_(v)) for ph, v in s["phases_s"].items()}
    s["median_cpu_s_per_update"] = med(tail_(s["cpu_s_per_update"])) if s.get("cpu_s_per_update") else None
    if s.get("phases_cpu_s"):
        s["median_phase_cpu_s"] = {ph: med(tail_(v)) for ph, v in s["phases_cpu_s"].items() if v}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4, help="prompts per update")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--response", type=int, default=32, help="response tokens (forced on both sides)")
    ap.add_argument("--updates", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mv-python", default=DEFAULT_MV_PYTHON, help="python of the venv holding miniverl")
    ap.add_argument("--mv-site", type=Path, default=Path("/tmp/mvsite"),
                    help="without --mv-python's venv: miniverl installed (--no-deps --target) here, run on this python")
    ap.add_argument("--tag", default="", help="suffix of the result files (<date>-cpu-peer<-tag>.json/.md)")
    ap.add_argument("--mv-backends", default="hf_reference,hf_cached")
    ap.add_argument("--no-repeat-ours", action="store_true", help="run ours once (before the peer) only")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    w = {"prompts": args.prompts, "prompt_tokens": args.prompt_tokens, "response": args.response,
         "updates": args.updates, "topk": 32, "threads": args.threads}
    work = (args.work or Path(tempfile.mkdtemp(prefix="opd-cpu-peer-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    for old in ("artifacts", "artifacts-b", "mvruns"):  # a reused --work dir: nothing may be reused from it
        shutil.rmtree(work / old, ignore_errors=True)
    (work / "conf").unlink(missing_ok=True)
    (work / "conf").symlink_to(ROOT / "conf")
    th = str(args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": th, "MKL_NUM_THREADS": th, "CPU_PEER_THREADS": th,
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    mv_env = env
    if not Path(args.mv_python).exists() and args.mv_backends:
        args.mv_python, extra = mv_site_python(args.mv_site)
        mv_env = {**env, **extra, "PYTHONPATH": f"{args.mv_site}:{env['PYTHONPATH']}"}
    started = time.perf_counter()
    load0 = os.getloadavg()
    loads = {"start": [round(x, 2) for x in load0]}
    print(f"work dir {work}", flush=True)

    # 1. models (random weights, SmolLM2 tokenizer) as HF dirs, through our prepare stage; untimed
    prep = run_proc([sys.executable, "-m", "stages.cli", "stage", "prepare", *base_overrides(w)], work, env,
                    work / "prepare-models.log")
    if prep["rc"]:
        raise SystemExit(f"prepare failed:\n{tail(work / 'prepare-models.log')}")
    digests = json.loads((work / "artifacts" / "runs" / "default" / "prepare.json").read_text())
    student = work / "artifacts" / "store" / "model" / digests["student"]
    teacher = work / "artifacts" / "store" / "model" / digests["teacher"]
    from transformers import AutoTokenizer

    ours_prompts, mv_prompts = write_prompts(AutoTokenizer.from_pretrained(student), w, work)
    prep2 = run_proc([sys.executable, "-m", "stages.cli", "stage", "prepare", *workload_overrides(w, ours_prompts)],
                     work, env, work / "prepare-prompts.log")
    if prep2["rc"]:
        raise SystemExit(f"prepare (prompts) failed:\n{tail(work / 'prepare-prompts.log')}")

    # ours runs twice; the store is content-addressed, so the second run gets its own store holding only
    # what prepare made (models, tokenizer, prompts): it recomputes every rollout/score/update
    if not args.no_repeat_ours:
        shutil.rmtree(work / "artifacts-b", ignore_errors=True)
        shutil.copytree(work / "artifacts" / "store", work / "artifacts-b" / "store", symlinks=True)

    # 2. back to back: ours, each miniVERL arm, ours again
    systems = []
    print("ours (1) ...", flush=True)
    systems.append(ours(w, work, ours_prompts, env, "ours-a", work / "artifacts"))
    for backend in [b for b in args.mv_backends.split(",") if b]:
        print(f"miniverl ({backend}) ...", flush=True)
        loads[f"before miniverl-{backend}"] = [round(x, 2) for x in os.getloadavg()]
        systems.append(miniverl(w, work, args.mv_python, student, teacher, mv_prompts, mv_env, backend))
    if not args.no_repeat_ours:
        print("ours (2) ...", flush=True)
        loads["before ours (2)"] = [round(x, 2) for x in os.getloadavg()]
        systems.append(ours(w, work, ours_prompts, env, "ours-b", work / "artifacts-b"))
    for s in systems:
        summarize(s)

    # 3. identical-workload checks and the comparison
    ok_ours = [s for s in systems if s["name"] == "opd-stages" and "error" not in s]
    ok_mv = [s for s in systems if s["name"].startswith("miniVERL") and "error" not in s]
    checks = {}
    if ok_ours and ok_mv:
        o = ok_ours[0]
        # ours draws the rows in a seeded shuffled order, miniVERL (shuffle: false) in file order; over the
        # run both consume every training row once, tokenized to the same ids
        checks["same prompt token ids over the run (as a multiset)"] = all(
            s["prompt_ids_used"] == o["prompt_ids_used"] for s in ok_ours + ok_mv)
        checks["prompt lengths"] = (f"ours {sorted({n for x in ok_ours for n in x['prompt_lengths']})}, "
                                    f"miniVERL {sorted({n for x in ok_mv for n in x['prompt_lengths']})}")
        checks["response lengths"] = (f"ours {sorted({n for x in ok_ours for n in x['response_lengths']})}, "
                                      f"miniVERL {sorted({n for x in ok_mv for n in x['response_lengths']})}")
        checks["optimizer steps"] = f"ours {len(o['step_wall_s'])}, miniVERL {[x['optimizer_steps'] for x in ok_mv]}"
    for s in systems:
        s.pop("prompt_ids_used", None)
    comparison = {}
    if ok_ours and ok_mv:
        pooled = [t for s in ok_ours for t in s["step_wall_s"][1:]]
        ours_med = med(pooled)
        ours_ph = {ph: med([t for s in ok_ours for t in s["phases_s"][ph][1:]]) for ph in ("rollout", "score", "update")}
        best = min(ok_mv, key=lambda s: s["median_update_s"])
        comparison = {"ours_median_update_s": ours_med, "ours_runs": len(ok_ours), "ours_median_phase_s": ours_ph,
                      "miniverl_arm": best["rollout_backend"], "miniverl_median_update_s": best["median_update_s"],
                      "miniverl_median_phase_s": best["median_phase_s"],
                      "ratio_ours_over_miniverl": round(ours_med / best["median_update_s"], 3),
                      "ratios_per_arm": {s["rollout_backend"]: round(ours_med / s["median_update_s"], 3) for s in ok_mv},
                      "per_phase_ratio_vs_that_arm": {ph: round(ours_ph[ph] / best["median_phase_s"][ph], 3)
                                                      if best["median_phase_s"][ph] else None for ph in ours_ph},
                      "target": "ours <= 0.5x miniVERL"}
        ours_cpu = med([t for s in ok_ours for t in (s.get("cpu_s_per_update") or [])[1:]])
        comparison["ours_median_cpu_s_per_update"] = ours_cpu
        comparison["cpu_ratios_per_arm"] = {s["rollout_backend"]: round(ours_cpu / s["median_cpu_s_per_update"], 3)
                                            for s in ok_mv if ours_cpu and s.get("median_cpu_s_per_update")}
        cpu_best = min((s for s in ok_mv if s.get("median_cpu_s_per_update")),
                       key=lambda s: s["median_cpu_s_per_update"], default=None)
        if cpu_best and all(s.get("phases_cpu_s") for s in ok_ours) and cpu_best.get("median_phase_cpu_s"):
            ours_ph_cpu = {ph: med([t for s in ok_ours for t in s["phases_cpu_s"][ph][1:]]) for ph in ("rollout", "score", "update")}
            comparison["ours_median_phase_cpu_s"] = ours_ph_cpu
            comparison["cpu_miniverl_arm"] = cpu_best["rollout_backend"]
            comparison["per_phase_cpu_ratio_vs_that_arm"] = {
                ph: round(ours_ph_cpu[ph] / cpu_best["median_phase_cpu_s"][ph], 3)
                if cpu_best["median_phase_cpu_s"].get(ph) else None for ph in ours_ph_cpu}
        comparison["target_met"] = comparison["ratio_ours_over_miniverl"] <= 0.5
        # against miniVERL's arm using the least CPU (the largest of the per-arm ratios)
        comparison["cpu_target_met"] = bool(comparison["cpu_ratios_per_arm"]) and max(comparison["cpu_ratios_per_arm"].values()) <= 0.5
    else:
        errs = [f"{s['name']}: {s['error'][-400:]}" for s in systems if "error" in s]
        comparison = {"ratio_ours_over_miniverl": None, "why": " | ".join(errs) or "no successful run"}

    import torch
    import transformers
    import peft

    mv_versions = next((s["versions"] for s in ok_mv), {})
    result = {
        "date": dt.date.today().isoformat(),
        "command": " ".join(["python", os.path.relpath(__file__, Path.cwd()) if Path(__file__).is_relative_to(Path.cwd())
                             else __file__, *(argv if argv is not None else sys.argv[1:])]),
        "machine": {**machine_record(args.threads),
                    "loadavg_start": [round(x, 2) for x in load0],
                    "loadavg_end": [round(x, 2) for x in os.getloadavg()],
                    "loadavg_during": {**loads, "end": [round(x, 2) for x in os.getloadavg()]}},
        "workload": {**w, "student": "arch:tiny-llama (random)", "teacher": "arch:tiny-llama-teacher (random)",
                     "tokenizer": "SmolLM2 (embedded)", "dtype": "float32", "device": "cpu",
                     "lora": {"r": 16, "alpha": 32, "targets": LORA_TARGETS}, "objective": "forward_kl_topk",
                     "log_prob_min_clamp": LOGP_CLAMP, "lr": 0.002, "max_grad_norm": 1.0, "temperature": 1.0,
                     "student_dir_digest": digests["student"], "teacher_dir_digest": digests["teacher"]},
        "versions": {"opd-stages torch": torch.__version__, "opd-stages transformers": transformers.__version__,
                     "opd-stages peft": peft.__version__, "python": platform.python_version(),
                     **{f"miniVERL-venv {k}": v for k, v in mv_versions.items()}},
        "systems": systems,
        "comparison": comparison,
        "checks": checks,
        "deviations": [
            "miniVERL has no min_new_tokens: its generation loops get eos_token_id=-1 through a launcher "
            "(same length forcing as our rollout.min_new_tokens; no other change to its code).",
            "Time per update: ours = train.json step_wall_s (the whole step incl. publishing Parquet, adapter "
            "and optimizer state to the store); miniVERL = wall of OPDTrainer._run_cycle (rollout, teacher "
            "scoring incl. its teacher-target cache, update, trajectory/metrics JSONL); miniVERL writes no "
            "checkpoint between cycles at save_every_cycles=0, ours publishes one every step.",
            "miniVERL's update runs the whole batch in one padded forward like ours (trajectory_batch_size = "
            "prompts per update; its default is 1). Everything else in its recipe is as its direct "
            "forward_kl_topk profile compiles it (dual_model resident, verl_parquet source, token-mean) with "
            "device cpu and float32; eval and report are off on both sides.",
            "Ours runs `opd stage train` through a launcher that calls stages.cli.main unchanged and only "
            "records process CPU time around each step (rollout start to update end).",
            "Ours runs twice (before and after the peer) on separate stores, because a content-addressed "
            "second run in the same store would recompute nothing; its median pools both runs.",
        ],
        "work_dir": str(work),
        "driver_wall_s": round(time.perf_counter() - started, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{result['date']}-cpu-peer{'-' + args.tag if args.tag else ''}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
