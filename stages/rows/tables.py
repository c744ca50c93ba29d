"""Parquet contracts (docs/architecture.md): rollout.parquet, scores.parquet and verl-schema prompt rows.

Files are written deterministically (fixed column order, no timestamps); file-level key-value
metadata carries the stage digest, schema version and tokenizer fingerprint.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import UserError
from ..run.store import write_bytes

SCHEMA_VERSION = "1"

ROLLOUT = pa.schema([
    ("uid", pa.string()), ("step", pa.int32()), ("policy_version", pa.int32()), ("prompt_index", pa.int32()),
    ("data_source", pa.string()), ("prompt_ids", pa.list_(pa.int32())), ("response_ids", pa.list_(pa.int32())),
    ("response_mask", pa.list_(pa.int8())), ("sample_logprobs", pa.list_(pa.float32())),
    ("finish_reason", pa.string()), ("prompt_text", pa.string()), ("response_text", pa.string()),
    # task reward (rule reward from reward_model.ground_truth, or an environment's); null: not scored
    ("reward", pa.float32()),
])

# Optional rollout columns, present when a tool environment ran the episodes (env.name set): one
# value per trajectory; `reward` (above) is 1.0 on strict success, else 0.0.
ROLLOUT_TASK = pa.schema([
    ("task_uid", pa.string()), ("answer", pa.string()), ("success", pa.bool_()), ("success_lenient", pa.bool_()),
    ("turns", pa.int32()), ("tool_calls", pa.int32()), ("attempted_calls", pa.int32()),
    ("invalid_calls", pa.int32()), ("parse_errors", pa.int32()),
])
ROLLOUT_WITH_TASK = pa.schema(list(ROLLOUT) + list(ROLLOUT_TASK))

# Tool-environment task rows (stages.envs.to_verl_rows): verl's schema, extra_info widened.
TASKS = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64()), ("uid", pa.string()),
                              ("env", pa.string()), ("env_split", pa.string()), ("context", pa.string()),
                              ("oracle_hint", pa.string()), ("question", pa.string())])),
])

def scores_schema(k: int, spans: bool = False) -> pa.Schema:
    """k = 0: the objective needs no top-k, so those columns are absent. spans: a cross-tokenizer run's
    (stages/align.py): the per-position columns are over the teacher's own response tokens, and
    span_logprobs holds log p_teacher of each aligned span (NaN where the span is not exact)."""
    topk = [("topk_ids", pa.list_(pa.list_(pa.int32(), k))), ("topk_logprobs", pa.list_(pa.list_(pa.float32(), k))),
            ("topk_mass", pa.list_(pa.float32()))] if k else []
    if spans:  # (top-k columns here: per *student* position, ids mapped to the student's: score.student_topk)
        return pa.schema([("uid", pa.string()), ("teacher_logprobs", pa.list_(pa.float32())),
                          ("teacher_entropy", pa.list_(pa.float32())), ("selected", pa.list_(pa.int8())),
                          ("span_logprobs", pa.list_(pa.float32())), *topk])
    # selected: 1 where the position reached the LM head (stages/run/selection.py); elsewhere the
    # per-position values are NaN (top-k ids -1): never scored
    return pa.schema([("uid", pa.string()), ("teacher_logprobs", pa.list_(pa.float32())), *topk,
                      ("teacher_entropy", pa.list_(pa.float32())), ("selected", pa.list_(pa.int8()))])


PROMPTS = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64())])),
])


def write(path: Path, table: pa.Table, meta: dict[str, str]) -> None:
    md = dict(table.schema.metadata or {})
    md.update({f"opd.{k}".encode(): str(v).encode() for k, v in sorted(meta.items())})
    md[b"opd.schema_version"] = SCHEMA_VERSION.encode()
    # serialised in memory, then written and hashed in one pass (the store's manifest takes that hash)
    sink = pa.BufferOutputStream()
    pq.write_table(table.replace_schema_metadata(md), sink, compression="zstd", write_statistics=False)
    write_bytes(path, sink.getvalue())


def read(path: Path, required: dict[str, pa.DataType] | None = None) -> pa.Table:
    if not Path(path).is_file():
        raise UserError(f"{path}: Parquet file not found")
    try:
        t = pq.ParquetFile(path).read()  # read_table goes through dataset discovery: ~30x slower per small file
    except (pa.ArrowInvalid, OSError) as e:
        raise UserError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]})") from None
    return check(t, path, required)


def check(t: pa.Table, path: Path, required: dict[str, pa.DataType] | None) -> pa.Table:
    """`t` (the contents of `path`) if it has the `required` columns with compatible types."""
    for col, typ in (required or {}).items():
        if col not in t.column_names:
            raise UserError(f"{path}: missing column '{col}' (expected {typ})")
        if typ is not None and not _compatible(t.schema.field(col).type, typ):
            raise UserError(f"{path}: column '{col}' has type {t.schema.field(col).type}; expected {typ}")
    return t


def _compatible(have: pa.DataType, want: pa.DataType) -> bool:
    if have.equals(want):
        return True
    if pa.types.is_list(want) or pa.types.is_large_list(want):
        return (pa.types.is_list(have) or pa.types.is_large_list(have)) and (
            pa.types.is_struct(have.value_type) == pa.types.is_struct(want.value_type))
    if pa.types.is_string(want):
        return pa.types.is_string(have) or pa.types.is_large_string(have)
    return pa.types.is_struct(want) == pa.types.is_struct(have)


def lists(t: pa.Table, col: str, dtype=np.float32) -> list[np.ndarray]:
    """A list<...> column as one numpy array per row (zero-copy where Arrow allows)."""
    arr = t.column(col).combine_chunks()
    offs = arr.offsets.to_numpy()
    flat = arr.flatten().to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    return [flat[offs[i]:offs[i + 1]] for i in range(len(arr))]


def flat(t: pa.Table, col: str, dtype) -> np.ndarray:
    """A list<...> (or list<fixed_size_list<...>>) column's values, all rows end to end, as one flat
    numpy array: what concatenating `lists` gives, without the per-row split."""
    arr = t.column(col).combine_chunks()
    vals = arr.flatten()  # honours the list offsets (a sliced column starts where its first row does)
    while pa.types.is_list(vals.type) or pa.types.is_fixed_size_list(vals.type) or pa.types.is_large_list(vals.type):
        vals = vals.flatten()
    out = vals.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    return out if out.flags.writeable else out.copy()  # (torch refuses to alias read-only Arrow memory)
