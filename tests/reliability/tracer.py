"""Read tracer for the reliability tests: records every file a process opens inside an artifacts
store, classified at the moment of the open, so a test can assert that no stage ever read an
unpublished (temporary, half-written, unverified) file and that no published file is ever written.

`install()` must run before stages / transformers / peft are imported (the forkserver does it first
thing; a real `opd` process gets it from tests/reliability/_site/sitecustomize.py), so their
`from safetensors import safe_open`-style imports bind the wrapped functions. It records nothing
unless OPD_TEST_TRACE names a directory: each process then appends JSON lines to <dir>/<pid>.jsonl.

Opens are seen three ways: Python's `open` audit event (builtins.open, os.open: JSON, configs,
tokenizer files), pyarrow.parquet readers, and safetensors readers (Rust opens the file itself).
"""
from __future__ import annotations

import json
import os
import sys
import threading

# "verifying" and "busy" are per thread: the store hashes model dirs on threads of its own
# (Store.verify_soon) while the main thread reads other files
_S = {"roots": [], "stores": [], "shallow": set(), "ensuring": [], "verifying": set(), "busy": set(),
      "installed": False}


def _emit(rec: dict) -> None:
    d = os.environ.get("OPD_TEST_TRACE")
    if not d:
        return
    _S["busy"].add(threading.get_ident())  # the log's own open must not be traced
    try:
        rec["pid"] = os.getpid()
        with open(os.path.join(d, f"{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(rec, sort_keys=True) + "\n")
    finally:
        _S["busy"].discard(threading.get_ident())


def _classify(path, op: str, via: str) -> None:
    if threading.get_ident() in _S["busy"] or not os.environ.get("OPD_TEST_TRACE") or not _S["roots"]:
        return
    try:
        p = os.path.realpath(os.fspath(path))
    except TypeError:  # a file descriptor
        return
    for root in _S["roots"]:
        if p.startswith(root + os.sep):
            break
    else:
        return
    parts = p[len(root) + 1:].split(os.sep)
    if len(parts) < 3:  # store/<stage>/<entry> itself (lock files, fsync of dirs)
        return
    stage, entry = parts[0], parts[1]
    rec = {"op": op, "via": via, "stage": stage, "entry": entry, "file": "/".join(parts[2:]),
           "in_verify": threading.get_ident() in _S["verifying"]}
    if entry.startswith(".tmp-"):
        rec["kind"] = "tmp"
        # this process's own temp dir (the stage it is producing, or sealing on a publish thread)
        rec["own"] = entry.endswith(f"-{os.getpid()}")
    elif entry.startswith("."):
        rec["kind"] = "hidden"  # .corrupt-* and anything else never published
    else:
        final = os.path.join(root, stage, entry)
        rec["kind"] = "final"
        rec["published"] = os.path.isfile(os.path.join(final, "manifest.json"))
        deep = any(any(os.path.realpath(v) == final for v in tuple(s._verified)) for s in _S["stores"])
        rec["verified"] = "deep" if deep else "shallow" if final in _S["shallow"] else None
    _emit(rec)


def _audit(event: str, args) -> None:
    if event != "open" or threading.get_ident() in _S["busy"]:
        return
    path, mode, flags = args
    if isinstance(path, int):
        return
    if mode is not None:
        write = any(c in mode for c in "wax+")
    else:
        write = bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND))
    if os.path.isdir(path):
        return  # os.open of a directory (fsync)
    _classify(path, "write" if write else "read", "open")


def _wrap_reader(mod, name: str, via: str) -> None:
    orig = getattr(mod, name)
    if getattr(orig, "_opd_traced", False):
        return

    def wrapped(source, *a, **kw):
        if isinstance(source, (str, os.PathLike)):
            _classify(source, "read", via)
        return orig(source, *a, **kw)

    wrapped._opd_traced = True
    wrapped.__wrapped__ = orig
    setattr(mod, name, wrapped)


def _wrap_store() -> None:
    from stages.run import store

    Store = store.Store
    if getattr(Store, "_opd_traced", False):
        return
    init, verify, check, ensure = Store.__init__, Store.verify, Store._check, Store.ensure

    def __init__(self, *a, **kw):
        init(self, *a, **kw)
        _S["stores"].append(self)
        root = os.path.realpath(self.root)
        if root not in _S["roots"]:
            _S["roots"].append(root)

    def check_(self, d, *a, **kw):  # the hashing itself, on whichever thread runs it
        _S["verifying"].add(threading.get_ident())
        try:
            return check(self, d, *a, **kw)
        finally:
            _S["verifying"].discard(threading.get_ident())

    def verify_(self, d, *a, **kw):
        ok = verify(self, d, *a, **kw)
        if ok:
            _S["shallow"].add(os.path.realpath(d))
        return ok

    def ensure_(self, stage, dig, *a, **kw):
        _S["ensuring"].append(dig)
        try:
            d, computed = ensure(self, stage, dig, *a, **kw)
        finally:
            _S["ensuring"].pop()
        if computed:
            _emit({"op": "computed", "stage": stage, "entry": dig})
        return d, computed

    Store.__init__, Store.verify, Store._check, Store.ensure = __init__, verify_, check_, ensure_
    Store._opd_traced = True


def install() -> None:
    if _S["installed"]:
        return
    _S["installed"] = True
    import pyarrow.parquet as pq
    import safetensors
    import safetensors.torch

    for name in ("read_table", "read_schema", "read_metadata", "ParquetFile"):
        _wrap_reader(pq, name, "parquet")
    _wrap_reader(safetensors, "safe_open", "safetensors")
    _wrap_reader(safetensors.torch, "safe_open", "safetensors")
    _wrap_reader(safetensors.torch, "load_file", "safetensors")
    _wrap_store()
    sys.addaudithook(_audit)


def read_records(trace_dir) -> list[dict]:
    out = []
    for f in sorted(os.listdir(trace_dir)):
        with open(os.path.join(trace_dir, f)) as fh:
            out += [json.loads(line) for line in fh if line.strip()]
    return out


def violations(records: list[dict]) -> list[str]:
    """Every open that breaks the store's contract, as readable lines (empty: none)."""
    bad = []
    for r in records:
        where = f"pid {r['pid']} {r['op']} {r['stage']}/{r['entry']}/{r.get('file', '')} via {r.get('via')}"
        if r["op"] == "computed":
            continue
        if r["kind"] == "tmp" and not r["own"]:
            bad.append(f"another writer's temp dir: {where}")
        elif r["kind"] == "hidden":
            bad.append(f"a never-published dir: {where}")
        elif r["kind"] == "final" and r["op"] == "write":
            bad.append(f"a published file opened for writing: {where}")
        elif r["kind"] == "final" and not r["published"]:
            bad.append(f"a dir without a manifest (unpublished): {where}")
        elif r["kind"] == "final" and not r["in_verify"] and r["verified"] is None:
            bad.append(f"a published dir this process never verified: {where}")
    return bad
