"""Tool-use environments: a registry of small modules with one plain-function API each.

    SPLITS                                  environment splits, e.g. ("easy", "medium", "hard")
    generate(split, n, seed, part)          -> list[Task]; deterministic; part "train" | "test",
                                               disjoint by construction (task.py says how)
    system_prompt(task)                     -> str: the tools and the protocol
    call_tool(task, name, arguments)        -> JSON-serialisable dict, {"error": ...} on bad input;
                                               never raises for model-controlled input
    oracle_trace(task)                      -> assistant/tool messages that solve the task
    verify(task, answer)                    -> bool, strict
    verify_lenient(task, text)              -> bool, diagnostic only (reported beside strict)

`protocol` holds the text protocol and the multi-turn driver `run_episode`; `to_verl_rows` /
`from_verl_row` convert tasks to and from rows in verl's Parquet schema.
"""
from __future__ import annotations

import json
from typing import Any

from ..errors import UserError
from . import calculator, jsonnav, protocol, sqlite
from .task import PARTS, Task

REGISTRY = {
    "calculator": calculator,
    "jsonnav": jsonnav,
    "sqlite": sqlite,
}

__all__ = ["REGISTRY", "Task", "from_verl_row", "get", "protocol", "to_verl_rows"]


def get(name: str):
    if not isinstance(name, str) or name not in REGISTRY:
        raise UserError(f"key 'env.name' = {name!r}; expected one of {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def data_source(env_name: str, env_split: str) -> str:
    return f"opd/{env_name}-{env_split}"


def to_verl_rows(env_name: str, tasks: list[Task], split: str) -> list[dict]:
    """Rows in verl's RL dataset schema. `split` is the dataset part ("train" | "test"); the
    environment split comes from each task. The context is a JSON string so that Arrow sees one
    string column instead of a per-environment nested struct."""
    env = get(env_name)
    if split not in PARTS:
        raise UserError(f"key 'split' = {split!r}; expected one of {', '.join(PARTS)}")
    rows = []
    for i, task in enumerate(tasks):
        if task.env != env_name or task.part != split:
            # mixing parts would leak test tasks into training; this is a caller bug, not user input
            raise ValueError(f"task {task.uid} is {task.env}/{task.part}, not {env_name}/{split}")
        rows.append({
            "data_source": data_source(env_name, task.split),
            "prompt": protocol.initial_messages(env, task),
            "ability": "tool_use",
            "reward_model": {"style": "rule", "ground_truth": task.ground_truth},
            "extra_info": {
                "split": split,
                "index": i,
                "uid": task.uid,
                "env": env_name,
                "env_split": task.split,
                "context": json.dumps(task.context, ensure_ascii=False),  # key order kept: `keys` shows it
                "oracle_hint": task.oracle_hint,
                "question": task.question,
            },
        })
    return rows


def from_verl_row(row: dict[str, Any]) -> Task:
    """Rebuild the Task of a row written by to_verl_rows (e.g. read back from Parquet)."""
    info = row["extra_info"]
    get(info["env"])
    return Task(uid=info["uid"], env=info["env"], split=info["env_split"], part=info["split"],
                question=info["question"], context=json.loads(info["context"]),
                ground_truth=row["reward_model"]["ground_truth"], oracle_hint=info["oracle_hint"])
