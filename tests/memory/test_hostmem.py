"""Host memory kept for reuse (stages/memory/hostmem.py): set on import of `stages` under glibc, so a
freed large tensor's memory stays in the process's heap (free, ready for the next one) instead of
going back to the kernel; OPD_MALLOC=default and a user's own MALLOC_* settings opt out. (Whether
the kernel later reclaims idle pages is its business: malloc's own accounting is what is checked.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support import ROOT

PROBE = r"""
import json
from stages.tools.process import process_settings
process_settings()
from stages.memory import hostmem
import torch

x = torch.ones(6_000_000)  # 24 MB
mapped = hostmem.mallinfo()["hblkhd"]  # bytes in mmap'd blocks while it lives
del x
print(json.dumps({"applied": hostmem._applied, "mapped_while_alive": mapped, "free_in_heap": hostmem.free_heap_bytes()}))
"""


def _probe(**env) -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("OPD_MALLOC", "MALLOC_MMAP_THRESHOLD_",
                                                          "MALLOC_TRIM_THRESHOLD_")}
    r = subprocess.run([sys.executable, "-c", PROBE], env={**e, **env, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and mallinfo2")
def test_a_freed_large_tensor_stays_in_the_heap():
    kept, default = _probe(), _probe(OPD_MALLOC="default")
    assert kept["applied"] == {"M_MMAP_THRESHOLD": 1 << 30, "M_TRIM_THRESHOLD": 2**31 - 1}
    # kept: served from the heap, and once freed its 24 MB stay there as free heap
    assert kept["mapped_while_alive"] < 24_000_000 <= kept["free_in_heap"], kept
    # glibc's default: a fresh mmap, unmapped on free (the next one faults its pages in again)
    assert default["applied"] is None
    assert default["mapped_while_alive"] >= 24_000_000 > default["free_in_heap"], default


def test_a_users_own_malloc_setting_is_kept():
    assert _probe(MALLOC_TRIM_THRESHOLD_="1000000")["applied"] is None


def test_process_age_counts_from_the_process_start():
    """The age includes what ran before the reading (here a 0.5 s sleep), at the kernel's 10 ms ticks."""
    code = "import time; time.sleep(0.5); from stages.memory import hostmem; print(hostmem.process_age_s())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert 0.5 <= float(out.stdout) < 30
