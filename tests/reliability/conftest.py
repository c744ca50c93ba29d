"""Fixtures of the reliability suite: one fork server and ONE reference run per session; every
test starts from a hard-linked copy of (part of) the reference artifacts, never from scratch."""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import ROOT, TINY, Proc, Server  # noqa: E402
from support import DEFAULT_THREADS  # noqa: E402
import tracer  # noqa: E402


class Work:
    """A working dir (conf/ + artifacts/) and the `opd` processes run in it, all read-traced."""

    conf = ROOT / "conf"  # replaced by the session's snapshot of conf/ (see `server`)

    def __init__(self, server: Server, path: Path):
        self.server, self.dir = server, path
        self.trace = path / ".trace"
        self.trace.mkdir(parents=True, exist_ok=True)
        if not (path / "conf").exists():
            (path / "conf").symlink_to(self.conf)

    @property
    def artifacts(self) -> Path:
        return self.dir / "artifacts"

    def _env(self, env):
        return {"OPD_TEST_TRACE": str(self.trace), "OPD_FAULT": None, **(env or {})}

    def opd(self, *argv: str, env: dict | None = None) -> Proc:
        return self.server.run(*argv, cwd=self.dir, env=self._env(env))

    def run(self, *overrides: str, env: dict | None = None) -> Proc:
        """`opd run` on the tiny models (+ overrides)."""
        return self.opd("run", *TINY, *overrides, env=env)

    def start(self, *overrides: str, env: dict | None = None) -> int:
        return self.server.start("run", *TINY, *overrides, cwd=self.dir, env=self._env(env))

    def step_digest(self, stage: str, k: int) -> str:
        """The digest of step k's rollout / score / update, read from the run view."""
        st = json.loads((self.artifacts / "runs" / "default" / f"step-{k:04d}" / "state.json").read_text())
        return st["policy" if stage == "update" else stage]["digest"]

    def forget(self, *what: str) -> None:
        """Remove published stage dirs, e.g. "update:3", "score:3", "evaluate" (all of that stage)."""
        for w in what:
            stage, _, k = w.partition(":")
            for d in (self.artifacts / "store" / stage).iterdir():
                if not d.name.startswith(".") and (not k or d.name == self.step_digest(stage, int(k))):
                    shutil.rmtree(d)

    def bad_reads(self) -> list[str]:
        return tracer.violations(tracer.read_records(self.trace))

    def computed(self) -> list[str]:
        return [f"{r['stage']}/{r['entry']}" for r in tracer.read_records(self.trace) if r["op"] == "computed"]


def link_copy(src: Path, dst: Path, parts=None) -> None:
    """Copy an artifacts dir by hard links (published files are immutable; tests that damage a file
    replace it instead of writing into it). `parts`: only these store/<stage> dirs."""
    if parts is None:
        shutil.copytree(src, dst, symlinks=True, copy_function=os.link)
        return
    for part in parts:
        shutil.copytree(src / "store" / part, dst / "store" / part, symlinks=True, copy_function=os.link)


@pytest.fixture(scope="session")
def server(tmp_path_factory, request):
    # conf/ is snapshotted when the server imports stages/, so config schema and tree always match
    Work.conf = tmp_path_factory.mktemp("conf") / "conf"
    shutil.copytree(ROOT / "conf", Work.conf)
    s = Server(tmp_path_factory.mktemp("procs"))
    request.config._opd_server = s
    yield s
    s.close()
    print(f"\nreliability: {s.n} opd processes, {s.cpu_s:.0f} CPU s", file=sys.stderr)


@pytest.fixture(scope="session")
def reference(server, tmp_path_factory) -> Work:
    """The one uninterrupted run every byte-identity assertion compares against."""
    w = Work(server, tmp_path_factory.mktemp("reference"))
    r = w.run()
    assert r.rc == 0, r
    assert w.bad_reads() == []
    return w


@pytest.fixture
def fresh(server, reference, tmp_path) -> Work:
    """Only the materialised models and tokenizer of the reference (what `prepare` converts once)."""
    w = Work(server, tmp_path / "w")
    link_copy(reference.artifacts, w.artifacts, ["tokenizer", "model"])
    return w


@pytest.fixture
def done(server, reference, tmp_path) -> Work:
    """A copy of the whole reference run (store, run view, export)."""
    w = Work(server, tmp_path / "w")
    link_copy(reference.artifacts, w.artifacts)
    return w


_CPU: dict[str, float] = {}


@pytest.fixture(autouse=True)
def _cpu_account(request):
    import resource

    def now():
        s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        srv = request.session.config._opd_server.cpu_s if hasattr(request.session.config, "_opd_server") else 0
        return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime + srv
    t = now()
    yield
    _CPU[request.node.nodeid] = now() - t


def _machine() -> str:
    """What a cross-machine difference in bytes would be traced to: CPU model, vector ISA, threads."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                k, _, v = ln.partition(":")
                info.setdefault(k.strip(), v.strip())
    except OSError:
        pass
    flags = set(info.get("flags", "").split())
    isa = "/".join(x for x in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if x in flags) or "?"
    model = (f"{info.get('vendor_id', '?')} {info.get('model name', '?')} (family {info.get('cpu family', '?')} "
             f"model {info.get('model', '?')} stepping {info.get('stepping', '?')}, {isa})")
    from stages.run import reproducible

    return (f"{model}, {os.cpu_count()} CPUs, torch {torch.__version__} "
            f"{torch.backends.cpu.get_cpu_capability()}, {DEFAULT_THREADS} threads by default, "
            f"MKL_CBWR {reproducible.mode()}")


def pytest_terminal_summary(terminalreporter):
    if _CPU:
        top = sorted(_CPU.items(), key=lambda kv: -kv[1])[:15]
        terminalreporter.write_line(f"reliability CPU: {sum(_CPU.values()):.0f} s in tests on {_machine()}")
        for k, v in top:
            terminalreporter.write_line(f"  {v:6.1f} s  {k.split('::')[-1]}")
