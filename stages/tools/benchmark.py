"""`opd benchmark tooluse CONFIG`: tool-use arms x seeds with an equal optimizer-update budget.

CONFIG (YAML, e.g. conf/benchmark/tooluse.yaml):

    schema_version: 1
    name: cpu-tooluse                   # output files <out_dir>/<name>.json and .md
    out_dir: benchmarks/results
    description: one paragraph for the Markdown
    seeds: [0, 1]
    seed_keys: [sft.seed, train.seed]   # config keys set to the seed in every arm
    updates: 10                         # optimizer updates of every training arm
    base: [env.name=calculator, ...]    # Hydra overrides every arm shares
    arms:
      - {name: cold-start-only, method: none}       # none | sft | opd
      - {name: opd-raw-teacher, method: opd, declare: [teacher_mode], overrides: [teacher_mode=raw]}

An arm may differ from the base config only in the fields it declares: every arm's config is
composed and compared leaf by leaf before any model loads, and an undeclared difference is an
error naming the field (exit 2). The budget, the seed keys and the held-out task fields are the
harness's, never an arm's. One cold start per seed is shared by all arms (it is one store stage);
each (arm, seed) runs in its own process, so its models and allocator are gone before the next
starts and its peak memory is its own. Every stage goes through the store: a re-run reads
finished arms back and only evaluates/aggregates.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .. import tooleval, train
from ..rows import tooluse
from ..run.config import compose, conf_dir, read_yaml, to_dict
from ..errors import UserError
from ..run.store import read_state
from .benchmark_report import write

SCHEMA = "opd-stages/tooluse-benchmark"
SCHEMA_VERSION = 1
METHODS = ("none", "sft", "opd")
TOP_KEYS = {"schema_version", "name", "out_dir", "description", "seeds", "seed_keys", "updates", "base", "arms"}
ARM_KEYS = {"name", "method", "declare", "overrides", "description"}
# fields no arm may vary: the equal budget and the held-out evaluation (same tasks, same limits)
HARNESS_FIELDS = ("train.updates", "env.name", "env.split", "env.num_test", "env.seed", "env.max_turns",
                  "env.max_tokens_per_turn", "run")


# ---- the config file ----

def load(path: str | os.PathLike) -> dict:
    p = Path(path)
    b = read_yaml(p, str(p), "benchmark config")
    for key in b:
        if key not in TOP_KEYS:
            raise UserError(f"{p}: unknown key '{key}'; expected one of {', '.join(sorted(TOP_KEYS))}")
    if b.get("schema_version", SCHEMA_VERSION) != SCHEMA_VERSION:
        raise UserError(f"{p}: key 'schema_version' = {b['schema_version']!r}; expected {SCHEMA_VERSION}")
    for key in ("name", "arms", "updates"):
        if key not in b:
            raise UserError(f"{p}: missing key '{key}'")
    if not isinstance(b["updates"], int) or isinstance(b["updates"], bool) or b["updates"] < 1:
        raise UserError(f"{p}: key 'updates' = {b['updates']!r}; expected a positive integer")
    b.setdefault("seeds", [0])
    b.setdefault("seed_keys", ["sft.seed", "train.seed"])
    b.setdefault("base", [])
    b.setdefault("out_dir", "benchmarks/results")
    b.setdefault("description", "")
    if not b["seeds"] or not all(isinstance(s, int) and not isinstance(s, bool) for s in b["seeds"]):
        raise UserError(f"{p}: key 'seeds' = {b['seeds']!r}; expected a non-empty list of integers")
    for key in ("base", "seed_keys"):
        if not isinstance(b[key], list) or not all(isinstance(x, str) for x in b[key]):
            raise UserError(f"{p}: key '{key}' must be a list of strings")
    if not isinstance(b["arms"], list) or not b["arms"]:
        raise UserError(f"{p}: key 'arms' must be a non-empty list")
    names = set()
    for i, arm in enumerate(b["arms"]):
        where = f"{p}: arms[{i}]"
        if not isinstance(arm, dict):
            raise UserError(f"{where}: expected a mapping")
        for key in arm:
            if key not in ARM_KEYS:
                raise UserError(f"{where}: unknown key '{key}'; expected one of {', '.join(sorted(ARM_KEYS))}")
        if not isinstance(arm.get("name"), str) or not arm["name"] or arm["name"] in names:
            raise UserError(f"{where}: key 'name' must be a unique non-empty string")
        names.add(arm["name"])
        if arm.get("method") not in METHODS:
            raise UserError(f"{where}: key 'method' = {arm.get('method')!r}; expected one of {', '.join(METHODS)}")
        arm.setdefault("declare", [])
        arm.setdefault("overrides", [])
        arm.setdefault("description", "")
        for key in ("declare", "overrides"):
            if not isinstance(arm[key], list) or not all(isinstance(x, str) for x in arm[key]):
                raise UserError(f"{where}: key '{key}' must be a list of strings")
        for field in arm["declare"]:
            if any(field == h or field.startswith(h + ".") or h.startswith(field + ".") for h in
                   (*HARNESS_FIELDS, *b["seed_keys"])):
                raise UserError(f"{where}: arm '{arm['name']}' declares '{field}', which the harness fixes for "
                                "every arm (the update budget, the seeds and the held-out evaluation)")
    b["_path"] = str(p)
    return b


def _leaves(d, prefix="") -> dict:
    if isinstance(d, dict):
        out = {}
        for k, v in d.items():
            out.update(_leaves(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def arm_overrides(b: dict, arm: dict | None, seed: int) -> list[str]:
    ov = [*b["base"], *(arm["overrides"] if arm else []), *(f"{k}={seed}" for k in b["seed_keys"]),
          f"train.updates={b['updates']}"]
    if arm:
        ov.append(f"run=bench-{b['name']}-{arm['name']}-s{seed}")
    return ov


def configs(b: dict) -> dict:
    """{(arm, seed): Config}, after checking every arm differs from the base only where it declares."""
    conf, out = conf_dir(), {}
    for seed in b["seeds"]:
        base = compose(arm_overrides(b, None, seed), conf)
        if base.env.name is None:
            raise UserError(f"{b['_path']}: key 'base' must set env.name (a tool-use benchmark needs an environment)")
        ref = _leaves(to_dict(base))
        out[(None, seed)] = base
        for arm in b["arms"]:
            cfg = compose(arm_overrides(b, arm, seed), conf)
            for key, value in _leaves(to_dict(cfg)).items():
                if key == "run" or value == ref.get(key):
                    continue
                if not any(key == f or key.startswith(f + ".") for f in arm["declare"]):
                    raise UserError(f"{b['_path']}: arm '{arm['name']}' changes field '{key}' ({ref.get(key)!r} -> "
                                    f"{value!r}) without declaring it; add it to the arm's 'declare' or to 'base'")
            out[(arm["name"], seed)] = cfg
    return out


# ---- one (arm, seed), in its own process ----

def _peak(states: list[dict]) -> float | None:
    vals = [s.get("peak_allocated_gib", s.get("peak_rss_gib")) for s in states]
    vals = [v for v in vals if v is not None]
    return max(vals) if vals else None


def run_arm(b: dict, arm: dict, seed: int, cfg) -> dict:
    sess = train.session(cfg)
    before = {p for p in sess.store.root.glob("*/*") if not p.name.startswith(".")}
    U, states, shared = b["updates"], [], {}
    if arm["method"] == "opd":
        train.run(sess)  # publishes policy 0 (the shared cold start) first
        stage, policy = "update", sess.chain.policy(U)
        for k in range(1, U + 1):
            states += [read_state(sess.store.path(n, d)) for n, d in (
                ("rollout", sess.chain.rollout(k)), ("score", sess.chain.score(k)), ("update", sess.chain.update(k)))]
        objective = cfg.objective.name
    elif arm["method"] == "sft":
        stage, policy = train.sft_continued(sess, U)
        states.append(read_state(sess.store.path(stage, policy)))
        objective = "sft-nll"
    else:  # the cold start itself (or the base model when sft.steps = 0)
        train.policy0(sess)
        stage, policy, objective, U = sess.chain.policy_stage(0), sess.chain.policy(0), "none", 0
    if cfg.sft.steps:
        shared["cold_start_seconds"] = read_state(sess.store.path("sft", sess.chain.cold_start())).get("wall_s")
    if cfg.teacher_mode == "protocol_sft":
        tdig = sess.chain.teacher_adapter()
        shared["teacher_sft_seconds"] = read_state(sess.store.path("sft", tdig)).get("wall_s")
        if sess.prepared["teacher"] == sess.prepared["student"]:  # the adapter fits the student: evaluate the teacher too
            m = json.loads((tooleval.run(sess, "sft", tdig) / "eval.json").read_text())
            shared["teacher_success"], shared["teacher_success_lenient"] = m["success"], m["success_lenient"]
    e = tooleval.run(sess, stage, policy)
    metrics = json.loads((e / "eval.json").read_text())
    after = {p for p in sess.store.root.glob("*/*") if not p.name.startswith(".")}
    return {
        "arm": arm["name"], "seed": seed, "method": arm["method"], "objective": objective,
        "teacher_mode": cfg.teacher_mode if arm["method"] == "opd" else None, "updates": U,
        "success": metrics["success"], "success_lenient": metrics["success_lenient"],
        "avg_turns": metrics["avg_turns"], "invalid_call_rate": metrics["invalid_call_rate"],
        "tokens_per_task": metrics["tokens_per_task"],
        "train_seconds": round(sum(s.get("wall_s", 0.0) for s in states), 2),
        "peak_memory_gib": _peak(states + [read_state(e)]), "eval": metrics,
        "failure_attribution": tooleval.attribution(e, tooluse.load_tasks(sess, "test")),
        "shared": shared, "policy": f"{stage}/{policy}", "evaluation": f"tooleval/{e.name}",
        "new_store_entries": len(after - before),
    }


# ---- the harness ----

def main(path: str, arm_name: str | None = None, seed: int | None = None, result: str | None = None) -> dict | None:
    b = load(path)
    cfgs = configs(b)  # every arm checked before any model loads
    if arm_name is not None:  # child mode: one (arm, seed)
        arm = next((a for a in b["arms"] if a["name"] == arm_name), None)
        if arm is None or (arm_name, seed) not in cfgs:
            raise UserError(f"{path}: no arm {arm_name!r} with seed {seed}")
        out = run_arm(b, arm, seed, cfgs[(arm_name, seed)])
        Path(result).write_text(json.dumps(out, indent=1, sort_keys=True))
        return out
    results, t0 = [], time.perf_counter()
    for seed in b["seeds"]:
        for arm in b["arms"]:
            print(f"benchmark {b['name']}: arm {arm['name']} seed {seed}", flush=True)
            with tempfile.TemporaryDirectory() as td:
                res = Path(td) / "result.json"
                cmd = [sys.executable, "-m", "stages.cli", "benchmark", "tooluse", str(path), "--arm", arm["name"],
                       "--seed", str(seed), "--result", str(res)]
                rc = subprocess.run(cmd).returncode
                if rc != 0:
                    raise UserError(f"benchmark arm {arm['name']!r} seed {seed} exited {rc}; finished arms are "
                                    "kept in the store, run the same command again to resume")
                r = json.loads(res.read_text())
            print(f"  strict {r['success']:.3f} lenient {r['success_lenient']:.3f} train {r['train_seconds']:.0f}s "
                  f"({r['new_store_entries']} new store entries)", flush=True)
            results.append(r)
    return write(b, cfgs, results, round(time.perf_counter() - t0, 1))
