"""The content-addressed store: `artifacts/store/<stage>/<digest>/`.

A stage's digest is xxh3_128 of the canonical JSON of (stage name, stage code version, the config
slice it reads, the digests of its inputs). Outputs are published atomically: written into a
temporary sibling, fsynced, per-file content hashes recorded in `manifest.json` (written last),
then renamed into place. A directory whose manifest is missing or does not match its files is
treated as absent: moved aside (never deleted, so nothing is lost) and recomputed.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import signal
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import xxhash

from ..errors import UserError
from .reproducible import stack

MANIFEST = "manifest.json"
WEIGHTS = {".safetensors", ".bin", ".gguf"}  # what a shallow check (verify deep=False) leaves unhashed


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def digest(stage: str, version: str | int, cfg_slice: dict, inputs: dict[str, str]) -> str:
    return xxhash.xxh3_128_hexdigest(
        canonical({"stage": stage, "version": str(version), "config": cfg_slice, "inputs": inputs}))


def file_hash(path: str | os.PathLike) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


# Hashes of files this process wrote through `write_bytes`, keyed by path: (size, mtime_ns, inode,
# xxh3_128). Sealing takes the hash from here instead of reading back the bytes just written; a file
# changed since (size, mtime or inode differ) is hashed from disk as before.
_WRITTEN: dict[str, tuple[int, int, int, str]] = {}


def write_bytes(path: str | os.PathLike, *parts) -> None:
    """Write `parts` (bytes-like, one after another) to `path`, hashing them from memory in the same call."""
    h = xxhash.xxh3_128()
    with open(path, "wb") as f:
        for data in parts:
            f.write(data)
            h.update(data)
    st = os.stat(path)
    if len(_WRITTEN) > 10_000:  # run-view files are never sealed: bound what they leave behind
        _WRITTEN.clear()
    _WRITTEN[os.fspath(path)] = (st.st_size, st.st_mtime_ns, st.st_ino, h.hexdigest())


def written_hash(path: Path) -> str:
    """The file's xxh3_128: from `write_bytes` when the file is still what it wrote, else read from disk."""
    rec = _WRITTEN.pop(os.fspath(path), None)
    st = os.stat(path)
    if rec is not None and rec[:3] == (st.st_size, st.st_mtime_ns, st.st_ino):
        return rec[3]
    return file_hash(path)


def seed_of(dig: str) -> int:
    """Each stage seeds its randomness from its own digest, never from process state."""
    return int(dig[:15], 16)


_FSYNC_POOL = None


def _fsync_one(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)  # (a dir or a file: fsync needs no write access on Linux)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_all(paths: list[Path]) -> None:
    """fsync every path, concurrently; returns when all are durable (re-raises the first error)."""
    global _FSYNC_POOL
    if len(paths) <= 1:
        for p in paths:
            _fsync_one(p)
        return
    if _FSYNC_POOL is None or _FSYNC_POOL[0] != os.getpid():  # a forked child has none of the parent's threads
        from concurrent.futures import ThreadPoolExecutor

        _FSYNC_POOL = (os.getpid(), ThreadPoolExecutor(max_workers=8, thread_name_prefix="opd-fsync"))
    for fut in [_FSYNC_POOL[1].submit(_fsync_one, p) for p in paths]:
        fut.result()


def fault(point: str, path: str | os.PathLike | None = None) -> None:
    """Fault injection for the reliability tests: OPD_FAULT=<point>[:<n>][@<action>] acts the n-th
    time this process reaches <point> (default the first). Actions: kill (default; SIGKILL, as power
    loss or the OOM killer would), term / int (SIGTERM / SIGINT to itself, as a scheduler or Ctrl-C
    would), enospc (an OSError ENOSPC on `path`, as a full disk would). The points are listed in
    tests/reliability/harness.py (FAULT_POINTS): publish.* here, <stage>.before/.after around every
    stage's work, a few inside stages."""
    spec = os.environ.get("OPD_FAULT")
    if not spec:
        return
    spec, _, action = spec.partition("@")
    name, _, nth = spec.partition(":")
    if name != point:
        return
    count = _FAULT_COUNTS.get(point, 0) + 1
    _FAULT_COUNTS[point] = count
    if count != int(nth or 1):
        return
    print(f"fault injection: {point} #{count} -> {action or 'kill'}", file=sys.stderr, flush=True)
    if action == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path or point))
    os.kill(os.getpid(), {"": signal.SIGKILL, "kill": signal.SIGKILL, "term": signal.SIGTERM,
                          "int": signal.SIGINT}[action])


_FAULT_COUNTS: dict[str, int] = {}
_WARNED: set[str] = set()


class Store:
    def __init__(self, artifacts: str | os.PathLike):
        self.artifacts = Path(artifacts)
        self.root = self.artifacts / "store"
        self._verified: set[Path] = set()
        self._ahead: dict = {}  # dir -> Future of its deep check started early (verify_soon)
        self._pending: dict = {}  # final dir -> Future of its background publish
        self.seconds: dict[str, float] = {}
        self._pool = None

    def path(self, stage: str, dig: str) -> Path:
        return self.root / stage / dig

    def verify_soon(self, d: Path) -> None:
        """Start `verify(d)` (deep) on a thread of its own, for a multi-GB model dir the process will
        read later: hashing reads and xxh3 release the interpreter, so it runs beside the caller's
        work. `verify(d)` joins it, so nothing reads the weights before their hash is checked. A daemon
        thread: a process that never needs the dir exits without waiting for it."""
        if d in self._verified or d in self._ahead:
            return
        from concurrent.futures import Future

        fut: Future = Future()

        def run() -> None:
            try:
                fut.set_result(self._check(d, True))
            except BaseException as e:  # noqa: BLE001  re-raised where verify() joins it
                fut.set_exception(e)

        self._ahead[d] = fut
        threading.Thread(target=run, name="opd-verify", daemon=True).start()

    def verify(self, d: Path, deep: bool = True) -> bool:
        """True iff `d` holds a manifest whose per-file hashes all match (checked once per process).

        deep=False hashes every file but the weights (WEIGHTS: sizes only): for multi-GB model dirs whose
        weights are hashed when they are actually loaded (Session), not on every digest lookup, while
        what is read before that (config.json, the tokenizer's files: prepare) is checked here."""
        fut = self._ahead.get(d) if deep else None  # (other threads may join it too: Resident.load_ahead)
        if fut is None:
            return self._check(d, deep)
        ok = fut.result()
        self._ahead.pop(d, None)
        return ok

    def _check(self, d: Path, deep: bool) -> bool:
        if d in self._verified:
            return True
        man = d / MANIFEST
        if not man.is_file():
            if d.is_dir():  # never published by us (a copy, a foreign writer): never trusted
                self._warn(f"{man}: missing; recomputing")
            return False
        try:
            files = json.loads(man.read_text())["files"]
        except (ValueError, KeyError):
            self._warn(f"{man}: unreadable manifest; recomputing")
            return False
        present = {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()} - {MANIFEST}
        if present != set(files):
            self._warn(f"{d}: files differ from the manifest ({sorted(present ^ set(files))[:3]}); recomputing")
            return False
        for rel, meta in files.items():
            f = d / rel
            hashed = deep or f.suffix not in WEIGHTS
            if f.stat().st_size != meta["size"] or (hashed and file_hash(f) != meta["xxh3_128"]):
                self._warn(f"{f}: content hash mismatch; recomputing")
                return False
        if deep:
            self._verified.add(d)
        return True

    def get(self, stage: str, dig: str, deep: bool = True) -> Path | None:
        d = self.path(stage, dig)
        self.wait(d)
        if d.exists() and self.verify(d, deep):
            return d
        return None

    def ensure(self, stage: str, dig: str, produce: Callable[[Path], Any], deep: bool = True,
               background: bool = False) -> tuple[Path, bool]:
        """Return the published dir for (stage, dig), running `produce(tmpdir)` only if absent.

        Returns (path, computed). One writer per digest: an exclusive lock file serialises two
        processes on the same store; the second finds the first one's result published.
        background=True: `produce` runs now, sealing (fsync, hashing, manifest) and the rename run on
        a worker thread while the caller goes on; `wait`/`get`/`flush` join it. A crash before the
        rename loses only that unpublished output, which the next run recomputes to the same bytes.
        `produce` may return a callable `rest(tmpdir)`: the rest of its writes (e.g. device -> host
        copies and serialisation), run on the worker before sealing, or right away without background;
        the caller must not change what `rest` reads until it has joined (`wait`)."""
        self.wait(self.path(stage, dig))
        if (d := self.get(stage, dig, deep)) is not None:
            return d, False
        parent = self.root / stage
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"{parent}: artifacts dir is not writable ({e.strerror})") from None
        lock = self._acquire(parent / f".{dig}.lock")
        try:
            if (d := self.get(stage, dig)) is not None:
                self._release(lock)
                return d, False
            # Under the lock every temp dir of this digest is a dead writer's (SIGKILL, power loss):
            # never published, so removing it loses nothing.
            for stale in parent.glob(f".tmp-{dig}-*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp = parent / f".tmp-{dig}-{os.getpid()}"
            try:  # (the mkdir too: a SIGTERM's Interrupted can land right after it)
                tmp.mkdir()
                fault(f"{stage}.before", tmp)
                t0 = time.perf_counter()
                rest = rest if callable(rest := produce(tmp)) else None
                if rest is not None and not background:
                    rest(tmp)
                    rest = None
                self._clock(f"{stage}.produce", t0)
                if rest is None:
                    fault("publish.after_temp_write", tmp)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        except BaseException:
            self._release(lock)
            raise
        final = self.path(stage, dig)
        if background:
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="opd-publish")
            self._pending[final] = self._pool.submit(self._finish, rest, tmp, stage, dig, lock)
        else:
            t0 = time.perf_counter()
            self._publish(tmp, stage, dig, lock)
            self._clock(f"{stage}.publish", t0)
        return final, True

    def _clock(self, key: str, t0: float) -> None:
        """Seconds spent per stage in produce and in (synchronous) publish, for the benchmarks."""
        self.seconds[key] = round(self.seconds.get(key, 0.0) + time.perf_counter() - t0, 4)

    def _finish(self, rest, tmp: Path, stage: str, dig: str, lock) -> None:
        """Worker thread: the producer's deferred writes (if any), then seal and rename."""
        if rest is not None:
            try:
                t0 = time.perf_counter()
                rest(tmp)
                self._clock(f"{stage}.deferred", t0)
                fault("publish.after_temp_write", tmp)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                self._release(lock)
                raise
        self._publish(tmp, stage, dig, lock)

    def _publish(self, tmp: Path, stage: str, dig: str, lock) -> None:
        parent, final = tmp.parent, self.path(stage, dig)
        try:
            self._seal(tmp, stage, dig)
            if final.exists():  # a broken earlier publish: keep it aside, never delete data
                os.replace(final, parent / f".corrupt-{dig}-{int(time.time())}")
            fault("publish.before_rename", tmp)
            os.replace(tmp, final)
            _fsync_one(parent)
            fault("publish.after_rename", final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            self._release(lock)
        self._verified.add(final)
        fault(f"{stage}.after", final)

    def wait(self, d: Path) -> None:
        """Join a background publish of `d` (re-raising its error), if one is in flight."""
        fut = self._pending.pop(d, None)
        if fut is not None:
            fut.result()

    def flush(self) -> None:
        """Join every background publish (end of a loop, before exit)."""
        for d in list(self._pending):
            self.wait(d)

    def _seal(self, tmp: Path, stage: str, dig: str) -> None:
        st = tmp / "state.json"
        if st.is_file():  # which stack computed these bytes: a record, never part of the identity
            write_json(st, {**json.loads(st.read_text()), "stack": stack()})
        paths = [p for p in sorted(tmp.rglob("*")) if p.is_file()]
        # the files' fsyncs are issued together (each one alone waits for its own journal commit; issued
        # at once, one commit mostly covers them all); all have returned before the manifest is written
        _fsync_all(paths)
        fault("publish.after_fsync", tmp)
        files = {str(p.relative_to(tmp)): {"size": p.stat().st_size, "xxh3_128": written_hash(p)} for p in paths}
        fault("publish.before_manifest", tmp)
        man = tmp / MANIFEST
        with open(man, "w") as f:
            json.dump({"stage": stage, "digest": dig, "files": files}, f, indent=1, sort_keys=True)
        for p in [*paths, man]:  # published means immutable: no path into the store is writable
            os.chmod(p, stat.S_IMODE(os.stat(p).st_mode) & ~0o222)
        _fsync_all([man, tmp])  # the manifest's bytes and the dir's entries, both before the rename
        fault("publish.after_manifest", tmp)

    @staticmethod
    def _acquire(path: Path):
        fh = open(path, "a")
        fcntl.flock(fh, fcntl.LOCK_EX)
        return fh

    @staticmethod
    def _release(fh) -> None:
        fcntl.flock(fh, fcntl.LOCK_UN)
        fh.close()

    @staticmethod
    def _warn(msg: str) -> None:
        if msg not in _WARNED:  # a damaged dir is looked up several times; say so once
            _WARNED.add(msg)
            print(f"warning: {msg}", file=sys.stderr)


def link(target: Path, at: Path) -> None:
    """Point a human-facing run-view path at a store file or dir (relative symlink, atomic swap)."""
    at.parent.mkdir(parents=True, exist_ok=True)
    rel = os.path.relpath(target, at.parent)
    tmp = at.parent / f".{at.name}.tmp-{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(rel, tmp)
    os.replace(tmp, at)


def read_state(d: Path) -> dict:
    """A published stage's state.json (how its computation went: timings, memory, losses)."""
    return json.loads((d / "state.json").read_text())


def read_json(path: Path, remedy: str = "") -> Any:
    """A JSON file that may not exist yet (None); one that does not parse is a one-line error."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        raise UserError(f"{path}: not valid JSON{remedy}") from None


def write_json(path: Path, obj: Any) -> None:
    """Deterministic JSON (sorted keys), written atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    write_bytes(tmp, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())
    os.replace(tmp, path)
    rec = _WRITTEN.pop(os.fspath(tmp), None)
    if rec is not None:  # a rename keeps size, mtime and inode: the hash stays valid for the final name
        _WRITTEN[os.fspath(path)] = rec
