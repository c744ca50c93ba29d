#!/usr/bin/env bash
# One call on the lent GPU machine (the `device` tool): install what it lacks from carried wheels,
# run every GPU-marked test, then the systems benchmark (ours, TRL, miniVERL), logs and results under $OUT.
#   here:   ../shared/device/wheels.sh hydra-core==1.3.2 omegaconf==2.3.0 trl==1.16.0 datasets==5.2.0 \
#             dill==0.4.1 multiprocess==0.70.19 bitsandbytes==0.50.0 miniverl==0.16.0 pydantic pydantic-core \
#             platformdirs annotated-types typing-inspection typing-extensions
#           pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3   (an sdist upstream)
#           (and the SmolLM2 tokenizer files in .bench/smollm2-tokenizer: `opd stage prepare` once, then
#            copy artifacts/store/tokenizer/<digest> there; .whl and .bench in .git/info/exclude)
#           py-spy==0.4.3   (for `first`)
#   device: run(command="bash benchmarks/device_run.sh [tests|bench|all|decode|first|sdpa|lora]", carry=[".whl", ".bench"])
#   (decode: benchmarks/decode_kernels.py's variants, OPD_DECODE_VARIANTS / OPD_DECODE_SHAPES;
#    first: benchmarks/first_update.py, fresh processes' construction + first update, the last sampled
#    by py-spy; OPD_FIRST_EXTRA: more of its options, e.g. "--sampler none --against-tree .ab/base" with
#    the code before a change in .ab/base (here: `git archive REV stages conf | tar -x -C .ab/base`, .ab in
#    .git/info/exclude, carried: carry=[".whl", ".bench", ".ab"]), interleaved with the code now; sdpa: benchmarks/sdpa_first_call.py, the first
#    attention calls per SDPA backend at the seed shapes, a fresh process each; lora: benchmarks/lora_kernels.py,
#    the student's LoRA projections as PEFT and as stages/weights/lora_kernels.py compute them; OPD_LORA_EXTRA: more
#    of its options, e.g. "--rows 3072,12288" for where the kernels start to win launched eagerly)
# The embedded GGUF model is over the carry limit, so tests take the tokenizer from .bench
# (OPD_TEST_TOKENIZER) and the benchmark builds random-init models of the real shapes.
# Durations seen on the H200 (2026-12-01, with the compiled decode step): tests ~390 s (the byte-
# identity tests ~120 + 85 s of it), 227 s since the processes keep their bytecode (b1bed9b, without
# the compile-layers test); bench: seed models ~30 s, ours ~45 s per arm (default, eager,
# ckpt), TRL ~50 s, miniVERL at --peer-updates 3: hf_reference ~100 s, hf_cached ~45 s, the compiled
# arm >128 s (never finished in its share), workload b ~40 s of seed + ~60 s. With the tests in five
# groups side by side (below), `all` is meant to fit one 600 s call with the benchmark's arms cut to
# what is left (OPD_DEADLINE_S=560; OPD_BENCH_EXTRA, e.g. "--ours default,nf4 --peers trl"); the whole
# benchmark still needs its own call (`bench`, OPD_DEADLINE_S=555 and timeout 600).
# OPD_TESTS: a subset of the GPU tests in one process (pytest paths and options).
# OPD_TESTS_K: a pytest -k expression for the GPU tests (OPD_TESTS splits on spaces: a -k expression with
# spaces in it there selects nothing; 2026-12-04, 15847d0's call ran no test that way).
# OPD_BENCH_EXTRA: more systems.py options, later ones win (e.g. "--ours default --peers miniverl").
# OPD_PROFILE_B=1: the same for workload b's default (profile-b.txt; ~80 s more).
# OPD_PROFILE=1: also a torch.profiler table of one step and the rollout split (profile.txt); the first
# update's construction is `first` (py-spy; cProfile distorted it).
# OPD_DEADLINE_S (default 520): seconds from this script's start by which the benchmark stops
# starting systems (the ones skipped are recorded as such, and leave the exit code 0), so the call
# ends inside its limit (2026-12-04, 3085b35: the GPU tests took 376 s on a fresh machine, the
# benchmark 135 s for ours twice and TRL; the deadline skipped miniVERL, then workload b's seed, not
# yet under the deadline's check, ran the call past 600 s).
# The device copy's .git is not refreshed with the work tree (2026-12-01: `git rev-parse HEAD` there
# printed the session's first commit in every call): name the commit that ran from here, not from it.
# At most 8 files come back from $OUT: env.txt, gpu-tests.log, gpu-replay.json, systems.log,
# profile.txt, systems/<date>-<gpu>-systems.{json,md}; `first`: env.txt, first.log,
# first/first-update.{json,md,pyspy.gz} (133 s on a fresh machine, 2026-12-02).
set -uo pipefail
what=${1:-all}  # one mode or several, in one argument ("lora all": the LoRA benchmark, then tests and benchmark)
has() { [[ " $what " == *" $1 "* ]]; }
out=${OUT:-/tmp/out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:$PWD OPD_TEST_TOKENIZER=$PWD/.bench/smollm2-tokenizer TOKENIZERS_PARALLELISM=false
# Bytecode: the image's torch ships no .pyc files (env.txt, 2026-12-01 75529ba: 0, dir writable) and
# the carried wheels install uncompiled, so every fresh process compiled its imports from source (~9 s
# of builtins.compile under cProfile in one first update, -5382a9e-profile.txt): an installation
# artefact a user's `pip install` (which compiles) does not have. Bytecode writing is allowed for this
# call, so the first process to import a module writes its .pyc and later ones read it. (A
# PYTHONPYCACHEPREFIX cache instead made it worse at 75529ba, init 10 -> 19 s: it also ignores the
# .pyc files transformers does ship.)
dont_write=${PYTHONDONTWRITEBYTECODE-unset}
unset PYTHONDONTWRITEBYTECODE
{
  echo "PYTHONDONTWRITEBYTECODE in the image: $dont_write"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  python3 -c 'import torch, transformers, peft; print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__)'
  python3 - <<'PY'
import os, transformers, torch
for m in (torch, transformers):  # whether the image ships bytecode beside its sources (see above)
    d = os.path.dirname(m.__file__)
    n = sum(f.endswith(".pyc") for _, _, fs in os.walk(d) for f in fs)
    print(m.__name__, d, "pyc files:", n, "writable:", os.access(d, os.W_OK))
PY
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1
} >"$out/env.txt" 2>&1
rc=0
if has decode; then
  # the decode step's variants side by side (benchmarks/decode_kernels.py; ~15 s per variant at the seed shapes)
  python3 benchmarks/decode_kernels.py --shapes "${OPD_DECODE_SHAPES:-a,b}" \
    --variants "${OPD_DECODE_VARIANTS:-kernels,kernels:nodraw,fused,fused:nodraw,compiled,eager}" --out "$out/decode" 2>&1 \
    | tee "$out/decode.log" | tail -20
  rc=$(( rc || PIPESTATUS[0] ))
fi
if has first; then
  # shellcheck disable=SC2086
  python3 benchmarks/first_update.py --tokenizer .bench/smollm2-tokenizer --out "$out/first" --runs 3 ${OPD_FIRST_EXTRA:-} 2>&1 \
    | tee "$out/first.log" | tail -40
  rc=$(( rc || PIPESTATUS[0] ))
fi
if has lora; then
  # the student's LoRA projections, PEFT against stages/weights/lora_kernels.py (~1 min)
  # shellcheck disable=SC2086
  python3 benchmarks/lora_kernels.py --out "$out/lora" ${OPD_LORA_EXTRA:-} 2>&1 | tee "$out/lora.log" | tail -12
  rc=$(( rc || PIPESTATUS[0] ))
fi
if has sdpa; then
  python3 benchmarks/sdpa_first_call.py --out "$out/sdpa" 2>&1 | tee "$out/sdpa.log" | tail -20
  rc=$(( rc || PIPESTATUS[0] ))
fi
# The GPU tests in five groups run side by side (the GPU and the 16 cores hold them; alone, the files
# took 429 s one after another in the heaviest half and 230 s in the other on an H100), balanced by
# those files' durations, so that `all` (tests, then the benchmark) fits one 600 s call; their logs
# end up in one file, gpu-tests.log, one section per group. The warm-up's file is a group of its own:
# with the replay and off-policy files beside it, that group ran ~125 s past the next longest and left
# workload b no time (benchmarks/results/INDEX.md, "GPU tests").
groups=(
  "tests/gpu/test_gpu_cross.py tests/gpu/test_gpu_identity.py tests/gpu/test_gpu_lora.py tests/gpu/test_gpu_optimizer.py"
  "tests/gpu/test_gpu_warmup.py"
  "tests/gpu/test_gpu_families.py tests/test_placement.py"
  "tests/gpu/test_gpu_engine.py tests/gpu/test_gpu_kernels.py tests/gpu/test_gpu_graphs.py"
)
gpu_tests() {  # $1: log file, then pytest paths/options
  local log=$1; shift
  # shellcheck disable=SC2086
  OPD_GPU_RECORD="$out/gpu-replay.json" python3 -m pytest -q -m gpu -p no:cacheprovider "$@" \
    ${OPD_TESTS_K:+-k "$OPD_TESTS_K"} >"$log" 2>&1
}
if has tests || has all; then
  if [ -n "${OPD_TESTS:-}" ]; then  # pytest paths/options: a subset, in one process
    # shellcheck disable=SC2086
    gpu_tests "$out/gpu-tests.log" $OPD_TESTS || rc=1
    tail -25 "$out/gpu-tests.log"
  else
    pids=(); rest=()
    for i in "${!groups[@]}"; do
      # shellcheck disable=SC2086
      gpu_tests "$out/gpu-tests-$i.log" ${groups[$i]} & pids+=($!)
      # shellcheck disable=SC2206
      rest+=($(printf -- '--ignore=%s ' ${groups[$i]}))
    done
    gpu_tests "$out/gpu-tests-${#groups[@]}.log" tests "${rest[@]}" & pids+=($!)  # every other test file
    for p in "${pids[@]}"; do wait "$p" || rc=1; done
    for i in $(seq 0 "${#groups[@]}"); do
      { echo "=== group $i: ${groups[$i]:-every other file} ==="; cat "$out/gpu-tests-$i.log"; } >>"$out/gpu-tests.log"
      tail -3 "$out/gpu-tests-$i.log"; rm "$out/gpu-tests-$i.log"  # (a call cut short returns them as they are)
    done
  fi
fi
if has bench || has all; then
  left=$(( ${OPD_DEADLINE_S:-520} - SECONDS ))
  work=$(mktemp -d /tmp/opd-bench-XXXXXX)  # a fresh work dir: nothing of an earlier run is reused
  python3 benchmarks/systems.py --workload all --peers trl,miniverl --tokenizer .bench/smollm2-tokenizer \
    --out "$out/systems" --work "$work" ${OPD_PROFILE:+--profile "$out/profile.txt"} \
    ${OPD_PROFILE_B:+--profile-b "$out/profile-b.txt"} --deadline-s "$left" --peer-updates 3 \
    ${OPD_BENCH_DATE:+--date "$OPD_BENCH_DATE"} ${OPD_BENCH_EXTRA:-} 2>&1 | tee "$out/systems.log" | tail -40
  rc=$(( rc || PIPESTATUS[0] ))
fi
exit "$rc"
