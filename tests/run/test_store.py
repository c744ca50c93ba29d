"""Unit tests for stages/run/store.py: digests, atomic publish, manifests, locking."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import threading
import time

import pytest

from stages.run.store import Store, digest, file_hash, link

BASE = ("rollout", 1, {"rollout": {"n": 1}}, {"policy": "a" * 32})


def test_digest_is_stable_and_sensitive_to_each_input():
    d = digest(*BASE)
    assert d == digest(*BASE) and len(d) == 32
    assert d == digest("rollout", "1", {"rollout": {"n": 1}}, {"policy": "a" * 32})  # canonical JSON
    variants = [("score", 1, BASE[2], BASE[3]), ("rollout", 2, BASE[2], BASE[3]),
                ("rollout", 1, {"rollout": {"n": 2}}, BASE[3]), ("rollout", 1, BASE[2], {"policy": "b" * 32})]
    assert len({digest(*v) for v in variants} | {d}) == 5
    # key order never matters
    assert digest("s", 1, {"a": 1, "b": 2}, {}) == digest("s", 1, {"b": 2, "a": 1}, {})


def test_publish_writes_manifest_last_and_reads_back(tmp_path):
    st = Store(tmp_path)
    calls = []

    def produce(d):
        calls.append(1)
        (d / "x.txt").write_text("hello")
        (d / "sub").mkdir()
        (d / "sub" / "y.bin").write_bytes(b"\x00\x01")

    p, computed = st.ensure("s", "d1", produce)
    assert computed and p == tmp_path / "store" / "s" / "d1"
    man = json.loads((p / "manifest.json").read_text())
    assert set(man["files"]) == {"x.txt", "sub/y.bin"}
    assert man["files"]["x.txt"]["xxh3_128"] == file_hash(p / "x.txt")
    # a published stage is never run again, also from a fresh process-level Store
    p2, computed2 = Store(tmp_path).ensure("s", "d1", produce)
    assert p2 == p and not computed2 and len(calls) == 1
    assert not [q for q in (tmp_path / "store" / "s").iterdir() if q.name.startswith(".tmp")]


def test_failed_produce_publishes_nothing(tmp_path):
    st = Store(tmp_path)

    def boom(d):
        (d / "partial").write_text("half")
        raise RuntimeError("died")

    with pytest.raises(RuntimeError):
        st.ensure("s", "d1", boom)
    assert st.get("s", "d1") is None
    assert [q.name for q in (tmp_path / "store" / "s").iterdir() if not q.name.endswith(".lock")] == []


@pytest.mark.parametrize("background", [False, True])
def test_deferred_writes_run_before_sealing_and_a_failure_publishes_nothing(tmp_path, background):
    """`produce` may return the rest of its writes: run on the publish thread (background) or at once."""
    import threading

    st = Store(tmp_path)
    where = []

    def produce(d):
        (d / "a.txt").write_text("now")

        def rest(d2):
            where.append(threading.current_thread().name)
            (d2 / "b.txt").write_text("later")
        return rest

    p, computed = st.ensure("s", "ok", produce, background=background)
    st.wait(p)
    assert computed and set(json.loads((p / "manifest.json").read_text())["files"]) == {"a.txt", "b.txt"}
    assert where[0].startswith("opd-publish") if background else where == ["MainThread"]

    def failing(d):
        (d / "a.txt").write_text("now")

        def rest(d2):
            raise OSError(28, "No space left on device")
        return rest

    p, _ = st.ensure("s", "bad", failing, background=background) if background else (st.path("s", "bad"), None)
    if background:
        with pytest.raises(OSError):
            st.wait(p)
    else:
        with pytest.raises(OSError):
            st.ensure("s", "bad", failing)
    assert st.get("s", "bad") is None
    assert not [q for q in (tmp_path / "store" / "s").iterdir() if q.name.startswith(".tmp")]
    st.ensure("s", "bad", produce)  # the lock was released: the digest can be produced again


@pytest.mark.parametrize("damage", ["flip", "truncate", "no_manifest", "extra_file"])
def test_damaged_output_is_recomputed_with_a_warning(tmp_path, capsys, damage):
    st = Store(tmp_path)
    p, _ = st.ensure("s", "d1", lambda d: (d / "data.bin").write_bytes(bytes(range(200))))
    f = p / "data.bin"
    if damage == "flip":
        b = bytearray(f.read_bytes()); b[7] ^= 1; f.write_bytes(bytes(b))
    elif damage == "truncate":
        f.write_bytes(f.read_bytes()[:50])
    elif damage == "no_manifest":
        (p / "manifest.json").unlink()
    else:
        (p / "stray.txt").write_text("?")
    fresh = Store(tmp_path)  # a new process would not trust its predecessor
    assert fresh.get("s", "d1") is None
    p2, computed = fresh.ensure("s", "d1", lambda d: (d / "data.bin").write_bytes(bytes(range(200))))
    assert computed and (p2 / "data.bin").read_bytes() == bytes(range(200))
    if damage != "no_manifest":
        assert "recomputing" in capsys.readouterr().err
    # the damaged copy was moved aside, not deleted
    assert any(q.name.startswith(".corrupt-d1") for q in (tmp_path / "store" / "s").iterdir())


def _slow_writer(root, marker):
    def produce(d):
        with open(marker, "a") as fh:
            fh.write("x")
        time.sleep(0.5)
        (d / "out").write_text(str(os.getpid()))

    Store(root).ensure("s", "same", produce)


def test_two_processes_never_write_one_digest_twice(tmp_path):
    marker = tmp_path / "calls"
    ps = [mp.get_context("fork").Process(target=_slow_writer, args=(tmp_path, marker)) for _ in range(2)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(10)
    assert all(p.exitcode == 0 for p in ps)
    assert marker.read_text() == "x"  # produce ran exactly once
    assert Store(tmp_path).get("s", "same") is not None


def test_link_is_relative_and_replaceable(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("A"); b.write_text("B")
    at = tmp_path / "view" / "f.txt"
    link(a, at)
    assert at.read_text() == "A" and not os.readlink(at).startswith("/")
    link(b, at)
    assert at.read_text() == "B"


def _published_model(tmp_path, size=3 << 20):
    st = Store(tmp_path)
    p, _ = st.ensure("model", "m1", lambda d: ((d / "w.bin").write_bytes(os.urandom(size)),
                                               (d / "config.json").write_text("{}")))
    return p


def test_verify_soon_hashes_once_beside_the_caller_and_verify_joins_it(tmp_path, monkeypatch):
    import stages.run.store as store

    p = _published_model(tmp_path)
    hashed = []
    real = store.file_hash
    monkeypatch.setattr(store, "file_hash", lambda f: (hashed.append((os.path.basename(f), threading.current_thread().name)),
                                                       real(f))[1])
    fresh = Store(tmp_path)  # a new process: nothing verified yet
    fresh.verify_soon(p)
    fresh.verify_soon(p)  # asked twice: one check
    assert fresh.verify(p) and fresh.verify(p)
    # each file hashed once, by the early check, on its own thread (not in line by verify)
    assert sorted(hashed) == [("config.json", "opd-verify"), ("w.bin", "opd-verify")]
    fresh.verify_soon(p)  # verified already: no new check
    assert fresh.get("model", "m1") == p and len(hashed) == 2


@pytest.mark.parametrize("when", ["before", "after"])
def test_verify_soon_still_catches_a_flipped_byte(tmp_path, capsys, when):
    """A same-size flip passes the shallow check; the early deep check must report it where verify()
    joins it, whether the damage happened before the check started or it was started first and
    joined later (the weights are only read after verify() returns)."""
    p = _published_model(tmp_path)
    f = p / "w.bin"

    def flip():
        b = bytearray(f.read_bytes()); b[12345] ^= 1; f.write_bytes(bytes(b))

    fresh = Store(tmp_path)
    if when == "before":
        flip()
        fresh.verify_soon(p)
    else:
        fresh.verify_soon(p)
        fresh.verify(p)  # the intact bytes checked: trusted for this process
        flip()
    assert fresh.verify(p, deep=False)  # sizes match either way
    if when == "before":
        assert not fresh.verify(p)
        assert "content hash mismatch" in capsys.readouterr().err
        assert not Store(tmp_path).verify(p)  # and a plain check agrees
    else:
        assert fresh.verify(p)  # checked once per process, as without verify_soon
        assert not Store(tmp_path).verify(p)


def test_the_shallow_check_hashes_all_but_the_weights(tmp_path, capsys):
    """verify(deep=False) (a model's lookup in prepare) hashes config.json and the tokenizer's files,
    which prepare reads before the weights' deep check; a same-size flip there is found, one in the
    weights is left to the deep check."""
    p = _published_model(tmp_path)
    for name, shallow in (("config.json", False), ("w.bin", True)):
        f = p / name
        good = f.read_bytes()
        f.write_bytes(good[:1] + bytes([good[1] ^ 1]) + good[2:])
        assert Store(tmp_path).verify(p, deep=False) is shallow and not Store(tmp_path).verify(p)
        assert f"{name}: content hash mismatch" in capsys.readouterr().err
        f.write_bytes(good)


def test_two_threads_join_one_early_check(tmp_path, monkeypatch):
    """Resident.load_ahead's worker and the main thread may both verify a dir verify_soon is still
    hashing: both wait for its answer, and nothing is hashed twice (the first caller once took the
    check away, and the second hashed the whole dir again)."""
    import threading
    import time

    import stages.run.store as store

    p = _published_model(tmp_path)
    gate, hashed, real = threading.Event(), [], store.file_hash
    monkeypatch.setattr(store, "file_hash", lambda f: (gate.wait(5), hashed.append(os.path.basename(f)), real(f))[2])
    fresh = Store(tmp_path)
    fresh.verify_soon(p)  # its hashing waits on the gate
    got = []
    threads = [threading.Thread(target=lambda: got.append(fresh.verify(p))) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.2)  # the first is waiting on the check before the second asks
    gate.set()
    for t in threads:
        t.join(5)
    assert got == [True, True] and sorted(hashed) == ["config.json", "w.bin"]


def test_an_interrupt_as_the_temp_dir_is_made_leaves_no_temp_dir(tmp_path, monkeypatch):
    """SIGTERM raises Interrupted wherever the main thread is (stages/errors.py): also right after the
    temp dir exists and before anything else runs. The dir goes with the abandoned stage."""
    import signal
    from pathlib import Path

    from stages.errors import Interrupted

    made = Path.mkdir

    def mkdir(self, *a, **k):
        made(self, *a, **k)
        if ".tmp-" in self.name:
            raise Interrupted(signal.SIGTERM)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    store = Store(tmp_path)
    with pytest.raises(Interrupted):
        store.ensure("rollout", "d" * 32, lambda tmp: (tmp / "x").write_text("x"))
    assert [p.name for p in (tmp_path / "store" / "rollout").iterdir() if ".tmp-" in p.name] == []
