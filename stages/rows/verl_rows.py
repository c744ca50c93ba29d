"""verl-schema prompt Parquet: reading any such file, and writing a sample one.

A verl RL row: `data_source`, `prompt` (chat messages: list<struct<role, content>>; the column is
`data.prompt_key`), `ability`, `reward_model {style, ground_truth}`, `extra_info {split, index, ...}`.
Only the prompt column is required; `reward_model.ground_truth` enables rule rewards, and
`extra_info.split == "test"` marks evaluation rows when no separate eval file is given.
Length: `data.max_prompt_tokens` is verl's `data.max_prompt_length`; a prompt over it is an error unless
`data.truncation` chooses a cut (prepare.truncate_ids). verl 0.8 itself never reads `data.truncation`: its
agent loop always keeps a long prompt's last tokens, which is our `left` (docs/compat.md).
"""
from __future__ import annotations

import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from . import prompts, tables
from ..errors import UserError


def read_verl_parquet(path: str, prompt_key: str) -> pa.Table:
    """A verl-schema Parquet, checked: the prompt column exists and holds chat messages of text."""
    p = Path(path).expanduser()
    t = tables.read(p)
    if prompt_key not in t.column_names:
        raise UserError(f"{path}: missing column '{prompt_key}' (data.prompt_key: chat messages, "
                        "list<struct<role: string, content: string>>)")
    typ = t.schema.field(prompt_key).type
    ok = (pa.types.is_list(typ) or pa.types.is_large_list(typ)) and pa.types.is_struct(typ.value_type)
    names = {f.name: f.type for f in typ.value_type} if ok else {}
    if not ok or "role" not in names or "content" not in names:
        raise UserError(f"{path}: column '{prompt_key}' has type {typ}; expected chat messages "
                        "list<struct<role: string, content: string>>")
    if not (pa.types.is_string(names["content"]) or pa.types.is_large_string(names["content"])):
        raise UserError(f"{path}: column '{prompt_key}' message content is {names['content']}; expected text "
                        "(multimodal content is not supported)")
    if t.num_rows == 0:
        raise UserError(f"{path}: empty prompt set (0 rows)")
    return t


def sample(cfg, rows: int, out: Path) -> Path:
    """`opd data sample --format verl-parquet`: `rows` rows from the configured prompt generator, about
    a fifth of them (at least one) marked extra_info.split = "test"."""
    if rows < 2:
        raise UserError(f"--rows {rows}: expected at least 2 (one train and one test row)")
    import dataclasses

    n_eval = max(1, math.ceil(rows / 5))
    data = dataclasses.replace(cfg.data, num_train=rows - n_eval, num_eval=n_eval)
    train, evals = prompts.generate(data)
    t = pa.Table.from_pylist(train + evals, tables.PROMPTS)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    pq.write_table(t, tmp, compression="zstd")
    tmp.replace(out)
    return out
