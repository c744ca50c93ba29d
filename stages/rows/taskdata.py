"""`opd data reasoning-gym NAME`: prompt rows in verl's schema from a reasoning-gym dataset, which
`opd run data.path=FILE` trains on and holds out (stages/rows/verl_rows.py), and which the dataset's
own checker scores (stages/rows/checkers.py).

A row: data_source "reasoning_gym/NAME" (what picks the checker), prompt [{"role": "user", "content":
question + INSTRUCTION}], ability (the library's category, e.g. "arithmetic"), reward_model {"style":
"rule", "ground_truth": the entry's answer}, extra_info {split, index, entry: the whole entry as JSON,
for the checkers that read its metadata}. The rows are a function of (NAME, size, seed, test
fraction): the library draws entry i from its own seed + i, and the split below draws nothing.

The split is by question, not by position: a question that occurs twice (small datasets repeat) is
held out everywhere or nowhere, so no held-out prompt is one the student trained on. The questions
are ranked by a hash of their text and the first ceil(fraction x distinct questions) are `test`.
"""
from __future__ import annotations

import difflib
import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from ..errors import UserError
from .checkers import REASONING_GYM, TASKS_EXTRA

INSTRUCTION = "Finish with the final answer alone between <answer> and </answer>."

SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64()), ("entry", pa.string())])),
])


def _library():
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError as e:
        raise UserError(f"opd data reasoning-gym needs the reasoning-gym library: {TASKS_EXTRA}") from e
    return reasoning_gym, DATASETS


def rows(name: str, size: int, seed: int, test_fraction: float = 0.2) -> list[dict]:
    """The dataset's first `size` entries for `seed` as verl rows, a `test_fraction` of the distinct
    questions held out."""
    if size < 2:
        raise UserError(f"--size {size}: expected at least 2 (one train and one test row)")
    if not 0 < test_fraction < 1:
        raise UserError(f"--test-fraction {test_fraction}: expected a fraction strictly between 0 and 1")
    rg, datasets = _library()
    if name not in datasets:
        near = difflib.get_close_matches(name, sorted(datasets), n=3)
        raise UserError(f"reasoning-gym has no dataset {name!r}" + (f" (did you mean {', '.join(near)}?)" if near else
                                                                     f"; it has {len(datasets)}, e.g. chain_sum"))
    try:
        entries = [dict(e) for e in rg.create_dataset(name, size=size, seed=seed)]
    except Exception as e:  # the library refuses its own dataset's defaults (e.g. composite needs a config)
        raise UserError(f"reasoning-gym dataset {name!r} cannot be built with its default settings: {e}") from e
    if any(e.get("answer") is None for e in entries):
        raise UserError(f"reasoning-gym dataset {name!r} has no reference answers (its checker validates a solution "
                        "against the puzzle); choose a dataset whose entries carry an answer")
    category = datasets[name][0].__module__.split(".")[1]  # reasoning_gym.<category>.<module>
    questions = sorted({e["question"] for e in entries}, key=lambda q: (xxhash.xxh64_intdigest(q.encode()), q))
    held = set(questions[:math.ceil(test_fraction * len(questions))])
    if len(held) == len(questions):
        raise UserError(f"{name}: {len(questions)} distinct question(s) in {size} entries leave none to train on "
                        "(raise --size or lower --test-fraction)")
    out = []
    for i, e in enumerate(entries):
        try:
            entry = json.dumps(e, sort_keys=True, ensure_ascii=False)
        except TypeError as err:  # metadata the checker needs must survive the Parquet file
            raise UserError(f"reasoning-gym dataset {name!r}: entry {i} is not JSON ({err})") from err
        out.append({
            "data_source": f"{REASONING_GYM}{name}",
            "prompt": [{"role": "user", "content": f"{e['question'].rstrip()}\n\n{INSTRUCTION}"}],
            "ability": category,
            "reward_model": {"style": "rule", "ground_truth": str(e["answer"])},
            "extra_info": {"split": "test" if e["question"] in held else "train", "index": i, "entry": entry},
        })
    return out


def write(name: str, size: int, seed: int, out: Path, test_fraction: float = 0.2) -> tuple[Path, dict]:
    """Write the rows to `out` (Parquet, written whole or not at all); returns (out, rows per split)."""
    t = pa.Table.from_pylist(rows(name, size, seed, test_fraction), SCHEMA)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    pq.write_table(t, tmp, compression="zstd")
    tmp.replace(out)
    splits = [x["split"] for x in t.column("extra_info").to_pylist()]
    return out, {s: splits.count(s) for s in ("train", "test")}
