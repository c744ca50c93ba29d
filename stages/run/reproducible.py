"""Bit-reproducible CPU arithmetic: MKL's strict conditional numerical reproducibility (CNR).

torch's CPU BLAS is MKL. Without CNR, MKL picks an SGEMM code path by the alignment of the output,
and torch's CPU flash-attention kernel gives intra-op thread t a slice of one scratch buffer at
`buf + t*(L+2+16)` floats (L: the KV length) and calls SGEMM into it. So in decode (batch 4, 2
threads) the rows the second thread computes get different bits than with 1 thread for most KV
lengths: a 2-core machine's rollout differed from a 1-thread one in rows 2-3. With MKL_CBWR=AUTO,STRICT
MKL's results no longer depend on alignment, and (strict) not on the thread count either, for the
BLAS-3 functions torch calls; measured on a 2-core AMD EPYC, 1 and 2 threads then give the same bytes
for a whole run (README, "Guarantees").

MKL reads MKL_CBWR once, when it first initialises (its first BLAS call, which torch or a library
importing it may make at any time after `import torch`), never again. So the variable must be in the
environment before torch is imported: `opd`'s entry point calls `set_env()` first thing
(stages/tools/process.py, `process_settings()`), which covers `opd`, DVC's `opd` subprocesses (they
inherit the environment), and the tests and benchmarks, which call it before importing torch; code
that uses the package as a library calls it too, or runs without strict mode (one warning, below). What MKL actually runs with is read back from MKL itself
(`mode()`), not from the environment: that is what goes into CPU stage identity.

A user's own MKL_CBWR is kept (they may want COMPATIBLE, the same code path on every x86 CPU), but
a mode without STRICT is never silent: one warning, and the thread count joins stage identity
(`identity.runtime_slice`), so results computed under it are never mixed with strict ones.
"""
from __future__ import annotations

import ctypes
import os
import sys
from functools import lru_cache

MODE = "AUTO,STRICT"

_BRANCHES = {0: "OFF", 1: "BRANCH_OFF", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 6: "SSSE3", 7: "SSE4_1",
             8: "SSE4_2", 9: "AVX", 10: "AVX2", 11: "AVX512_MIC", 12: "AVX512", 13: "AVX512_MIC_E1",
             14: "AVX512_E1"}
_STRICT = 0x10000  # mkl_cbwr.h MKL_CBWR_STRICT
_ALL = -1  # MKL_CBWR_ALL (~0): branch and flags


def set_env() -> None:
    """Before torch is imported: strict CNR unless the environment already names a mode."""
    os.environ.setdefault("MKL_CBWR", MODE)


def _mkl_fn(name: str):
    """An MKL service function: torch's wheels link MKL statically into libtorch_cpu (internal
    `mkl_serv_*` names), other builds load libmkl_rt (public names). None: no MKL to ask."""
    import torch

    libs = [os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"), None]
    for lib in libs:
        try:
            h = ctypes.CDLL(lib)
        except (OSError, TypeError):  # no such file; CDLL(None) where the platform has no dlopen(NULL)
            continue
        for sym in (f"mkl_serv_{name}", f"mkl_{name}"):
            f = getattr(h, sym, None)
            if f is not None:
                f.restype = ctypes.c_int
                return f
    return None


@lru_cache(maxsize=1)
def mode() -> str:
    """The CNR mode MKL runs with, e.g. "AUTO,STRICT"; "none" where torch's BLAS is not MKL (or MKL
    cannot be asked). Asking initialises MKL's CNR state: call it only after set_env()."""
    import torch

    if not torch.backends.mkl.is_available():
        return "none"
    get = _mkl_fn("cbwr_get")
    if get is None:
        return "none"
    get.argtypes = [ctypes.c_int]
    v = get(_ALL) & 0xFFFFFFFF
    name = _BRANCHES.get(v & 0xFFFF, str(v & 0xFFFF))
    return name + (",STRICT" if v & _STRICT else "")


def thread_independent(m: str) -> bool:
    """Whether CPU results are the same for every intra-op thread count under MKL mode `m`."""
    return m.endswith(",STRICT")


@lru_cache(maxsize=1)
def check() -> str:
    """mode(), with one warning per process when CPU results will depend on the thread count."""
    m = mode()
    if m != "none" and not thread_independent(m):
        env = os.environ.get("MKL_CBWR")
        why = f"MKL_CBWR={env!r} in the environment" if env != MODE else "MKL initialised before process_settings() ran"
        print(f"warning: MKL runs without strict reproducibility (mode {m}: {why}); CPU results depend "
              f"on the thread count, which joins every CPU stage's identity (call stages.tools.process."
              f"process_settings(), or set MKL_CBWR={MODE}, before torch is imported for thread-independent results)", file=sys.stderr)
    return m


# ---- the stack: what computed the bytes, besides a stage's identity --------------------------------
STACK_PACKAGES = ("torch", "transformers", "peft", "bitsandbytes", "numpy", "pyarrow")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def versions(packages) -> dict:
    """The installed distributions' versions (None where one is missing), read without importing
    them: importing peft to read its version (transformers and bitsandbytes with it) took ~5 s of a
    fully reused `opd run` of ~10."""
    import importlib.metadata as md

    out = {}
    for d in packages:
        try:
            out[d] = md.version(d)
        except md.PackageNotFoundError:
            out[d] = None
    return out


@lru_cache(maxsize=1)
def stack() -> dict:
    """Library versions, CPU model and the instruction set torch dispatches to, MKL's mode and the
    GPU, plus a digest of all that. Recorded in every stage's state.json and the export manifest;
    never part of an identity (a stage found in the store is used whatever stack computed it; this
    says which one did, and `opd doctor` compares the installed one with requirements.lock)."""
    import json
    import platform

    import torch
    import xxhash

    s: dict = {"python": platform.python_version(), **versions(STACK_PACKAGES)}
    s["cpu"] = f"{_cpu_model()} ({torch.backends.cpu.get_cpu_capability()})"
    s["mkl_cbwr"] = mode()
    s["gpu"] = None
    if torch.cuda.is_available():
        cap = ".".join(map(str, torch.cuda.get_device_capability(0)))
        s["gpu"] = f"{torch.cuda.get_device_name(0)} (sm {cap}, CUDA {torch.version.cuda})"
    s["digest"] = xxhash.xxh3_128_hexdigest(json.dumps(s, sort_keys=True).encode())
    return s


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def read_lock(path) -> dict[str, str]:
    """{normalised distribution name: version} of a requirements.lock (`name==version` lines)."""
    out = {}
    for line in open(path):
        line = line.split("#", 1)[0].split(";", 1)[0].strip()
        name, sep, ver = line.partition("==")
        if sep:
            out[_norm(name.strip())] = ver.strip()
    return out


def lock_differences(path) -> list[tuple[str, str, str]]:
    """(name, installed, locked) for every locked distribution installed at another version. torch
    compares by public version (2.13.0+cu130, a GPU user's own build, matches a lock's 2.13.0);
    locked packages that are not installed (e.g. test extras) are not differences."""
    locked = read_lock(path)
    installed = versions(locked)
    out = []
    for name, want in sorted(locked.items()):
        have = installed[name]
        if have is None:
            continue
        same = have.split("+")[0] == want.split("+")[0] if name == "torch" else have == want
        if not same:
            out.append((name, have, want))
    return out
