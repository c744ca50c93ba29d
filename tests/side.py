"""Side installs for tests that need other versions than the venv's: exact pins, --no-deps, into a
cache dir outside the venv's site-packages, put first on a subprocess's PYTHONPATH (torch, numpy,
peft, ... still come from the venv).

    transformers-4.57   what verl 0.8.0 runs on: its vLLM extra pins vllm<=0.12, which needs transformers<5
    verl-runtime        the imports `python -m verl.trainer.main_ppo` makes beyond the conformance extra
    transformers-5.17   the GPU machine's transformers, with scikit-learn (tests/weights/test_imports.py)

Created on first use (one pip call each, from PyPI), or up front by `python tests/side.py` (install.sh
test does). OPD_SIDE_DIR moves the cache (default ~/.cache/opd-stages/side).
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

SIDE = {
    "transformers-4.57": ["transformers==4.57.6", "tokenizers==0.22.2", "huggingface_hub==0.36.2"],
    "verl-runtime": ["torchdata==0.11.0", "cachetools==8.0.2", "fastapi==0.165.0", "starlette==1.10.0",
                     "uvicorn==0.54.0", "opentelemetry-api==1.45.2"],
    "transformers-5.17": ["transformers==5.17.0", "huggingface_hub==1.33.0", "httpx==0.29.0", "httpcore==1.0.9", "scikit-learn==1.9.1", "scipy==1.17.1",
                          "joblib==1.6.0", "threadpoolctl==3.8.0", "narwhals==2.29.0"],
}


def side_dir(name: str) -> Path:
    """The installed side dir for SIDE[name] (installing it if needed); RuntimeError naming pip's error."""
    pins = SIDE[name]
    root = Path(os.environ.get("OPD_SIDE_DIR") or Path.home() / ".cache" / "opd-stages" / "side")
    d = root / f"{name}-{hashlib.sha256(' '.join(pins).encode()).hexdigest()[:12]}"
    if (d / ".complete").is_file():
        return d
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "a") as lock:  # two test processes: one installs, the other waits
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (d / ".complete").is_file():
            return d
        tmp = root / f".{d.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                            "--target", str(tmp), *pins], capture_output=True, text=True)
        if r.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(f"pip install --target {tmp} {' '.join(pins)} failed: {r.stderr.strip()[-500:]}")
        (tmp / ".complete").write_text("\n".join(pins) + "\n")
        os.replace(tmp, d)
    return d


def env_with(name: str, **extra: str) -> dict:
    """os.environ with SIDE[name]'s dir first on PYTHONPATH."""
    path = os.pathsep.join(p for p in (str(side_dir(name)), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false", **extra}


if __name__ == "__main__":
    for n in SIDE:
        print(f"{n}: {side_dir(n)}")
