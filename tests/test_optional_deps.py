"""Optional dependencies stay optional: every module of `stages` imports, and `opd plan` and a tiny
`opd run` work, in an interpreter where Triton, bitsandbytes, verl, trl or gguf cannot be imported.

CPU builds of torch ship no Triton, and README line 1 installs neither bitsandbytes nor verl. The
test venv has them all, so each case hides one in a fresh interpreter (`sys.modules[name] = None`
makes `import name` raise ImportError, as a missing package does) and then imports or runs what a
user would. A module that needs one of them at import time fails here with its own traceback.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from support import ROOT, TINY

OPTIONAL = ("triton", "bitsandbytes", "verl", "trl", "gguf")
# modules that exist to drive an optional dependency and are imported only where it is present
NEEDS_ITS_DEPENDENCY: dict[str, str] = {}


def _hidden(names: tuple[str, ...], body: str, cwd=ROOT, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run `body` in a fresh interpreter in which `names` (and their submodules) cannot be imported."""
    prelude = textwrap.dedent(f"""
        import sys
        for n in {list(names)!r}:
            sys.modules[n] = None  # `import n` now raises ImportError, as for a package not installed
    """)
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(body)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env={**_env(), "PYTHONPATH": str(ROOT)})


def _env() -> dict:
    import os

    return {**os.environ, "TOKENIZERS_PARALLELISM": "false"}


def _modules() -> list[str]:
    return sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                  for p in (ROOT / "stages").rglob("*.py"))


def test_the_hiding_works():
    """The mechanism itself: a hidden package raises ImportError, which is what the code catches."""
    r = _hidden(("triton",), "try:\n import triton\nexcept ImportError:\n print('hidden')\n")
    assert r.stdout.strip() == "hidden", r.stderr


@pytest.mark.parametrize("name", OPTIONAL)
def test_every_module_imports_without(name):
    mods = [m for m in _modules() if NEEDS_ITS_DEPENDENCY.get(m) != name]
    r = _hidden((name,), f"""
        import importlib, json, traceback
        failed = {{}}
        for m in {mods!r}:
            try:
                importlib.import_module(m)
            except Exception:
                failed[m] = traceback.format_exc().strip().splitlines()[-1]
        print(json.dumps(failed))
    """)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {}
    assert len(mods) > 60  # (every module was tried, not an empty list)


def _opd(names: tuple[str, ...], *args: str, cwd) -> subprocess.CompletedProcess:
    return _hidden(names, f"""
        sys.argv = ["opd", *{list(args)!r}]
        from stages.cli import main
        sys.exit(main())
    """, cwd=cwd)


def test_plan_and_a_tiny_run_without_triton_and_bitsandbytes(tmp_path):
    """What README line 1 reaches, on a machine without Triton or bitsandbytes: the plan, then the
    training loop, evaluation and export of a tiny run."""
    (tmp_path / "conf").symlink_to(ROOT / "conf")
    hidden = ("triton", "bitsandbytes")
    r = _opd(hidden, "plan", *TINY, "--out", "plan.json", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["device"] == "cpu" and plan["feasible"] is True  # (a tiny pair fits any machine)
    assert set(plan["phases"]) >= {"rollout", "score", "update"} and plan["peak_gib"] > 0
    r = _opd(hidden, "run", *TINY, "train.updates=2", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    run = tmp_path / "artifacts" / "runs" / "default"
    assert (run / "step-0002").exists() and not (run / "step-0003").exists()
    hist = (run / "history.csv").read_text().splitlines()
    assert len(hist) == 3  # header + one row per update


def test_help_and_doctor_work_without_torch(tmp_path):
    """`opd --help` and `opd doctor` import no torch: doctor reports a broken torch as a finding."""
    r = _opd(("torch",), "--help", cwd=tmp_path)
    assert r.returncode == 0 and "doctor" in r.stdout, r.stderr
    r = _opd(("torch",), "doctor", cwd=tmp_path)
    assert "torch" in r.stdout and "Traceback" not in r.stderr, r.stdout + r.stderr
