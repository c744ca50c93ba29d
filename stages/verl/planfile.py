"""plan.json for `opd plan --profile` and `opd run --plan`: the mapping, the resolved config, a digest.

The plan records what was asked (profile, config, --set, --accept, our overrides), what it maps to
(our Hydra overrides and the resolved config) and the weight-free memory plan's estimate
(stages/memory/plan.py); an infeasible estimate is written, then refused. `digest`
is the sha256 of the canonical JSON of everything else, so `opd run --plan` refuses a plan edited
after planning; it also recomposes the config from the recorded overrides and refuses to run if
conf/ has changed since (the plan would be stale).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Optional

from ..run import config as config_mod
from ..run import files
from ..memory import plan as memory_planner
from ..errors import UserError
from ..memory.shapes import shape_of
from ..tools import probe as memory_probe
from . import mapping

SCHEMA = "opd-plan/1"


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def content_digest(plan: dict) -> str:
    return hashlib.sha256(canonical({k: v for k, v in plan.items() if k != "digest"})).hexdigest()


def memory_plan(cfg) -> dict:
    """The weight-free memory plan of `cfg` (stages/memory/plan.py)."""
    return memory_planner.estimate(cfg)


def make(profile: str, config: str, sets: list[str], accept: list[str], overrides: list[str],
         conf_dir: Optional[Path] = None, probe: bool = False) -> dict:
    mapped, report = mapping.map_profile(profile, config, sets, accept)
    all_overrides = mapped + list(overrides)
    cfg = config_mod.compose(all_overrides, conf_dir)
    mem = memory_plan(cfg)
    _check_vocab(cfg, mem, report)
    if probe and mem["feasible"]:  # measured peaks beside the estimate (CUDA)
        mem["probe"] = memory_probe.run(cfg, mem)
    plan = {
        "schema": SCHEMA,
        "profile": profile,
        "config": config,
        "config_sha256": None if config.startswith("builtin:") else files.sha256(Path(config)),
        "sets": list(sets),
        "accept": list(accept),
        "mapped_overrides": mapped,
        "user_overrides": list(overrides),
        "overrides": all_overrides,
        "resolved": dataclasses.asdict(cfg),
        "mapping": report,
        "memory": mem,
        "memory_status": "feasible" if mem["feasible"] else "infeasible",
    }
    plan["digest"] = content_digest(plan)
    return plan


def _check_vocab(cfg, mem: dict, report: dict) -> None:
    """top-k larger than the vocabulary, caught at plan time (weight-free: config files only)."""
    vocab = mem.get("models", {}).get("student", {}).get("vocab")
    if vocab is None:
        try:
            vocab = shape_of(cfg.student, "student").vocab
        except UserError:
            return  # the model's config is not readable here: prepare checks it before any work
    if cfg.objective.topk > vocab:
        src = next((e["field"] for e in report["fields"] if "objective.topk" in e["ours"]), "objective.topk")
        raise UserError(f"verl field '{src}' = {cfg.objective.topk} (objective.topk) is larger than the "
                        f"student's vocabulary ({vocab})")


def write(plan: dict, out: Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(plan, indent=1, sort_keys=True, allow_nan=False) + "\n")
    os.replace(tmp, out)
    return out


def load(path: Path, conf_dir: Optional[Path] = None):
    """(plan, Config) from a plan file; UserError if it was edited or conf/ changed since planning."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: plan file not found; make one with `opd plan --profile NAME --config ... --out {p}`")
    try:
        plan = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{p}: not a plan file (invalid JSON at line {e.lineno})") from None
    if not isinstance(plan, dict) or plan.get("schema") != SCHEMA:
        raise UserError(f"{p}: not a plan file (expected schema {SCHEMA!r})")
    if plan.get("digest") != content_digest(plan):
        raise UserError(f"{p}: edited after planning (digest mismatch); run `opd plan` again instead of editing it")
    if plan.get("memory_status") == "infeasible":
        raise UserError(f"{p}: the memory plan is infeasible (peak {plan['memory'].get('peak_gib')} GiB > "
                        f"{plan['memory'].get('usable_gib')} GiB usable); plan again with other settings")
    cfg = config_mod.compose(plan["overrides"], conf_dir)
    now = dataclasses.asdict(cfg)
    if now != plan["resolved"]:
        key = _first_difference(plan["resolved"], now)
        raise UserError(f"{p}: conf/ changed since planning (key '{key}' differs); run `opd plan` again")
    return plan, cfg


def _first_difference(a: Any, b: Any, prefix: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else k)
    return prefix or "?"
