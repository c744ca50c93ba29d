#!/usr/bin/env bash
# One call on the lent GPU machine (the `device` tool): install what it lacks from carried wheels,
# run every GPU-marked test, then the systems benchmark, logs and results under $OUT.
#   here:   ../shared/device/wheels.sh hydra-core==1.3.2 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 \
#             trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 bitsandbytes==0.50.0
#           (and the SmolLM2 tokenizer files in .bench/smollm2-tokenizer: `opd stage prepare` once, then
#            copy artifacts/store/tokenizer/<digest> there)
#   device: run(command="bash benchmarks/device_run.sh [tests|bench|all]", carry=[".whl", ".bench"])
# The embedded GGUF model is over the carry limit, so tests take the tokenizer from .bench
# (OPD_TEST_TOKENIZER) and the benchmark builds random-init models of the real shapes.
set -uo pipefail
what=${1:-all}
out=${OUT:-/tmp/out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD OPD_TEST_TOKENIZER=$PWD/.bench/smollm2-tokenizer TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$out/install.log" 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/gpu.txt" 2>&1
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$out/gpu-tests.log" | tail -25
  rc=${PIPESTATUS[0]}
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 benchmarks/systems.py --workload a --peers trl --tokenizer .bench/smollm2-tokenizer \
    --out "$out/systems" --work /tmp/bw --profile "$out/profile.txt" 2>&1 | tee "$out/systems.log" | tail -25
  rc=$(( rc || PIPESTATUS[0] ))
fi
exit "$rc"
