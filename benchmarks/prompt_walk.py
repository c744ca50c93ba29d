"""Host cost per rollout step of walking a large prompt set: which prompts batch k takes
(`prompts.batch_indices`) and turning their rows into Python (the rollout's inputs). What the code
does now against what it did before (reproduced here): one shuffle per epoch against one per prompt
drawn, and the batch's rows against whole columns. 50,000 verl-schema prompt rows, batches of 64. CPU.

    python benchmarks/prompt_walk.py   # -> benchmarks/results/<date>-prompt-walk-cpu.{json,md}
"""
from __future__ import annotations

import datetime as dt
import json
import platform
import random
import time
from pathlib import Path

import pyarrow as pa

from stages.rows import prompts, rewards

N, B, STEPS = 50_000, 64, 10


def reshuffled_per_draw(num_prompts: int, batch_size: int, k: int, key: str) -> list[int]:
    """batch_indices as it was: the epoch's permutation built again for every prompt drawn."""
    out, start = [], (k - 1) * batch_size
    for pos in range(start, start + batch_size):
        epoch, i = divmod(pos, num_prompts)
        perm = list(range(num_prompts))
        random.Random(f"{key}:{epoch}").shuffle(perm)
        out.append(perm[i])
    return out


def per_step_ms(fn) -> float:
    fn(1)
    t = time.perf_counter()
    for k in range(2, STEPS + 2):
        fn(k)
    return (time.perf_counter() - t) / STEPS * 1e3


def epoch_start_ms(key: str) -> float:
    """The first batch of an epoch: its one shuffle (later batches of the epoch reuse it)."""
    prompts._permutation.cache_clear()
    t = time.perf_counter()
    prompts.batch_indices(N, B, 1, key)
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    table = pa.Table.from_pylist([{
        "data_source": "bench/arith", "prompt": [{"role": "user", "content": f"What is {i} plus {i + 1}?"}],
        "reward_model": {"style": "rule", "ground_truth": str(2 * i + 1)}} for i in range(N)])
    key = "bench"
    for k in (1, 2, 800):  # the same indices both ways (800: past the first epoch)
        assert reshuffled_per_draw(N, B, k, key) == prompts.batch_indices(N, B, k, key)

    def whole_columns(k: int):
        idx = prompts.batch_indices(N, B, k, key)
        msgs, truths = table.column("prompt").to_pylist(), table.column("reward_model").to_pylist()
        return [msgs[i] for i in idx], [rewards.ground_truth({"reward_model": truths[i]}) for i in idx]

    def batch_rows(k: int):
        rows = table.take(pa.array(prompts.batch_indices(N, B, k, key), pa.int64()))
        return (rows.column("prompt").to_pylist(),
                [rewards.ground_truth({"reward_model": r}) for r in rows.column("reward_model").to_pylist()])

    assert whole_columns(3) == batch_rows(3)
    res = {"date": dt.date.today().isoformat(), "cpu": platform.processor() or platform.machine(),
           "prompts": N, "batch": B, "steps_timed": STEPS,
           "batch_indices_reshuffled_per_draw_ms": round(per_step_ms(lambda k: reshuffled_per_draw(N, B, k, key)), 2),
           "batch_indices_ms": round(per_step_ms(lambda k: prompts.batch_indices(N, B, k, key)), 3),
           "batch_indices_epoch_start_ms": round(epoch_start_ms(key), 2),
           "rows_whole_columns_ms": round(per_step_ms(whole_columns), 2),
           "rows_batch_only_ms": round(per_step_ms(batch_rows), 3)}
    out = Path(__file__).resolve().parent / "results" / f"{res['date']}-prompt-walk-cpu"
    out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    out.with_suffix(".md").write_text(
        f"# The rollout's walk over {N:,} prompts, per step of {B} ({res['date']}, CPU)\n\n"
        "| | before | now |\n|---|---|---|\n"
        f"| which prompts (`prompts.batch_indices`) | {res['batch_indices_reshuffled_per_draw_ms']} ms "
        f"(a shuffle per prompt drawn) | {res['batch_indices_ms']} ms (a shuffle per epoch: "
        f"{res['batch_indices_epoch_start_ms']} ms at an epoch's first batch) |\n"
        f"| their rows as Python (messages, ground truths) | {res['rows_whole_columns_ms']} ms (whole columns) | "
        f"{res['rows_batch_only_ms']} ms (the batch's rows) |\n\n"
        "The indices and rows are the same both ways (asserted). Made by `python benchmarks/prompt_walk.py`.\n")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
