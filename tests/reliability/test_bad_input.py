"""The bad-input matrix: every row is one way a user can get the input wrong. Each must end with
exit code 2, exactly one stderr line starting with "error:" that names the culprit (key, file,
model, step), no traceback, and nothing published changed: every file of the store, the run view
and the export is byte-identical afterwards (rows marked `adds` may publish new, complete stage
dirs first; they run under their own run name so the existing run view stays untouched).

All rows start from a copy of the finished reference run (tests/reliability/conftest.py)."""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from harness import TINY, invalid_published, leftovers, snapshot

MSG = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
PROFILE, PAIR = "verl-opd-v0.8-single-gpu-v1", "builtin:smollm2-135m-embedded-opd"


# ---- inputs the rows need (written under <work>/in/, outside the artifacts dir) ----------------

def _prepared(w) -> dict:
    return json.loads((w.artifacts / "runs" / "default" / "prepare.json").read_text())


def _teacher_copy(w, name: str) -> Path:
    """A real copy of the reference's tiny teacher as a plain Hugging Face model dir."""
    src = w.artifacts / "store" / "model" / _prepared(w)["teacher"]
    dst = w.dir / "in" / name
    shutil.copytree(src, dst, copy_function=shutil.copy)
    (dst / "manifest.json").unlink()
    return dst


def _edit_weights(d: Path, fn) -> None:
    """Edit model.safetensors as raw bytes (any dtype, bf16 included; no torch in the test process):
    fn gets {name: [dtype, shape, bytes]} and changes it in place."""
    f = d / "model.safetensors"
    b = f.read_bytes()
    n = int.from_bytes(b[:8], "little")
    header, data = json.loads(b[8:8 + n]), b[8 + n:]
    meta = header.pop("__metadata__", None)
    t = {k: [v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]]] for k, v in header.items()}
    fn(t)
    out, blobs, off = {}, [], 0
    for k in sorted(t):
        dtype, shape, raw = t[k]
        out[k] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        blobs.append(raw)
    if meta:
        out["__metadata__"] = meta
    h = json.dumps(out, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    f.write_bytes(len(h).to_bytes(8, "little") + h + b"".join(blobs))


NAN = {"BF16": b"\xc0\x7f", "F16": b"\x00\x7e", "F32": b"\x00\x00\xc0\x7f"}


def nan_teacher(w):
    def poison(t):
        dtype, shape, raw = t["model.norm.weight"]
        t["model.norm.weight"][2] = NAN[dtype] * (len(raw) // len(NAN[dtype]))
    _edit_weights(_teacher_copy(w, "nan_teacher"), poison)


def wide_vocab_teacher(w):
    d = _teacher_copy(w, "wide_teacher")

    def widen(t):
        dtype, shape, raw = t["model.embed_tokens.weight"]
        row = len(raw) // shape[0]
        t["model.embed_tokens.weight"] = [dtype, [shape[0] + 64, *shape[1:]], raw + raw[:64 * row]]
        if "lm_head.weight" in t:
            dtype, shape, raw = t["lm_head.weight"]
            t["lm_head.weight"] = [dtype, [shape[0] + 64, *shape[1:]], raw + raw[:64 * row]]
    _edit_weights(d, widen)
    cfg = json.loads((d / "config.json").read_text())
    cfg["vocab_size"] += 64
    (d / "config.json").write_text(json.dumps(cfg))


def truncated_teacher(w):
    f = _teacher_copy(w, "broken_teacher") / "model.safetensors"
    f.write_bytes(f.read_bytes()[:4096])


def bad_config_teacher(w):
    (_teacher_copy(w, "badcfg_teacher") / "config.json").write_text("{ not json")


def empty_model_dir(w):
    (w.dir / "in" / "empty_model").mkdir(parents=True)


def other_tokenizer(w):
    """The SmolLM2 tokenizer with ids 100 and 101 trading tokens: another id -> token mapping (a chat
    template alone differing is only noted: the student's template formats every prompt)."""
    src = w.artifacts / "store" / "model" / _prepared(w)["teacher"]
    dst = w.dir / "in" / "other_tok"
    dst.mkdir(parents=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / f).exists():
            shutil.copy(src / f, dst / f)
    (dst / "tokenizer.json").chmod(0o644)
    j = json.loads((dst / "tokenizer.json").read_text())
    v = j["model"]["vocab"]
    inv = {i: t for t, i in v.items()}
    v[inv[100]], v[inv[101]] = 101, 100
    (dst / "tokenizer.json").write_text(json.dumps(j))


def _rows(texts) -> list[dict]:
    return [{"data_source": "t", "prompt": [{"role": "user", "content": x}], "ability": "chat",
             "reward_model": {"style": "rule", "ground_truth": ""}} for x in texts]


def parquet(name: str, table_fn) -> Callable:
    def make(w):
        (w.dir / "in").mkdir(exist_ok=True)
        pq.write_table(table_fn(), w.dir / "in" / name)
    return make


GOOD = lambda: pa.Table.from_pylist(_rows([f"Tell me about topic {i}." for i in range(12)]))  # noqa: E731


def not_parquet(w):
    (w.dir / "in").mkdir(exist_ok=True)
    (w.dir / "in" / "notes.parquet").write_text("prompt,answer\nhi,there\n")


def truncated_parquet(w):
    parquet("cut.parquet", GOOD)(w)
    f = w.dir / "in" / "cut.parquet"
    f.write_bytes(f.read_bytes()[:200])


def dup_uid_rollout(w):
    src = w.artifacts / "runs" / "default" / "step-0001" / "rollout.parquet"
    t = pq.read_table(src)
    (w.dir / "in" / "dup").mkdir(parents=True)
    pq.write_table(pa.concat_tables([t, t.slice(0, 1)]), w.dir / "in" / "dup" / "rollout.parquet")


def params_file(text: str) -> Callable:
    def make(w):
        (w.dir / "in").mkdir(exist_ok=True)
        (w.dir / "in" / "params.yaml").write_text(text)
    return make


def a_file_where_a_dir_should_be(w):
    (w.dir / "in").mkdir(exist_ok=True)
    (w.dir / "in" / "afile").write_text("not a directory\n")


def read_only_dir(w):
    d = w.dir / "in" / "ro"
    d.mkdir(parents=True)
    os.chmod(d, 0o555)


def edited_plan(w):
    r = w.opd("plan", "--profile", PROFILE, "--config", PAIR, "--out", "in/plan.json", *TINY)
    assert r.rc == 0, r
    p = w.dir / "in" / "plan.json"
    plan = json.loads(p.read_text())
    plan["resolved"]["train"]["updates"] += 1  # edited by hand after planning
    p.write_text(json.dumps(plan, indent=1))


# ---- the matrix ---------------------------------------------------------------------------------

def run(*overrides: str) -> list[str]:
    return ["run", *TINY, *overrides]


@dataclass
class Row:
    id: str
    argv: list
    culprit: str  # a regex the one error line must match
    setup: Optional[Callable] = None
    adds: bool = False
    rc: int = 2
    skip: Optional[str] = None


ROWS = [
    # config: unknown, mistyped, wrong types, out of range
    Row("unknown key", run("train.updatez=3"), r"'train\.updatez'"),
    Row("unknown key added with +", run("+rollout.batchsize=4"), r"'rollout\.batchsize'"),
    Row("mistyped group", run("trian.updates=3"), r"'trian"),
    Row("unknown key in a params file", ["run", "--params", "in/params.yaml"],
        r"in/params\.yaml.*'optim\.learning_rate'", params_file("optim:\n  learning_rate: 0.1\n")),
    Row("params file not YAML", ["run", "--params", "in/params.yaml"], r"in/params\.yaml.*YAML",
        params_file("optim: [lr: 0.1\n")),
    Row("params file missing", ["run", "--params", "in/none.yaml"], r"in/none\.yaml.*not found"),
    Row("wrong type: int", run("train.updates=three"), r"'train\.updates'"),
    Row("wrong type: bool", run("rollout.cuda_graphs=perhaps"), r"'rollout\.cuda_graphs'"),
    Row("wrong type: float", run("optim.lr=fast"), r"'optim\.lr'"),
    Row("zero batch size", run("rollout.batch_size=0"), r"'rollout\.batch_size' = 0.*positive"),
    Row("negative updates", run("train.updates=-2"), r"'train\.updates' = -2"),
    Row("negative layers kept", run("student.keep_layers=-1"), r"'student\.keep_layers' = -1"),
    Row("zero top-k", run("objective.topk=0"), r"'objective\.topk' = 0"),
    Row("NaN weight decay", run("optim.weight_decay=nan"), r"'optim\.weight_decay' = nan"),
    Row("beta outside [0, 1)", run("optim.beta2=1.5"), r"'optim\.beta2' = 1\.5"),
    Row("top_p above 1", run("rollout.top_p=1.5"), r"'rollout\.top_p'"),
    Row("unknown dtype", run("runtime.dtype=float16"), r"'runtime\.dtype' = 'float16'"),
    Row("unknown objective", run("objective.name=reverse_kl_nope"), r"'objective\.name' = 'reverse_kl_nope'"),
    Row("min above max new tokens", run("rollout.min_new_tokens=20"), r"'rollout\.min_new_tokens'"),
    Row("unknown prompt generator", run("data.generator=poems"), r"'data\.generator' = 'poems'"),
    # models
    Row("k larger than the vocabulary", run("objective.topk=60000"), r"'objective\.topk' = 60000.*vocabulary"),
    Row("more layers kept than exist", run("student.keep_layers=7"), r"'student\.keep_layers' = 7.*only 2"),
    Row("unknown architecture", run("teacher.name=arch:tiny-llama-huge"), r"arch:tiny-llama-huge"),
    Row("missing model dir", run("teacher.name=./in/no_such_model", "teacher.init=pretrained"),
        r"in/no_such_model"),
    Row("model dir without config.json", run("teacher.name=in/empty_model", "teacher.init=pretrained"),
        r"in/empty_model.*config\.json", empty_model_dir),
    Row("corrupt model: truncated weights", run("teacher.name=in/broken_teacher", "teacher.init=pretrained"),
        r"in/broken_teacher", truncated_teacher),
    Row("corrupt model: config.json not JSON", run("teacher.name=in/badcfg_teacher", "teacher.init=pretrained"),
        r"in/badcfg_teacher", bad_config_teacher),
    Row("tokenizer mismatch", run("teacher.tokenizer=in/other_tok", "run=bad"), r"tokenizer mismatch.*id 100",
        other_tokenizer, adds=True),
    Row("vocab mismatch", run("teacher.name=in/wide_teacher", "teacher.init=pretrained", "run=bad"),
        r"vocab.*49152.*49216", wide_vocab_teacher, adds=True),
    # data: the prompt Parquet (data.path) and a Parquet given to `opd inspect`
    Row("prompt Parquet missing", run("data.path=in/none.parquet"), r"in/none\.parquet.*not found"),
    Row("prompt Parquet not Parquet", run("data.path=in/notes.parquet"), r"in/notes\.parquet.*not a readable Parquet",
        not_parquet),
    Row("prompt Parquet truncated", run("data.path=in/cut.parquet"), r"in/cut\.parquet.*not a readable Parquet",
        truncated_parquet),
    Row("prompt Parquet empty", run("data.path=in/empty.parquet"), r"in/empty\.parquet.*empty",
        parquet("empty.parquet", lambda: pa.Table.from_pylist([], GOOD().schema))),
    Row("prompt Parquet without the prompt column", run("data.path=in/q.parquet"),
        r"in/q\.parquet.*missing column 'prompt'",
        parquet("q.parquet", lambda: pa.table({"question": [f"q{i}" for i in range(8)]}))),
    Row("prompt column of the wrong type", run("data.path=in/s.parquet"),
        r"in/s\.parquet.*column 'prompt' has type string",
        parquet("s.parquet", lambda: pa.table({"prompt": [f"q{i}" for i in range(8)]}))),
    Row("empty prompt", run("data.path=in/blank.parquet"), r"in/blank\.parquet.*row 3.*empty prompt",
        parquet("blank.parquet", lambda: pa.Table.from_pylist(
            _rows(["What is 2 plus 2?"] * 3 + ["   "] + ["Name a color."] * 8)))),
    Row("prompt over the token limit", run("data.max_prompt_tokens=8"), r"row 0 prompt is \d+ tokens.*max_prompt"),
    Row("duplicate uids", ["inspect", "in/dup/rollout.parquet"], r"in/dup/rollout\.parquet.*duplicate uid",
        dup_uid_rollout),
    # numerics: stop before publishing, naming the step
    Row("NaN/inf teacher log-probs", run("teacher.name=in/nan_teacher", "teacher.init=pretrained", "run=bad"),
        r"score step 1: teacher 'in/nan_teacher'.*NaN", nan_teacher, adds=True),
    Row("loss becomes NaN", run("optim.lr=1e30", "run=bad"), r"update step 2: loss is nan.*policy 2",
        adds=True),
    # where outputs go
    Row("artifacts dir under a file", run("artifacts=in/afile/artifacts"), r"in/afile/artifacts.*not writable",
        a_file_where_a_dir_should_be),
    Row("artifacts dir read-only", run("artifacts=in/ro/artifacts"), r"in/ro/artifacts.*not writable",
        read_only_dir, skip="root ignores directory permissions" if os.geteuid() == 0 else None),
    Row("run name escapes the artifacts dir", run("run=../../etc"), r"'run' = '\.\./\.\./etc'"),
    Row("absolute run name", run("run=/tmp/opd-run"), r"'run' = '/tmp/opd-run'"),
    # plans and profiles
    Row("plan edited after planning", ["run", "--plan", "in/plan.json"], r"in/plan\.json", edited_plan),
    Row("unknown profile", ["plan", "--profile", "verl-opd-nope", "--config", PAIR, "--out", "in/p.json"],
        r"profile 'verl-opd-nope'"),
    # the command line itself
    Row("stage without its step", ["stage", "rollout", *TINY], r"--step"),
]


def test_the_matrix_is_big_enough():
    assert len(ROWS) >= 25 and len({r.id for r in ROWS}) == len(ROWS)


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_input(done, row):
    if row.skip:
        pytest.skip(row.skip)
    (done.dir / "in").mkdir(exist_ok=True)
    if row.setup:
        row.setup(done)
    before = snapshot(done.artifacts)
    r = done.opd(*row.argv)
    after = snapshot(done.artifacts)
    # 1. the documented exit code
    assert r.rc == row.rc, r
    # 2. one line naming the culprit, no traceback
    errors = r.errors()
    assert len(errors) == 1, r
    assert re.search(row.culprit, errors[0]), f"{errors[0]!r} does not name {row.culprit!r}"
    assert "Traceback" not in r.stderr, r
    # 3. nothing published changed
    if row.adds:
        changed = {k for k in before if after.get(k) != before[k]}
        assert not changed, f"published files changed: {sorted(changed)[:5]}"
    else:
        assert after == before, f"changed: {sorted(set(after) ^ set(before))[:5]}"
    assert leftovers(done.artifacts) == []
    assert invalid_published(done.artifacts) == []
    assert done.bad_reads() == []


def test_repeated_prompts_in_one_batch_get_distinct_uids(done):
    """6 prompts, batches of 8: batch 1 spans the epoch boundary and holds two prompts twice."""
    r = done.opd("stage", "rollout", "--step", "1", *TINY, "data.num_train=6", "rollout.batch_size=8")
    assert r.rc == 0, r
    path = r.stdout.strip().splitlines()[-1].split(": ", 1)[1]
    t = pq.read_table(done.dir / path)
    idx, uids = t.column("prompt_index").to_pylist(), t.column("uid").to_pylist()
    assert len(set(idx)) < len(idx)  # the batch does repeat prompts ...
    assert len(uids) == len(set(uids)) == 8  # ... and every trajectory still has its own uid
