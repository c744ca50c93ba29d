"""MKL's strict reproducibility in every `opd` process, the thread count out of CPU identity under it,
a user's non-strict MKL_CBWR never silent, the stack record and the lock comparison."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from support import OPD, ROOT, TINY, session
from stages.run import codepaths, reproducible
from stages.tools import doctor

needs_mkl = pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch's BLAS is not MKL here")


def _run(argv, cwd, **env_changes):
    """A fresh process with MKL_CBWR as a user's shell would have it (None: not set at all)."""
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    env["TOKENIZERS_PARALLELISM"] = "false"
    for k, v in env_changes.items():
        if v is not None:
            env[k] = v
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _doctor_checks(cwd, **env) -> dict:
    r = _run([OPD, "doctor", "--format", "json"], cwd, **env)
    return {c["name"]: c for c in json.loads(r.stdout)["checks"]}


@needs_mkl
def test_a_fresh_opd_process_runs_mkl_in_strict_mode(tmp_path):
    """The console script sets MKL_CBWR before torch loads, and MKL itself reports the mode (what
    it computes with, not just what the environment says)."""
    c = _doctor_checks(tmp_path, MKL_CBWR=None)["cpu reproducibility"]
    assert c["status"] == "ok" and "AUTO,STRICT" in c["detail"], c
    # so does any script calling process_settings() before torch; importing the package alone changes nothing
    code = ("from stages.tools.process import process_settings; process_settings(); import torch; "
            "from stages.run import reproducible as r; print(r.mode(), __import__('os').environ['MKL_CBWR'])")
    out = _run([sys.executable, "-c", code], tmp_path, MKL_CBWR=None, PYTHONPATH=str(ROOT)).stdout.split()
    assert out == ["AUTO,STRICT", "AUTO,STRICT"]
    # importing torch (and running MKL) first is too late: MKL reads the variable once
    late = ("import torch; torch.ones(8, 8) @ torch.ones(8, 8); from stages.tools.process import process_settings; "
            "process_settings(); from stages.run import reproducible as r; print(r.mode())")
    assert _run([sys.executable, "-c", late], tmp_path, MKL_CBWR=None, PYTHONPATH=str(ROOT)).stdout.split() == ["BRANCH_OFF"]


@needs_mkl
@pytest.mark.parametrize("user", ["AUTO", ""])
def test_a_users_non_strict_mkl_cbwr_is_kept_with_a_warning_and_joins_identity(work, user):
    """A user's own MKL_CBWR wins (it may be deliberate), but never silently: one warning line,
    and the thread count joins the CPU identity, so its results never mix with strict ones."""
    assert _doctor_checks(work, MKL_CBWR=user)["cpu reproducibility"]["status"] == "warn"
    strict = _run([OPD, "stage", "rollout", "--step", "1", *TINY], work, MKL_CBWR=None)
    loose = _run([OPD, "stage", "rollout", "--step", "1", *TINY], work, MKL_CBWR=user)
    assert strict.returncode == 0 and loose.returncode == 0, loose.stderr
    warnings = [ln for ln in loose.stderr.splitlines() if ln.startswith("warning: MKL runs without strict")]
    assert len(warnings) == 1 and "joins every CPU stage's identity" in warnings[0]
    assert "warning: MKL" not in strict.stderr
    digest = lambda r: re.search(r"store/rollout/(\w+)/", r.stdout).group(1)  # noqa: E731
    assert digest(strict) != digest(loose)  # two store entries: neither run reuses the other's bytes


def test_thread_count_is_in_cpu_identity_only_without_strict_mode(work):
    one, two = session(work, "runtime.threads=1"), session(work, "runtime.threads=2")
    if reproducible.thread_independent(reproducible.mode()):
        assert one.runtime_slice() == two.runtime_slice() and "threads" not in one.runtime_slice()
        assert one.chain.rollout(1) == two.chain.rollout(1) and one.chain.update(2) == two.chain.update(2)
    else:  # no MKL, or a user's non-strict mode: results may depend on it
        assert one.runtime_slice()["threads"] == 1 and two.runtime_slice()["threads"] == 2


def test_stack_record(monkeypatch):
    s = reproducible.stack()
    assert set(s) == {"python", *reproducible.STACK_PACKAGES, "cpu", "mkl_cbwr", "gpu", "digest"}
    assert s["torch"] == torch.__version__ and re.fullmatch(r"[0-9a-f]{32}", s["digest"])
    assert s["cpu"].endswith(f"({torch.backends.cpu.get_cpu_capability()})")


def test_lock_differences_are_listed_by_doctor(tmp_path, monkeypatch):
    import transformers

    public = torch.__version__.split("+")[0]
    lock = tmp_path / "requirements.lock"
    lock.write_text(f"# comment\ntorch=={public}\ntransformers==0.0.1\nnot-a-package-here==1.0\nPyArrow=="
                    f"{__import__('pyarrow').__version__}\n")
    # torch by public version (a local build label is no difference); uninstalled lock entries are none
    assert reproducible.lock_differences(lock) == [("transformers", transformers.__version__, "0.0.1")]
    monkeypatch.setattr("stages.run.config.ROOT", tmp_path)
    c = {x.name: x for x in doctor.check_reproducibility()}["lock"]
    assert c.status == doctor.WARN and f"transformers {transformers.__version__} (lock 0.0.1)" in c.detail
    lock.write_text(f"torch=={public}\n")
    c = {x.name: x for x in doctor.check_reproducibility()}["lock"]
    assert c.status == doctor.OK and "(1 locked)" in c.detail


def test_committed_lock_pins_the_stack_and_install_sh_reads_it():
    lock = reproducible.read_lock(ROOT / "requirements.lock")
    for name in reproducible.STACK_PACKAGES:
        assert re.fullmatch(r"\d+(\.\d+)+", lock[name]), (name, lock.get(name))  # exact, no local label
    install = (ROOT / "install.sh").read_text()
    assert "sed -n 's/^torch==//p' \"$LOCK\"" in install and 'grep -v \'^torch==\' "$LOCK"' in install


@pytest.mark.skipif(not os.environ.get("CI"), reason="only CI's venv is made by ./install.sh test from the lock")
def test_ci_installed_exactly_the_lock():
    assert reproducible.lock_differences(ROOT / "requirements.lock") == []


def test_compiled_decode_joins_cuda_identity_only(work, monkeypatch):
    """runtime.compile changes CUDA bytes (fused kernels round differently), never CPU ones: on CPU
    both settings share every digest; a CUDA session with graphs names the compiled step."""
    on, off = session(work, "runtime.compile=true"), session(work, "runtime.compile=false")
    assert not codepaths.compiled_decode(on.cfg, on.device.type) and on.runtime_slice() == off.runtime_slice()
    assert on.chain.rollout(1) == off.chain.rollout(1) and on.chain.update(2) == off.chain.update(2)
    monkeypatch.setattr(on, "device", torch.device("cuda"))
    compiled = lambda: codepaths.compiled_decode(on.cfg, on.device.type)  # noqa: E731  (what Resident asks)
    assert compiled() and on.runtime_slice()["decode"] == "project+rope_attention-blocks"
    monkeypatch.setattr(on.cfg.rollout, "cuda_graphs", False)
    assert not compiled() and "decode" not in on.runtime_slice()  # eager CUDA: no compiled step


def test_compiled_layers_join_cuda_identity_only(work, monkeypatch):
    """runtime.compile_layers (off by default) changes CUDA bytes, never CPU ones; on CUDA it names
    the compiled layers, and only for an unquantized model."""
    on, off = session(work, "runtime.compile_layers=true"), session(work)
    assert not off.cfg.runtime.compile_layers
    assert on.runtime_slice() == off.runtime_slice() and on.chain.update(2) == off.chain.update(2)
    for s in (on, off):
        monkeypatch.setattr(s, "device", torch.device("cuda"))
    assert on.runtime_slice()["layers"] == "compiled" and "layers" not in off.runtime_slice()
    layers = lambda s, m: codepaths.compiled_layers(s.cfg, m, s.device.type)  # noqa: E731  (what Resident asks)
    assert layers(on, on.cfg.teacher) and not layers(off, off.cfg.teacher)
    monkeypatch.setattr(on.cfg.student, "quant", "nf4")
    assert not layers(on, on.cfg.student) and layers(on, on.cfg.teacher)
