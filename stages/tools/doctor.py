"""`opd doctor`: is this machine ready to run the pipeline? Versions of the libraries it needs,
CUDA and its memory, the embedded model, a writable artifacts dir, and whether the config in use
(params.yaml, or conf/ + overrides) asks for anything the machine lacks, memory included: the
weight-free memory plan's verdict, the one `opd run` acts on (stages/memory/plan.py `decide`).

Each check is ok, warn (works, but something is degraded or optional is missing) or fail (a
blocker: the pipeline would stop). Exit status 1 when any check fails, else 0. Nothing here loads
model weights, and a missing library is reported, never a traceback.
"""
from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import os
import platform
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import UserError

OK, WARN, FAIL = "ok", "warn", "fail"
# (distribution, import name, required?, why) — required ones are blockers when missing
LIBRARIES = [
    ("torch", "torch", True, "tensors"),
    ("transformers", "transformers", True, "model loading"),
    ("peft", "peft", True, "LoRA"),
    ("accelerate", "accelerate", True, "model loading"),
    ("safetensors", "safetensors", True, "weights, optimizer state"),
    ("pyarrow", "pyarrow", True, "Parquet"),
    ("hydra-core", "hydra", True, "config composition"),
    ("dvc", "dvc", True, "`dvc repro`, experiments, plots"),
    ("gguf", "gguf", True, "reading the embedded GGUF model"),
    ("bitsandbytes", "bitsandbytes", False, "NF4/int8 quantization"),
    ("matplotlib", "matplotlib", False, "`opd report` curves"),
]
MIN_PYTHON = (3, 10)
MIN_FREE_GIB = 2.0


@dataclass
class Check:
    name: str
    status: str
    detail: str


def _version(dist: str, module: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return None
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "installed (version unknown)"


def check_python() -> Check:
    v = sys.version_info
    ok = (v.major, v.minor) >= MIN_PYTHON
    return Check("python", OK if ok else FAIL, f"{platform.python_version()} ({sys.executable})"
                 + ("" if ok else f"; needs >= {'.'.join(map(str, MIN_PYTHON))}"))


def check_libraries() -> list[Check]:
    out = []
    for dist, module, required, why in LIBRARIES:
        v = _version(dist, module)
        if v is not None:
            out.append(Check(dist, OK, v))
        else:
            out.append(Check(dist, FAIL if required else WARN,
                             f"not installed ({why}); `pip install {dist}`" + ("" if required else " if you need it")))
    return out


def check_cuda(cfg) -> list[Check]:
    if importlib.util.find_spec("torch") is None:
        return [Check("cuda", FAIL, "torch is not installed")]
    import torch

    want_cuda = cfg is not None and cfg.runtime.device == "cuda"
    if not torch.cuda.is_available():
        detail = f"not available (torch {torch.__version__}, built for CUDA {torch.version.cuda or 'none'}): runs on CPU"
        if want_cuda:
            return [Check("cuda", FAIL, detail + "; but runtime.device=cuda")]
        return [Check("cuda", OK, detail)]
    out = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        cap = ".".join(map(str, torch.cuda.get_device_capability(i)))
        out.append(Check(f"cuda:{i}", OK, f"{torch.cuda.get_device_name(i)} (sm {cap}), "
                                          f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free; CUDA {torch.version.cuda}"))
    return out


def check_quant(cfg) -> list[Check]:
    """A quantized role needs bitsandbytes, nothing else: on CUDA it runs its CUDA kernels, on a CPU
    (no CUDA, or runtime.device=cpu) its CPU kernels, as `opd plan` assumes and a run does. A CPU
    run is slower than an unquantized one there; said, not a blocker."""
    if cfg is None:
        return []
    roles = [r for r in ("student", "teacher") if getattr(cfg, r).quant != "none"]
    if not roles:
        return []
    what = ", ".join(f"{r}.quant={getattr(cfg, r).quant}" for r in roles)
    v = _version("bitsandbytes", "bitsandbytes")
    if v is None:
        return [Check("quantization", FAIL, f"{what}: bitsandbytes is not installed; "
                                            "`pip install 'opd-stages[quant]'`")]
    import torch

    if cfg.runtime.device != "cpu" and torch.cuda.is_available():
        return [Check("quantization", OK, f"{what}: bitsandbytes {v} on CUDA")]
    return [Check("quantization", OK, f"{what}: bitsandbytes {v} on the CPU: runs, slower than unquantized (its "
                                      "CPU kernels; on a CPU, quantize to fit memory, not for speed)")]


def check_memory(cfg) -> list[Check]:
    """The memory plan of the config, judged as a run judges it before any weights load: on the CPU a
    peak past the host memory available is a blocker (the run refuses) and one within
    plan.HOST_BAND of it a warning; on CUDA an infeasible plan is a warning (the run warns, then
    retries smaller chunks on OOM)."""
    if cfg is None:
        return []
    from ..memory import plan

    try:
        est = plan.estimate(cfg)
    except UserError as e:  # shapes unreadable (a model not fetched yet), or a setting the plan refuses
        return [Check("memory plan", WARN, f"no plan: {e}")]
    h = est.get("host_check")  # (CPU)
    if h is not None:
        if h["verdict"] != "ok":
            return [Check("memory plan", FAIL if h["verdict"] == "refuse" else WARN, h["message"])]
        return [Check("memory plan", OK, f"cpu: peak {est['peak_gib']:.2f} GiB ({est['peak_phase']}) of "
                                         f"{h['budget_gib']:.2f} GiB ({h['budget_source']}); `opd plan` shows each "
                                         "phase")]
    if not est["feasible"]:
        return [Check("memory plan", WARN, plan.infeasible_message(est))]
    return [Check("memory plan", OK, f"{est['device']}: peak {est['peak_gib']:.2f} GiB ({est['peak_phase']}, "
                                     f"placement {est['placement']['chosen']}) of {est['usable_gib']:.2f} GiB usable "
                                     f"({est['budget_source']}); `opd plan` shows each phase")]


def check_embedded(cfg) -> Check:
    from ..weights import models

    # the embedded tokenizer also serves `arch:` (random-init) models
    needed = cfg is None or any(getattr(cfg, r).name == "embedded" or getattr(cfg, r).name.startswith("arch:")
                                for r in ("student", "teacher"))
    try:
        p = models.gguf_path()
    except UserError as e:
        return Check("embedded model", FAIL if needed else WARN, str(e).removeprefix("model 'embedded': "))
    return Check("embedded model", OK, f"SmolLM2-135M-Instruct, {p.stat().st_size / 2**20:.0f} MiB GGUF at {p}")


def check_artifacts(artifacts: str) -> list[Check]:
    d = Path(artifacts).resolve()
    probe = d
    while not probe.exists():  # the first existing ancestor is where the dir would be created
        probe = probe.parent
    try:
        fd, tmp = tempfile.mkstemp(prefix=".opd-doctor-", dir=probe)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        return [Check("artifacts dir", FAIL, f"{d}: not writable ({e.strerror})")]
    out = [Check("artifacts dir", OK, f"{d} writable" + ("" if d.exists() else " (will be created)"))]
    free = shutil.disk_usage(probe).free / 2**30
    out.append(Check("disk", OK if free >= MIN_FREE_GIB else WARN,
                     f"{free:.1f} GiB free at {probe}" + ("" if free >= MIN_FREE_GIB else
                                                          f"; less than {MIN_FREE_GIB:g} GiB")))
    return out


def check_reproducibility() -> list[Check]:
    """MKL's reproducibility mode (CPU bytes independent of thread count only when strict), the
    stack digest that every stage records, and how the installed stack differs from the lock."""
    from ..run import reproducible
    from ..run.config import ROOT

    m = reproducible.mode()
    if m == "none":
        out = [Check("cpu reproducibility", WARN, "torch's BLAS is not MKL: CPU results may depend on the thread "
                                                  "count, which therefore joins CPU stage identity")]
    elif reproducible.thread_independent(m):
        out = [Check("cpu reproducibility", OK, f"MKL_CBWR {m}: CPU results do not depend on the thread count")]
    else:
        out = [Check("cpu reproducibility", WARN, f"MKL_CBWR {m} (environment: {os.environ.get('MKL_CBWR')!r}): CPU "
                                                  "results depend on the thread count, which joins CPU stage identity; "
                                                  f"unset MKL_CBWR or set {reproducible.MODE}")]
    s = reproducible.stack()
    out.append(Check("stack", OK, f"{s['digest'][:12]}: torch {s['torch']}, transformers {s['transformers']}, "
                                  f"peft {s['peft']}, numpy {s['numpy']}, pyarrow {s['pyarrow']}; CPU {s['cpu']}"
                                  + (f"; GPU {s['gpu']}" if s["gpu"] else "")))
    lock = ROOT / "requirements.lock"
    if not lock.is_file():
        out.append(Check("lock", OK, f"no {lock.name} next to the package (not a source install): "
                                     "versions are whatever pip resolved"))
        return out
    diff = reproducible.lock_differences(lock)
    if diff:
        what = ", ".join(f"{n} {have} (lock {want})" for n, have, want in diff)
        out.append(Check("lock", WARN, f"{len(diff)} package(s) differ from {lock}: {what}; the same digests may "
                                       "compute other bytes than a locked install (./install.sh installs the lock)"))
    else:
        n = len(reproducible.read_lock(lock))
        out.append(Check("lock", OK, f"installed packages match {lock.name} ({n} locked)"))
    return out


def load_config(params: str | None, overrides: list[str]):
    """(config or None, a Check describing where it came from)."""
    from ..run import config

    try:
        if params:
            return config.load(params), Check("config", OK, f"{params}")
        if not overrides and Path("params.yaml").is_file():
            return config.load("params.yaml"), Check("config", OK, "params.yaml")
        conf = config.conf_dir()
        cfg = config.compose(overrides, conf)
        return cfg, Check("config", OK, f"{'conf/' if conf == Path.cwd() / 'conf' else 'built-in conf/'}" +
                          (f" + {' '.join(overrides)}" if overrides else ""))
    except UserError as e:
        return None, Check("config", FAIL, str(e))


def run(params: str | None = None, overrides: list[str] | None = None) -> list[Check]:
    checks = [check_python(), *check_libraries()]
    if any(c.status == FAIL for c in checks if c.name in ("torch", "hydra-core", "pyarrow", "safetensors")):
        return checks  # the rest imports these
    cfg, c = load_config(params, list(overrides or []))
    checks.append(c)
    checks += check_cuda(cfg)
    checks += check_reproducibility()
    checks += check_quant(cfg)
    checks.append(check_embedded(cfg))
    if not any(c.status == FAIL for c in checks if c.name in ("quantization", "embedded model", "cuda")):
        checks += check_memory(cfg)  # (a plan for a run that cannot start says nothing more)
    checks += check_artifacts(cfg.artifacts if cfg is not None else "artifacts")
    return checks


def main(args) -> int:
    checks = run(args.params, args.overrides)
    blockers = [c for c in checks if c.status == FAIL]
    if args.format == "json":
        json.dump({"ok": not blockers, "checks": [asdict(c) for c in checks]}, sys.stdout, indent=1)
        print()
    else:
        mark = {OK: "ok  ", WARN: "warn", FAIL: "FAIL"}
        width = max(len(c.name) for c in checks)
        for c in checks:
            print(f"{mark[c.status]}  {c.name:<{width}}  {c.detail}")
        print(f"{len(blockers)} blocker(s)" if blockers else "ready: no blockers")
    return 1 if blockers else 0
