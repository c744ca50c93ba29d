"""stages/blocks/ahead.py: jobs on one worker thread, in order, taken once by name; a failed or
empty job leaves the read to the caller (None)."""
from __future__ import annotations

import threading

from stages.blocks import ahead


def test_jobs_run_in_order_on_one_thread_and_are_taken_once():
    a = ahead.Ahead()
    assert not a and a.take("x") is None  # nothing started
    a.start()
    gate, seen = threading.Event(), []
    a.submit("first", lambda: gate.wait(5) and seen.append(threading.current_thread().name) or "one")
    a.submit("second", lambda: seen.append("second") or 2)
    assert a and seen == []  # the first waits on its gate, the second behind it
    gate.set()
    a.join("second")
    assert seen[0].startswith("opd-ahead") and seen[1] == "second"
    assert a.take("first") == "one" and a.take("second") == 2 and a.taken == ["first", "second"]
    assert a.take("first") is None  # once


def test_a_failed_or_empty_job_is_none_and_not_counted_as_taken():
    a = ahead.Ahead()
    a.start()
    a.submit("boom", lambda: 1 / 0)
    a.submit("empty", lambda: None)
    a.join("boom")  # joined without raising
    assert a.take("boom") is None and a.take("empty") is None and a.taken == []


def test_verified_reads_only_a_dir_whose_hash_checks_out(tmp_path):
    class Store:
        def __init__(self, ok):
            self.ok = ok

        def verify(self, d):
            return self.ok

    assert ahead.verified(Store(True), tmp_path, lambda d, x: (d, x), 3) == (tmp_path, 3)
    assert ahead.verified(Store(False), tmp_path, lambda d, x: 1 / 0, 3) is None  # not read at all


def test_the_main_thread_is_favoured_until_restored():
    import sys

    before = sys.getswitchinterval()
    try:
        ahead.favour_main_thread()
        ahead.favour_main_thread()  # (a second call changes nothing, and restores to the first value)
        assert sys.getswitchinterval() == min(before, ahead.SWITCH_S) < 0.005
        ahead.restore_switch_interval()
        assert sys.getswitchinterval() == before
        ahead.restore_switch_interval()  # (nothing left to restore)
        assert sys.getswitchinterval() == before
    finally:
        sys.setswitchinterval(before)
