"""stages/engine/warmup.py: the first calls it makes run at a model's shapes, draw no random numbers
(the main thread seeds and draws from the global generators while it runs) and leave nothing behind;
off CUDA nothing starts. Its GPU effect (the same bytes with it on or off) is tests/gpu/test_gpu_warmup.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict

import pytest
import torch

from stages.engine import decoder, warmup
from stages.engine.sampling import Sampling

CPU = torch.device("cpu")
LLAMA = {"E": 64, "H": 4, "KV": 2, "D": 16, "I": 96, "V": 500, "eps": 1e-5, "act": "silu", "qk_norm": False,
         "bias": False}


def test_dims_read_a_config_json(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": "qwen3", "num_attention_heads": 16, "num_key_value_heads": 8,
                             "hidden_size": 1024, "head_dim": 128, "intermediate_size": 3072,
                             "vocab_size": 151936, "rms_norm_eps": 1e-6, "hidden_act": "silu"}))
    assert warmup.dims(p) == {"E": 1024, "H": 16, "KV": 8, "D": 128, "I": 3072, "V": 151936, "eps": 1e-6,
                              "act": "silu", "qk_norm": True, "bias": False}
    p.write_text(json.dumps({"model_type": "llama", "num_attention_heads": 15, "hidden_size": 960,
                             "intermediate_size": 2560, "vocab_size": 49152}))
    d = warmup.dims(p)
    assert (d["KV"], d["D"], d["qk_norm"], d["bias"]) == (15, 64, False, False)  # defaults as transformers'


def test_its_work_draws_no_random_numbers_at_any_architecture_it_meets():
    before = torch.random.get_rng_state()
    for d in (LLAMA, {**LLAMA, "qk_norm": True}, {**LLAMA, "bias": True}):
        W = warmup._weights(d, torch.float32, CPU)
        for layer in (decoder.layer, decoder.fused_layer):  # (fused_layer falls back to the eager layer off CUDA)
            for min_new in (0, 4):  # (the EOS blocked or not)
                warmup._sample(W, 3, 16, 4, Sampling(), min_new, layer)
        warmup._sample(W, 3, 16, 4, Sampling(0.7, 0.9), 0, decoder.layer)  # top-p's passes
        warmup._sample(W, 3, 16, 4, Sampling(greedy=True), 0, decoder.layer)  # greedy
        warmup._teacher_forced(d, 3, 32, 0, torch.float32, CPU, train=False)
        warmup._teacher_forced(d, 3, 32, 4, torch.float32, CPU, train=True)
    assert torch.equal(torch.random.get_rng_state(), before)


def test_nothing_starts_off_cuda(tmp_path, monkeypatch):
    spawned = []
    monkeypatch.setattr(warmup, "_spawn", lambda spec: spawned.append(spec))  # (a child is only reported once joined)
    warmup.start(tmp_path / "config.json", tmp_path / "config.json", rows=2, prompt=16, new=4, length=32, rank=4,
                 sampling=Sampling(), min_new=0, dtype=torch.float32, device=CPU, compiled=True, precompile=True)
    assert warmup._RUNNING == [] and warmup.report() == {} and spawned == []
    warmup.wait()  # nothing to join


def test_a_failing_child_is_reported_in_one_line_not_raised(tmp_path, monkeypatch):
    """The precompiling children run this package's module (found through the PYTHONPATH it is given,
    whatever the working directory) and a failure becomes the warm-up's record, not the run's error:
    here a config.json that is not there."""
    monkeypatch.setattr(warmup, "_RESULT", {})
    monkeypatch.chdir(tmp_path)
    spec = {"config": str(tmp_path / "missing.json"), "rows": 2, "prompt": 16, "new": 4, "sampling": asdict(Sampling()),
            "min_new": 0, "dtype": "bfloat16", "compiled": True, "device": 0}
    warmup._join_children([warmup._spawn({**spec, "part": part}) for part in ("draw", "step")])
    err = warmup.report()["precompile_error"]
    assert "precompile_s" not in warmup.report() and "\n" not in err and len(err) <= 200
    assert err.startswith("FileNotFoundError") and "missing.json" in err, err  # (not "No module named stages")


def test_children_compile_only_what_the_engine_launches_one_core_each():
    plain, top_p, greedy = Sampling(), Sampling(top_p=0.9), Sampling(0.7, greedy=True)
    assert warmup.parts(True, plain, 16) == ("draw", "step")
    assert warmup.parts(False, plain, 16) == ("draw",)  # (the eager step launches no Triton kernel)
    assert warmup.parts(True, top_p, 16) == warmup.parts(True, greedy, 16) == ("step",)  # (torch's passes draw)
    assert warmup.parts(False, greedy, 16) == ()  # nothing to compile
    # a core for the main thread besides each child, else the parts share one child, or none starts
    assert warmup.parts(True, plain, 3) == ("draw", "step")
    assert warmup.parts(True, plain, 2) == ("all",) and warmup.parts(True, top_p, 2) == ("step",)
    assert warmup.parts(True, plain, 1) == () == warmup.parts(False, plain, 1)
    # the LoRA kernels (runtime.lora_kernels) in a child of their own, also where the engine does not sample
    assert warmup.parts(True, plain, 16, lora=True) == ("draw", "step", "lora")
    assert warmup.parts(True, plain, 16, engine=False, lora=True) == ("lora",) == warmup.parts(False, greedy, 2, lora=True)
    assert warmup.parts(True, plain, 3, lora=True) == ("all",) and warmup.parts(True, plain, 16, engine=False) == ()
    assert 1 <= warmup.cpus() <= (os.cpu_count() or 1)


def test_a_part_compiled_before_starts_no_child(tmp_path, monkeypatch):
    """A child that compiled its part leaves a marker in Triton's cache (`_markers`, `_main`); a later
    start at the same shapes, model config and code spawns no child for it (the thread loads it) and
    reports it warm; other shapes or another config's bytes are cold again, the config's path is not
    part of the key; a decode step past the kernels' rows (Inductor's layer, another cache) is never
    marked. The children run their real body (`_main`, `_child`, sampler.decode_layer's choice) in this
    process with their CUDA work left out; the parent's thread fails at its first CUDA call."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from stages.engine import draw, kernels
    monkeypatch.setattr(draw, "ON", draw.ON)  # (part "step" turns it off: its own process's, here this one's)
    monkeypatch.setattr(decoder, "_COMPILED", decoder._COMPILED)  # (decode_layer past the kernels' rows)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setattr(warmup, "cpus", lambda: 16)
    for name in ("set_device", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: None)
    monkeypatch.setattr(warmup, "_teacher_forced", lambda *a, **k: None)
    monkeypatch.setattr(warmup, "_sample", lambda *a, **k: None)
    real_weights = warmup._weights  # (only its dtype, activation and device matter to decode_layer)
    monkeypatch.setattr(warmup, "_weights", lambda d, dtype, device: {
        **real_weights(d, dtype, "meta"), "embed": SimpleNamespace(device=device)})
    spawned = []

    def spawn(spec):  # the child's body, in this process
        spawned.append(spec["part"])
        warmup._main(spec)
        proc = subprocess.Popen([sys.executable, "-c", "pass"], stderr=subprocess.PIPE, text=True)
        proc.started = time.perf_counter()
        return proc
    monkeypatch.setattr(warmup, "_spawn", spawn)

    def start(config, rows=2):
        spawned.clear()
        monkeypatch.setattr(warmup, "_RESULT", {})
        monkeypatch.setattr(warmup, "_RUNNING", [])
        warmup.start(config, config, rows=rows, prompt=16, new=4, length=32, rank=4, sampling=Sampling(), min_new=0,
                     dtype=torch.bfloat16, device=torch.device("cuda", 0), compiled=True, precompile=True,
                     lora_kernels=True)
        warmup._RUNNING.pop().join()
        return list(spawned), warmup.report()

    a, b = tmp_path / "a" / "config.json", tmp_path / "b" / "config.json"
    for p in (a, b):
        p.parent.mkdir()
        p.write_text(json.dumps({"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2,
                                 "hidden_size": 64, "intermediate_size": 96, "vocab_size": 500}))
    first, rep = start(a)
    assert first == ["draw", "step", "lora"] and rep["precompile_parts"] == first and "precompile_warm" not in rep
    assert "warmup_error" in rep  # (no CUDA here: the thread's own calls fail, reported, not raised)
    again, rep = start(b)  # (the same bytes at another path)
    assert again == [] and rep["precompile_warm"] == first and "precompile_parts" not in rep
    assert start(a, rows=3)[0] == first  # other shapes
    past = kernels.MAX_ROWS + 1  # the compiled decode layer's rows
    assert start(a, rows=past)[0] == first and start(a, rows=past)[0] == ["step"]
    b.write_text(b.read_text().replace('"vocab_size": 500', '"vocab_size": 501'))
    assert start(b)[0] == first  # another config


def test_children_share_one_deadline(monkeypatch):
    """Each child waits only for what is left of one CHILD_TIMEOUT_S: two stuck children cost it
    once, not twice, and both are killed and reported."""
    monkeypatch.setattr(warmup, "_RESULT", {})
    monkeypatch.setattr(warmup, "CHILD_TIMEOUT_S", 2.0)
    slow = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    for p in slow:
        p.started = time.perf_counter()
    t = time.perf_counter()
    warmup._join_children(slow)
    assert time.perf_counter() - t < 3.5  # one deadline (a deadline each: >= 4 s)
    assert all(p.returncode is not None for p in slow)
    assert warmup.report()["precompile_error"] == "TimeoutExpired: still compiling after 2.0 s"
