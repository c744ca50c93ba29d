"""runtime.warmup on the GPU: the warm-up thread runs beside the models' loads, finishes without an
error (and so does its precompiling child), the tokenizer and the teacher are read ahead (stages/weights/ahead.py), and the run publishes
the same digests and bytes as one without either (they compute nothing the run keeps, and the
capture and phase boundaries join them first). A damaged config.json is repaired before the warm-up reads it."""
from __future__ import annotations

import json

import pytest

from reliability.harness import entry_differences, published
from support import TINY, opd
from test_gpu_identity import fresh

pytestmark = pytest.mark.gpu

RUN = [*TINY, "runtime.device=cuda", "train.updates=2", "rollout.max_new_tokens=16"]


def test_warmup_changes_no_byte_and_reports_its_time(tmp_path, seeded_store):
    """On a fresh Triton cache the children compile and leave their markers; a second run at the same
    shapes (another work dir, the same cache) starts none: the thread loads every part. All three runs,
    and one without the warm-up, publish the same bytes."""
    on, warm, off = (fresh(tmp_path / n, seeded_store) for n in ("on", "warm", "off"))
    cache = {"TRITON_CACHE_DIR": str(tmp_path / "triton")}
    opd("stage", "train", *RUN, cwd=on, env=cache)
    opd("stage", "train", *RUN, cwd=warm, env=cache)
    opd("stage", "train", *RUN, "runtime.warmup=false", cwd=off)
    timings = {d: json.loads((d / "artifacts" / "runs" / "default" / "train.json").read_text())["timings"]
               for d in (on, warm, off)}
    assert "warmup_error" not in timings[on] and timings[on]["warmup_s"] > 0
    # the child compiled the engine's kernels (stages/engine/warmup.py `_child`) and finished first
    assert "precompile_error" not in timings[on] and 0 < timings[on]["precompile_s"] < timings[on]["warmup_s"]
    assert "lora" in timings[on]["precompile_parts"]  # (runtime.lora_kernels: their child too)
    assert "warmup_error" not in timings[warm] and "precompile_parts" not in timings[warm], timings[warm]
    assert timings[warm]["precompile_warm"] == timings[on]["precompile_parts"] and "precompile_s" not in timings[warm]
    assert "warmup_s" not in timings[off] and "precompile_s" not in timings[off]
    assert timings[on]["loaded_ahead"] == ["student_weights", "teacher_weights", "tokenizer", "teacher"]
    assert "loaded_ahead" not in timings[off]
    entries = {e for e in published(on / "artifacts") if e.split("/")[0] in ("init", "rollout", "score", "update")}
    assert entries == {e for e in published(off / "artifacts") if e.split("/")[0] in ("init", "rollout", "score", "update")}
    assert len(entries) == 7, sorted(entries)  # init + 2 steps x rollout/score/update
    assert entry_differences(on / "artifacts", off / "artifacts", entries) == []
    assert entry_differences(warm / "artifacts", off / "artifacts", entries) == []


def test_a_student_sampled_through_transformers_warms_no_engine(tmp_path, seeded_store):
    """NF4 without the dense copy samples through transformers: the warm-up still warms the forwards
    but makes no engine weights and starts no precompiling child (what a small card has room for)."""
    pytest.importorskip("bitsandbytes")
    d = fresh(tmp_path / "small", seeded_store)
    opd("stage", "train", *RUN, "student.quant=nf4", "student.dense_copy=false", cwd=d)
    t = json.loads((d / "artifacts" / "runs" / "default" / "train.json").read_text())["timings"]
    assert "warmup_error" not in t and t["warmup_s"] > 0
    assert "precompile_parts" not in t and "precompile_s" not in t and "precompile_error" not in t, t


def test_a_damaged_config_json_is_recomputed_before_the_warmup_reads_it(tmp_path, seeded_store):
    """The warm-up reads the models' config.json on its thread, before their loads hash the dirs; a
    damaged one (same size: a shallow check passes) is found by prepare's own check of that file and
    the dir recomputed (one warning each), so the warm-up reads the repaired file and the run
    publishes what an undamaged one does."""
    bad, good = fresh(tmp_path / "bad", seeded_store), fresh(tmp_path / "good", seeded_store)
    configs = sorted((bad / "artifacts" / "store" / "model").glob("*/config.json"))
    assert len(configs) == 2
    for c in configs:
        c.write_text("x" + c.read_text()[1:])
    r = opd("stage", "train", *RUN, cwd=bad)
    opd("stage", "train", *RUN, cwd=good)
    timings = json.loads((bad / "artifacts" / "runs" / "default" / "train.json").read_text())["timings"]
    assert "warmup_error" not in timings and timings["warmup_s"] > 0
    assert sum("config.json: content hash mismatch" in ln for ln in r.stderr.splitlines()) == 2, r.stderr
    entries = {e for e in published(good / "artifacts") if e.split("/")[0] in ("init", "rollout", "score", "update")}
    assert entry_differences(bad / "artifacts", good / "artifacts", entries) == []


CHILDREN_THEN_ENGINE = r"""
import json, os, sys
from pathlib import Path
import torch
from engine_models import EOS, PAD, tiny, with_trained_lora
from dataclasses import asdict
from stages.engine import sampler, warmup
from stages.engine.sampling import Sampling

out, children = Path(sys.argv[1]), sys.argv[2] == "children"
cache = Path(os.environ["TRITON_CACHE_DIR"])
m = tiny("smollm2-360m", num_hidden_layers=2, initializer_range=0.02).to("cuda", torch.bfloat16)
m.config.to_json_file(out / "config.json")
sampling, min_new = Sampling(), 8
if children:  # the run's precompiling children at the engine's shapes (Session -> train.warm_up -> warmup.start)
    spec = {"config": str(out / "config.json"), "rows": 4, "prompt": 16, "new": 8, "sampling": asdict(sampling),
            "min_new": min_new, "dtype": "bfloat16", "compiled": True, "device": 0}
    warmup._join_children([warmup._spawn({**spec, "part": p}) for p in warmup.parts(True, sampling, 16)])
    assert "precompile_error" not in warmup.report(), warmup.report()
before = sorted(p.name for p in cache.iterdir())
eng = sampler.Engine(with_trained_lora(m, scale=0.02), use_graphs=True, compile=True)
eng.generate([[1, 5, 6, 7]] * 4, 8, eos=EOS, pad=PAD, seed=0, min_new=min_new)
print(json.dumps({"before": before, "after": sorted(p.name for p in cache.iterdir())}))
"""


def test_the_children_compile_every_triton_kernel_the_engine_launches(tmp_path):
    """runtime.precompile: after the children ran, the engine's first rollout (prefill, captured decode
    step, draw) finds every Triton kernel and launcher it needs in the on-disk cache: the main process
    adds no entry to an otherwise fresh TRITON_CACHE_DIR. Without the children the same rollout adds
    entries (it does launch Triton kernels: the check is not vacuous). Fresh processes, so no kernel
    is in any in-memory cache."""
    seen = _fresh_caches(tmp_path, CHILDREN_THEN_ENGINE, ("children", "none"))
    assert seen["children"]["before"] and seen["children"]["after"] == seen["children"]["before"], seen["children"]
    assert seen["none"]["before"] == [] and seen["none"]["after"], seen["none"]
    # what the children left is what the engine alone compiles (the same kernels, the same launchers)
    assert set(seen["none"]["after"]) <= set(seen["children"]["before"]), seen


LORA_CHILD_THEN_TRAINING = r"""
import json, os, sys
from pathlib import Path
import torch
from engine_models import tiny
from dataclasses import asdict
from stages.engine import warmup
from stages.engine.sampling import Sampling
from stages.run.config import LoraCfg
from stages.weights import lora

out, child = Path(sys.argv[1]), sys.argv[2] == "child"
cache = Path(os.environ["TRITON_CACHE_DIR"])
m = tiny("smollm2-360m", num_hidden_layers=2, initializer_range=0.02).to("cuda", torch.bfloat16)
m.config.to_json_file(out / "config.json")
if child:  # the run's "lora" child at the training forward's shapes (train.warm_up -> warmup.start)
    spec = {"config": str(out / "config.json"), "rows": 4, "prompt": 16, "new": 8, "sampling": asdict(Sampling()),
            "min_new": 0, "dtype": "bfloat16", "compiled": True, "device": 0, "length": 64, "rank": 16,
            "engine": True, "lora": True}
    warmup._join_children([warmup._spawn({**spec, "part": "lora"})])
    assert "precompile_error" not in warmup.report(), warmup.report()
before = sorted(p.name for p in cache.iterdir())
student = lora.add(m, LoraCfg(), seed=0, kernels=True)
ids = torch.zeros(4, 64, dtype=torch.long, device="cuda")
student(ids).logits.float().sum().backward()
torch.cuda.synchronize()
print(json.dumps({"before": before, "after": sorted(p.name for p in cache.iterdir())}))
"""


def test_the_lora_child_compiles_every_lora_kernel_the_training_launches(tmp_path):
    """runtime.lora_kernels: after the "lora" child ran, the student's training forward and backward
    through the LoRA kernels add no entry to an otherwise fresh TRITON_CACHE_DIR (without the child they
    do: not vacuous). Fresh processes, so no kernel is in any in-memory cache."""
    seen = _fresh_caches(tmp_path, LORA_CHILD_THEN_TRAINING, ("child", "none"))
    assert seen["child"]["before"] and seen["child"]["after"] == seen["child"]["before"], seen["child"]
    assert seen["none"]["before"] == [] and seen["none"]["after"], seen["none"]


def _fresh_caches(tmp_path, script: str, hows: tuple[str, ...]) -> dict:
    """`script` run once per `how` (its arguments: a fresh dir, how) in a fresh process with fresh Triton
    and Inductor caches in that dir; how -> its last line of output, JSON."""
    import os
    import subprocess
    import sys

    from support import ROOT

    seen = {}
    for how in hows:
        d = tmp_path / how
        (d / "triton").mkdir(parents=True)
        env = {**os.environ, "TRITON_CACHE_DIR": str(d / "triton"), "TORCHINDUCTOR_CACHE_DIR": str(d / "inductor"),
               "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
        r = subprocess.run([sys.executable, "-c", script, str(d), how], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=400)
        assert r.returncode == 0, r.stderr[-3000:]
        seen[how] = json.loads(r.stdout.strip().splitlines()[-1])
    return seen
