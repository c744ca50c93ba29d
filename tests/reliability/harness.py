"""Shared machinery of the reliability suite: the tiny run every test uses, a client for the fork
server (forkserver.py), snapshots of an artifacts dir, and the byte-identity comparison against the
one shared reference run."""
from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import xxhash

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
OPD = str(Path(sys.executable).parent / "opd")
sys.path.insert(0, str(HERE.parent))
from support import TINY as _TINY  # noqa: E402

# The suite's tiny run (random tiny Llamas, real SmolLM2 tokenizer, 3 updates), with the default
# thread count (runtime.threads=0: torch's own, 2 on a 2-core CI machine): the configuration users
# run, so resume is checked byte for byte where a second intra-op thread computes half the rows.
TINY = list(_TINY)

# Every named fault point (OPD_FAULT=<point>[:<n>][@kill|term|int|enospc], stages/run/store.py `fault`).
# Store.ensure fires <stage>.before (temp dir made, nothing computed) and <stage>.after (published)
# for every content-addressed stage (those of a default run below); the rest sit where their names say.
FAULT_POINTS = [
    "publish.after_temp_write", "publish.after_fsync", "publish.before_manifest", "publish.after_manifest",
    "publish.before_rename", "publish.after_rename",
    "prepare.before", "prepare.after", "tokenizer.before", "tokenizer.after", "model.before", "model.after",
    "prompts.before", "prompts.after", "prepared.before", "prepared.after", "init.before", "init.after",
    "rollout.before", "rollout.after", "align.before", "align.after", "score.before", "score.after",
    "update.before", "update.mid", "update.after", "train.between_steps", "evaluate.before", "evaluate.after",
    "export.before", "export.before_rename", "export.after",
]

# history.csv columns that record how fast a step ran (or whether this process ran it), not what it computed
VOLATILE_HISTORY = ("_tokens_per_s", "_wall_s", "peak_memory_gib", "reused")


@dataclass
class Proc:
    argv: list
    rc: int
    stdout: str
    stderr: str
    cpu_s: float = 0.0

    def errors(self) -> list[str]:
        return [ln for ln in self.stderr.splitlines() if ln.startswith("error:")]

    def __str__(self) -> str:
        return f"opd {' '.join(self.argv)} -> {self.rc}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


class Server:
    """Client of forkserver.py: `run` starts an `opd` child and waits; `start`/`wait` split it."""

    def __init__(self, logdir: Path):
        self.logdir = logdir
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
        env.pop("OPD_FAULT", None)
        self.p = subprocess.Popen([sys.executable, str(HERE / "forkserver.py")], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, bufsize=1, cwd=ROOT, env=env)
        assert "ready" in json.loads(self.p.stdout.readline())
        self.n = 0
        self.cpu_s = 0.0  # CPU seconds of all children (the suite's budget is CPU on 2 cores)
        self.pending: dict[int, tuple] = {}

    def _ask(self, req: dict) -> dict:
        self.p.stdin.write(json.dumps(req) + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def start(self, *argv: str, cwd: Path, env: dict | None = None) -> int:
        self.n += 1
        out, err = self.logdir / f"{self.n:03d}.out", self.logdir / f"{self.n:03d}.err"
        pid = self._ask({"op": "start", "argv": list(argv), "cwd": str(cwd), "env": env or {},
                         "stdout": str(out), "stderr": str(err)})["pid"]
        self.pending[pid] = (list(argv), out, err)
        return pid

    def stderr_of(self, pid: int) -> str:
        return self.pending[pid][2].read_text()

    def wait(self, pid: int) -> Proc:
        r = self._ask({"op": "wait", "pid": pid})
        argv, out, err = self.pending.pop(pid)
        self.cpu_s += r["cpu_s"]
        return Proc(argv, r["rc"], out.read_text(), err.read_text(), r["cpu_s"])

    def run(self, *argv: str, cwd: Path, env: dict | None = None) -> Proc:
        return self.wait(self.start(*argv, cwd=cwd, env=env))

    def close(self) -> None:
        self.p.stdin.close()
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            self.p.kill()


def real_opd(*argv: str, cwd: Path, env: dict | None = None, wait: bool = True):
    """The installed `opd` console script itself, with the read tracer loaded through sitecustomize."""
    # _site first (its sitecustomize installs the tracer), then this tree: the code under test even where
    # the venv's editable install points at another checkout
    e = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.pathsep.join([str(HERE / "_site"), str(ROOT)]),
         **(env or {})}
    p = subprocess.Popen([OPD, *argv], cwd=cwd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not wait:
        return p
    out, err = p.communicate(timeout=600)
    return Proc(list(argv), p.returncode, out, err)


def wait_for(pred, timeout: float = 120, every: float = 0.05) -> None:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError("condition not reached")
        time.sleep(every)


# ---- snapshots -------------------------------------------------------------------------------

_HASHES: dict[tuple, str] = {}


def _hash(p: Path) -> str:
    """Content hash, cached per inode + size + mtime: the tests' artifacts are hard links to the
    reference's, so each big file is read once per session (a write changes mtime or the inode)."""
    st = p.stat()
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _HASHES:
        _HASHES[key] = xxhash.xxh3_128_hexdigest(p.read_bytes())
    return _HASHES[key]


def snapshot(artifacts: Path) -> dict[str, str]:
    """Every file (content hash) and symlink (target) below `artifacts`, lock files excepted (an
    attempt to compute takes a lock file; it holds no data)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(artifacts):
        d = Path(dirpath)
        for name in filenames + [n for n in dirnames if (d / n).is_symlink()]:
            p = d / name
            if name.endswith(".lock"):
                continue
            rel = str(p.relative_to(artifacts))
            out[rel] = "-> " + os.readlink(p) if p.is_symlink() else _hash(p)
    return out


def published(artifacts: Path) -> set[str]:
    return {f"{p.parent.name}/{p.name}" for p in (artifacts / "store").glob("*/*")
            if p.is_dir() and not p.name.startswith(".")}


def leftovers(artifacts: Path) -> list[str]:
    """Temp or set-aside dirs anywhere in the artifacts dir."""
    return sorted(str(p.relative_to(artifacts)) for p in artifacts.rglob(".*")
                  if ".tmp-" in p.name or p.name.startswith(".corrupt-"))


def invalid_published(artifacts: Path) -> list[str]:
    """Published store dirs whose manifest does not verify (a fresh Store: nothing cached)."""
    from stages.run.store import Store

    st = Store(artifacts)
    import contextlib

    with contextlib.redirect_stderr(io.StringIO()):
        return sorted(e for e in published(artifacts) if not st.verify(artifacts / "store" / e))


def _manifest_files(d: Path) -> dict:
    files = json.loads((d / "manifest.json").read_text())["files"]
    return {k: v for k, v in files.items() if k != "state.json"}


def differences(work: Path, ref: Path, *, store_only: bool = False) -> list[str]:
    """Where `work`'s artifacts differ from the reference run's, ignoring only what records how fast
    things ran (state.json, timing columns of history.csv, train.json timings). Empty: identical."""
    wa, ra = work / "artifacts", ref / "artifacts"
    diffs = []
    pw, pr = published(wa), published(ra)
    if pw != pr:
        diffs.append(f"published dirs differ: missing {sorted(pr - pw)[:4]}, extra {sorted(pw - pr)[:4]}")
    diffs += entry_differences(wa, ra, pw & pr)
    if store_only:
        return diffs
    sw, sr = snapshot(wa), snapshot(ra)
    view = lambda s: {k: v for k, v in s.items() if not k.startswith("store/")}  # noqa: E731
    vw, vr = view(sw), view(sr)
    if set(vw) != set(vr):
        diffs.append(f"run view / export files differ: {sorted(set(vw) ^ set(vr))[:6]}")
    for rel in sorted(set(vw) & set(vr)):
        name = Path(rel).name
        if name == "state.json" and "/step-" in rel:
            continue
        if name == "history.csv":
            if _history(wa / rel) != _history(ra / rel):
                diffs.append(f"{rel}: losses differ")
        elif name == "train.json":
            strip = lambda p: {k: v for k, v in json.loads(p.read_text()).items() if k != "timings"}  # noqa: E731
            if strip(wa / rel) != strip(ra / rel):
                diffs.append(f"{rel}: differs")
        elif rel.startswith("export/") and name in ("adapter_config.json", "manifest.json"):
            if _placeless(wa / rel, wa) != _placeless(ra / rel, ra):
                diffs.append(f"{rel}: differs (beyond the export's own absolute path)")
        elif vw[rel] != vr[rel]:
            diffs.append(f"{rel}: bytes differ")
    return diffs


def _what_differs(a: Path, b: Path) -> str:
    """For a mismatch report: which Parquet columns differ (and by how much), else sizes."""
    if a.suffix != ".parquet":
        return f"{a.stat().st_size} vs {b.stat().st_size} bytes"
    import pyarrow.parquet as pq

    ta, tb = pq.read_table(a), pq.read_table(b)
    if ta.schema != tb.schema or ta.num_rows != tb.num_rows:
        return f"schema/rows differ ({ta.num_rows} vs {tb.num_rows} rows)"
    out = []
    for name in ta.column_names:
        ca, cb = ta.column(name).to_pylist(), tb.column(name).to_pylist()
        if ca == cb:
            continue
        rows = [i for i, (x, y) in enumerate(zip(ca, cb)) if x != y]
        flat = lambda v: v if isinstance(v, list) else [v]  # noqa: E731
        per_row = []  # row: first differing position and the largest float gap in that row
        for i in rows[:5]:
            pairs = list(zip(flat(ca[i]), flat(cb[i])))
            first = next((j for j, (x, y) in enumerate(pairs) if x != y), len(pairs))
            gaps = [abs(x - y) for x, y in pairs if isinstance(x, float) and isinstance(y, float)]
            per_row.append(f"{i}@{first}" + (f" |d|<={max(gaps):.3g}" if gaps else ""))
        out.append(f"{name} rows [{'; '.join(per_row)}]")
    return ", ".join(out) or "same values, different bytes (metadata)"


def entry_differences(wa: Path, ra: Path, entries) -> list[str]:
    """Store dirs (e.g. 'rollout/<digest>') whose files differ between two artifacts dirs."""
    diffs = []
    for e in sorted(entries):
        a, b = wa / "store" / e, ra / "store" / e
        fa, fb = _manifest_files(a), _manifest_files(b)
        if fa != fb:
            what = [f"{r}: {_what_differs(a / r, b / r) if r in fa and r in fb else 'only in one'}"
                    for r in sorted(set(fa) | set(fb)) if fa.get(r) != fb.get(r)]
            diffs.append(f"store/{e}: manifest differs ({'; '.join(what)})")
            continue
        for rel in _manifest_files(b):
            if os.path.samefile(a / rel, b / rel):  # a hard link to the reference's own file
                continue
            if (a / rel).read_bytes() != (b / rel).read_bytes():
                diffs.append(f"store/{e}/{rel}: bytes differ")
    return diffs


def _placeless(p: Path, artifacts: Path) -> dict:
    """An export's JSON without what depends on where the export lies: the adapter's absolute base
    path (PEFT resolves a relative one against the cwd), and the manifest's hash of that file."""
    data = json.loads(p.read_text())
    if p.name == "adapter_config.json":
        base = Path(data.pop("base_model_name_or_path"))
        assert base == (p.parent.parent / "base").resolve(), f"{p}: base path {base} is not its export's base/"
    else:
        data.get("sha256", {}).pop("adapter/adapter_config.json", None)
    return data


def _history(p: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.endswith(VOLATILE_HISTORY)}
            for row in csv.DictReader(p.open())]
