"""tooleval: greedy multi-turn episodes of one student policy on the environment's held-out tasks,
and the failure attribution the benchmark reads back from the stored trajectories.

Content-addressed ("tooleval" in the store) by the policy's digest, the held-out task rows and the
turn limits, so a benchmark re-run reads finished evaluations back instead of sampling again.
Writes eval.json (aggregate metrics), trajectories.parquet (one row per task: tokens, masks, the
episode's messages as JSON and its per-task counters) and state.json.

Failure attribution, per strictly failed task (strict scoring is primary; lenient is a diagnostic):
- presentational: the substance was there, the delivery was not. `lenient-only` (the final answer
  is right up to format: units, a trailing period, an <answer> tag) or `answer-reached-not-delivered`
  (the right value appears in the model's turns or a tool result, but no strict final answer).
- substantive: the right value never appears. `no-valid-action` (no turn held a well-formed tool
  call or final answer), `wrong-final-answer`, or `out-of-turns` (valid actions, no final answer).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa

from . import envs
from .rows import tables, tooluse
from .run.store import write_json
from .envs import protocol
from .session import Session, phase

_NUM = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?")


def summarize(rows: list[dict]) -> dict:
    n = max(1, len(rows))
    attempted = sum(r["attempted_calls"] for r in rows)
    return {
        "tasks": len(rows),
        "success": round(sum(r["success"] for r in rows) / n, 6),
        "success_lenient": round(sum(r["success_lenient"] for r in rows) / n, 6),
        "avg_turns": round(sum(r["turns"] for r in rows) / n, 4),
        "tool_calls_per_task": round(sum(r["tool_calls"] for r in rows) / n, 4),
        "invalid_calls": int(sum(r["invalid_calls"] for r in rows)),
        "attempted_calls": int(attempted),
        # failed calls (malformed JSON, unknown tool, an error result) per attempted call
        "invalid_call_rate": round(sum(r["invalid_calls"] for r in rows) / attempted, 6) if attempted else 0.0,
        "parse_errors_per_task": round(sum(r["parse_errors"] for r in rows) / n, 4),
        "tokens_per_task": round(sum(sum(r["response_mask"]) for r in rows) / n, 2),  # model tokens only
    }


def run(sess: Session, stage: str, policy: str) -> Path:
    """Evaluate the student adapter published by (stage, policy) on the held-out tasks."""
    dig = sess.chain.tooleval(stage, policy)

    def produce(tmp: Path) -> None:
        cfg, tok = sess.cfg, sess.models.tokenizer()
        env = envs.get(cfg.env.name)
        tasks = tooluse.load_tasks(sess, "test")
        sess.models.use_adapter(stage, policy)
        state: dict = {"stage": "tooleval", "digest": dig, "policy": policy}
        with phase(sess.device, state) as ph:
            trajs = tooluse.run_episodes(sess, env, tasks, cfg.env.max_turns, cfg.env.max_tokens_per_turn, seed=0,
                                         greedy=True)
            ph["tokens"] = sum(sum(t.mask) for t in trajs)
        rows = [{"uid": f"eval-{i:05d}", "prompt_index": i, "data_source": envs.data_source(cfg.env.name, t.task.split),
                 "prompt_ids": t.prompt, "response_ids": t.resp, "response_mask": t.mask,
                 "finish_reason": t.ep.finish_reason, "response_text": tok.decode(t.resp),
                 "messages": json.dumps(t.ep.messages, ensure_ascii=False), **tooluse.task_columns(t)}
                for i, t in enumerate(trajs)]
        metrics = summarize(rows)
        write_json(tmp / "eval.json", metrics)
        tables.write(tmp / "trajectories.parquet", pa.Table.from_pylist(rows), {"digest": dig, "env": cfg.env.name})
        write_json(tmp / "state.json", {**state, "success": metrics["success"]})

    d, _ = sess.store.ensure("tooleval", dig, produce)
    return d


def main(sess: Session, k: int) -> dict:
    """`opd tooleval [--step N]`: policy k (published) on the held-out tasks."""
    d = run(sess, sess.chain.policy_stage(k), sess.chain.policy(k))
    m = json.loads((d / "eval.json").read_text())
    print(f"tooleval policy {k}: strict {m['success']:.3f} lenient {m['success_lenient']:.3f} over {m['tasks']} "
          f"held-out tasks, {m['avg_turns']:.2f} turns, invalid-call rate {m['invalid_call_rate']:.3f} ({d})")
    return m


# ---- failure attribution ----

def _mentions(truth: str, text: str) -> bool:
    try:
        want = float(truth.replace(",", ""))
    except ValueError:
        return " ".join(truth.casefold().split()) in " ".join(text.casefold().split())
    for m in _NUM.findall(text):
        try:
            if abs(float(m.replace(",", "")) - want) <= 0.01 + 1e-9 * abs(want):
                return True
        except ValueError:
            continue
    return False


def attribute(row: dict, truth: str) -> tuple[str | None, str | None]:
    """(class, reason) of one evaluated task; (None, None) on strict success."""
    if row["success"]:
        return None, None
    if row["success_lenient"]:
        return "presentational", "lenient-only"
    turns = json.loads(row["messages"])[2:]  # after the system and user messages
    if any(_mentions(truth, m["content"]) for m in turns):
        return "presentational", "answer-reached-not-delivered"
    actions = [protocol.parse(m["content"]) for m in turns if m["role"] == "assistant"]
    if not any(a.kind in ("tool_call", "final") for a in actions):
        return "substantive", "no-valid-action"
    if row["answer"] is not None:
        return "substantive", "wrong-final-answer"
    return "substantive", "out-of-turns"


def attribution(eval_dir: Path, tasks: list) -> dict:
    """Counts per class and reason over the stored trajectories of one evaluation."""
    t = tables.read(eval_dir / "trajectories.parquet")
    truth = {task.uid: task.ground_truth for task in tasks}
    out: dict = {"failures": 0, "presentational": 0, "substantive": 0, "reasons": {}}
    for row in t.to_pylist():
        cls, why = attribute(row, truth[row["task_uid"]])
        if cls is None:
            continue
        out["failures"] += 1
        out[cls] += 1
        out["reasons"][why] = out["reasons"].get(why, 0) + 1
    out["reasons"] = dict(sorted(out["reasons"].items()))
    return out
