"""Host memory: keep freed blocks for reuse instead of returning them to the kernel (glibc malloc);
and the process's own readings (peak resident set, age).

torch's CPU tensors come from malloc. glibc serves a large block (above its mmap threshold, which it
adapts up to 32 MiB) with a fresh mmap and returns it to the kernel on free, and trims the heap top
once more than its trim threshold is free. Either way the next vocab-sized tensor of the next chunk
or step (logits, log-probs, probabilities, their gradients: [128, 49,152] fp32 is 24 MiB) lands on
pages the kernel must fault in and zero again: about a quarter of the whole CPU step on the
cpu_peer workload (docs/performance.md).

So the process serves every block from its heap and keeps what it frees: the resident set stays at
its peak instead of shrinking between steps (the peak itself does not grow). A phase's peak RSS
(`session.phase` on CPU) therefore includes memory an earlier phase freed and the process kept;
`heap_free_gib` beside it says how much of the resident set is such free heap at the phase's end. Nothing computed
changes: torch aligns its CPU buffers to 64 bytes whichever way malloc serves them, and MKL runs in
strict reproducibility mode (`reproducible.py`), whose results do not depend on alignment anyway.
A user's own MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ is kept, and OPD_MALLOC=default leaves
glibc's defaults alone (a process that must give memory back between steps). Other C libraries:
nothing done.
"""
from __future__ import annotations

import ctypes
import os
import sys
from functools import lru_cache

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
KEEP = {"M_MMAP_THRESHOLD": (M_MMAP_THRESHOLD, 1 << 30),  # blocks up to 1 GiB from the heap
        "M_TRIM_THRESHOLD": (M_TRIM_THRESHOLD, 2**31 - 1)}  # trim the heap top only past 2 GiB free
_applied: dict | None = None


def keep_freed_memory() -> dict | None:
    """Apply KEEP through glibc's mallopt (once per process). Returns what was set, or None where this
    is not glibc (or the environment already configures malloc)."""
    global _applied
    if _applied is not None or not sys.platform.startswith("linux"):
        return _applied
    if os.environ.get("OPD_MALLOC") == "default" or \
            any(os.environ.get(v) for v in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return None
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:  # not glibc: no mallopt
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = {name: value for name, (param, value) in KEEP.items() if mallopt(param, value) == 1}
    _applied = done or None
    return _applied


@lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    """The C library this process already runs (its global symbols: no lookup, no subprocess, unlike
    ctypes.util.find_library, which runs ldconfig)."""
    return ctypes.CDLL(None)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def mallinfo() -> dict | None:
    """glibc's own accounting of the main arena (mallinfo2, glibc >= 2.33), else None. `fordblks`:
    free bytes held for reuse; `hblkhd`: bytes in blocks served by mmap."""
    f = getattr(_libc(), "mallinfo2", None)  # (called after every CPU phase: _libc is looked up once)
    if f is None:
        return None
    f.restype = _MallInfo2
    info = f()
    return {name: int(getattr(info, name)) for name, _ in _MallInfo2._fields_}


def free_heap_bytes() -> int | None:
    """Free bytes malloc holds in its heap for reuse, or None where it cannot say."""
    info = mallinfo()
    return None if info is None else info["fordblks"]


def reset_rss_peak() -> None:
    """Linux: reset the process's peak RSS (VmHWM) so the next reading is this phase's own peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # elsewhere the reading stays the process-lifetime peak


def rss_peak() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def process_age_s() -> float | None:
    """Linux: seconds since this process started (the kernel's start time, 10 ms ticks), so a
    figure can count the interpreter's start and imports too; None where /proc cannot say."""
    try:
        with open("/proc/self/stat") as f:
            start = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime (ticks since boot)
        with open("/proc/uptime") as f:
            age = float(f.read().split()[0]) - start / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return round(age, 2) if 0 <= age < 1e7 else None
