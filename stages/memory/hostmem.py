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


# ---- host memory a run can still take ----

def _meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (Linux), else {}."""
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    except OSError:
        pass
    return out


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _cgroup_headroom() -> int | None:
    """Bytes this process's memory cgroup (a container's limit) can still take: the limit less what
    the group uses, its inactive page cache counted as free (the kernel reclaims it first). None
    without a limit (or where none can be read). cgroup v2, else v1."""
    groups = {}
    for line in (_read("/proc/self/cgroup") or "").splitlines():
        if line.count(":") >= 2:
            _, ctrls, path = line.split(":", 2)
            for ctrl in ctrls.split(","):  # ("" is v2's one hierarchy)
                groups[ctrl] = path
    for ctrl, root, limit, usage, cache in (("", "/sys/fs/cgroup", "memory.max", "memory.current", "inactive_file"),
                                            ("memory", "/sys/fs/cgroup/memory", "memory.limit_in_bytes",
                                             "memory.usage_in_bytes", "total_inactive_file")):
        if ctrl not in groups:
            continue
        # the group's own directory, or (a cgroup namespace: the container sees its group as the root) the root
        for d in (root + groups[ctrl].rstrip("/"), root):
            lim, use = _read(f"{d}/{limit}"), _read(f"{d}/{usage}")
            if lim is None or use is None:
                continue
            lim = lim.strip()
            if lim == "max" or not lim.isdigit() or int(lim) >= 1 << 60:  # (v1 writes "no limit" as ~2^63)
                return None
            stat = dict(ln.split()[:2] for ln in (_read(f"{d}/memory.stat") or "").splitlines() if " " in ln)
            free = int(lim) - int(use.strip()) + int(stat.get(cache, 0))
            return max(0, min(free, int(lim)))
    return None


def available() -> tuple[int, str] | None:
    """(bytes, where the figure comes from) of host memory this process can still use without the
    kernel swapping or killing it: the kernel's MemAvailable (free memory + what it can reclaim),
    lowered to a cgroup limit's headroom (a container), plus the free heap this process's malloc
    keeps for reuse (`keep_freed_memory`: the kernel counts it as used, the process reuses it). None
    where the kernel does not say (not Linux)."""
    info = _meminfo()
    if "MemAvailable" not in info:
        return None
    avail, total = info["MemAvailable"], info.get("MemTotal", 0)
    what = f"detected: host memory available now, of {total / 2**30:.2f} GiB RAM"
    group = _cgroup_headroom()
    if group is not None and group < avail:
        avail, what = group, f"detected: headroom under this cgroup's memory limit, of {total / 2**30:.2f} GiB RAM"
    return avail + (free_heap_bytes() or 0), what
