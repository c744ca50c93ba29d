"""The benchmark's outputs: versioned-schema JSON and a Markdown table (stages/tools/benchmark.py runs it).

JSON: schema/schema_version, the benchmark config as given, the resolved base config of seed 0,
machine and library versions, one record per (arm, seed), per-arm means over seeds, and the
failure attribution. Means over two seeds are descriptive only: no significance is claimed.
"""
from __future__ import annotations

import os
import platform
from pathlib import Path

from ..run.config import to_dict
from ..weights.models import env_versions
from ..run.store import write_json

COLS = [("arm", "arm"), ("seed", "seed"), ("objective", "objective"), ("updates", "updates"),
        ("success", "strict success"), ("success_lenient", "lenient success"), ("avg_turns", "avg turns"),
        ("invalid_call_rate", "invalid-call rate"), ("tokens_per_task", "tokens/task"),
        ("train_seconds", "train s"), ("peak_memory_gib", "peak mem GiB")]
MEAN_KEYS = ("success", "success_lenient", "avg_turns", "invalid_call_rate", "tokens_per_task", "train_seconds")


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def means(b: dict, results: list[dict]) -> list[dict]:
    out = []
    for arm in b["arms"]:
        rs = [r for r in results if r["arm"] == arm["name"]]
        if not rs:
            continue
        m = {"arm": arm["name"], "method": arm["method"], "objective": rs[0]["objective"], "updates": rs[0]["updates"],
             "seeds": [r["seed"] for r in rs]}
        for k in MEAN_KEYS:
            m[k] = round(sum(r[k] for r in rs) / len(rs), 4)
        m["per_seed_success"] = [r["success"] for r in rs]
        out.append(m)
    return out


def machine(threads: int) -> dict:
    return {**env_versions(), "cpu_count": os.cpu_count(), "torch_threads": threads or "default",
            "node": platform.node(), "code": code_revision()}


def code_revision() -> str | None:
    """The git commit the result was computed with ('+dirty' when tracked files were modified)."""
    import subprocess

    root = Path(__file__).resolve().parents[2]  # stages/tools/ -> the repository
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (rev + ("+dirty" if dirty else "")) or None


def markdown(doc: dict) -> str:
    b, base = doc["benchmark"], doc["base_config"]
    env, st, te = base["env"], base["student"], base["teacher"]
    lines = [f"# Tool-use benchmark `{b['name']}`", ""]
    if b.get("description"):
        lines += [b["description"].strip(), ""]
    lines += [
        f"Reproduce: `{doc['command']}` (schema `{doc['schema']}` v{doc['schema_version']}).",
        f"Environment `{env['name']}` split `{env['split']}`: {env['num_train']} training tasks, "
        f"{env['num_test']} held-out tasks (greedy, max {env['max_turns']} turns x {env['max_tokens_per_turn']} "
        f"tokens). Student `{st['name']}` (keep_layers {st['keep_layers']}), teacher `{te['name']}` "
        f"(keep_layers {te['keep_layers']}); LoRA r {base['lora']['r']}; cold start {base['sft']['steps']} SFT steps; "
        f"protocol-SFT teacher {base['sft']['teacher_steps']} SFT steps; {b['updates']} optimizer updates per "
        f"training arm; seeds {b['seeds']}.",
        f"Machine: {doc['machine'].get('device')} ({doc['machine'].get('cpu_count')} CPUs, torch threads "
        f"{doc['machine'].get('torch_threads')}), torch {doc['machine'].get('torch')}, code {doc['machine'].get('code') or '?'}; harness wall "
        f"{doc['wall_seconds']:.0f} s.", "",
        "| " + " | ".join(h for _, h in COLS) + " |", "|" + "---|" * len(COLS)]
    for r in doc["results"]:
        lines.append("| " + " | ".join(_fmt(r[k]) for k, _ in COLS) + " |")
    lines += ["", "Mean over seeds (descriptive; two seeds support no significance claim):", "",
              "| arm | objective | updates | strict success | lenient success | per-seed strict | avg turns | "
              "invalid-call rate | tokens/task |", "|---|---|---|---|---|---|---|---|---|"]
    for m in doc["means"]:
        lines.append(f"| {m['arm']} | {m['objective']} | {m['updates']} | {_fmt(m['success'])} | "
                     f"{_fmt(m['success_lenient'])} | {', '.join(_fmt(x) for x in m['per_seed_success'])} | "
                     f"{_fmt(m['avg_turns'])} | {_fmt(m['invalid_call_rate'])} | {_fmt(m['tokens_per_task'])} |")
    lines += ["", "Failure attribution over strictly failed held-out tasks (from the stored trajectories): "
              "presentational = the right value was produced but not delivered as a strict final answer; "
              "substantive = the right value never appears.", "",
              "| arm | seed | failures | presentational | substantive | reasons |", "|---|---|---|---|---|---|"]
    for r in doc["results"]:
        fa = r["failure_attribution"]
        reasons = ", ".join(f"{k} {v}" for k, v in fa["reasons"].items()) or "-"
        lines.append(f"| {r['arm']} | {r['seed']} | {fa['failures']} | {fa['presentational']} | {fa['substantive']} | "
                     f"{reasons} |")
    shared = {}
    for r in doc["results"]:
        for k, v in r["shared"].items():
            shared.setdefault(f"{k} (seed {r['seed']})" if k == "cold_start_seconds" else k, v)
    if "teacher_success" in shared:
        lines += ["", f"The protocol-SFT teacher itself (base + its adapter, greedy, same held-out tasks): strict "
                      f"{_fmt(shared.pop('teacher_success'))}, lenient {_fmt(shared.pop('teacher_success_lenient'))}."]
    if shared:
        lines += ["", "Shared stages (computed once, reused by every arm that needs them): " +
                  "; ".join(f"{k} {_fmt(v)}" for k, v in sorted(shared.items())) + "."]
    return "\n".join(lines) + "\n"


def write(b: dict, cfgs: dict, results: list[dict], wall: float) -> dict:
    seed0 = b["seeds"][0]
    base_cfg = cfgs[(None, seed0)]
    bench = {k: v for k, v in b.items() if not k.startswith("_")}
    doc = {
        "schema": "opd-stages/tooluse-benchmark", "schema_version": 1, "benchmark": bench,
        "command": f"opd benchmark tooluse {b['_path']}", "base_config": to_dict(base_cfg), "machine": machine(base_cfg.runtime.threads),
        "wall_seconds": wall, "results": results, "means": means(b, results),
    }
    out = Path(b["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / f"{b['name']}.json", doc)
    (out / f"{b['name']}.md").write_text(markdown(doc))
    print(f"benchmark {b['name']}: wrote {out / (b['name'] + '.json')} and .md")
    return doc
