"""Issue #44: a CPU run consults the memory plan before any weights load (stages/memory/plan.py
`decide`, `host_check`): refused past the host memory available (exit 2, one line naming the peak,
what is available and what would fit), a warning within 15% of it, memory.vram_gib to run anyway;
evaluate is a phase of the plan (stages/memory/phases.py), checked by hand on the tiny shapes; and
`opd doctor` judges the plan as the run does."""
from __future__ import annotations

import json

import pytest

from stages import cli
from stages.errors import UserError
from stages.memory import hostmem, phases, plan
from stages.run import config
from stages.tools import doctor
from support import TOKENIZER

GIB = 2**30
TINY = ["student.name=arch:tiny-llama", "student.init=random", "student.keep_layers=0",
        "teacher.name=arch:tiny-llama-teacher", "teacher.init=random", "objective.topk=8",
        "runtime.device=cpu", *TOKENIZER]
# evaluate's shapes: 4 held-out prompts of up to 32 tokens, 8 new tokens, a KL chunk of 16 positions
EVAL = ["data.num_eval=4", "data.max_prompt_tokens=32", "eval.max_new_tokens=8", "eval.chunk=16"]


def cfg(*over):
    return config.compose(list(over))


def items(est, phase="evaluate", placement="resident") -> dict[str, tuple[str, int, bool]]:
    its = est["placements"][placement]["phases"][phase]["items"]
    return {f"{i['role']}: {i['component']}": (i["role"], i["bytes"], i["one_at_a_time"]) for i in its}


def one(its: dict, role: str, prefix: str) -> tuple[int, bool]:
    hits = [(b, alt) for k, (r, b, alt) in its.items() if r == role and k.split(": ", 1)[1].startswith(prefix)]
    assert len(hits) == 1, (role, prefix, list(its))
    return hits[0]


@pytest.fixture
def available(monkeypatch):
    """Fake the host memory available now (bytes)."""
    def set_(n: float):
        monkeypatch.setattr(hostmem, "available", lambda: (int(n), "detected: host memory available now, of 24.00 "
                                                                   "GiB RAM"))
    return set_


# ---- evaluate in the plan ----

def test_evaluate_phase_by_hand_on_the_tiny_shapes():
    """tiny-llama student (H 64, I 128, 2 layers, 4 heads / 2 kv of 16), tiny-llama-teacher (H 96, I 192,
    3 layers, 4 heads / 2 kv of 24), vocab 49152, fp32 on the CPU: evaluate holds what the loop keeps,
    the teacher's greedy engine, and one at a time each role's greedy decode and the held-out KL."""
    est = plan.estimate(cfg(*TINY, *EVAL))
    assert set(est["phases"]) == set(phases.PHASES) and "evaluate" in est["phases"]
    its = items(est)
    s = 4
    # held: student weights (3,219,776 params), LoRA r16 on 7 projections (32,768), its grads, AdamW x2
    assert one(its, "student", "weights (fp32)") == (3_219_776 * s, False)
    assert one(its, "student", "LoRA (fp32)") == (32_768 * 4, False)
    assert one(its, "student", "AdamW") == (2 * 32_768 * 4, False)
    # the student's rollout engine: a merged copy of every projection (LoRA on all 7): 2 x 36,864 weights
    assert one(its, "student", "rollout engine weights") == (2 * 36_864 * s, False)
    # teacher: 3 x 82,944 projection weights + the tied embedding 49152 x 96 + norms (7 x 96)
    assert one(its, "teacher", "weights (fp32)") == ((3 * 82_944 + 49152 * 96 + 7 * 96) * s, False)
    # the teacher's greedy engine: q/k/v and gate/up fused (copies), o/down/head its own: 3 x 55,296
    assert one(its, "teacher", "evaluation's greedy engine weights") == (3 * (96 * 192 + 2 * 96 * 192) * s, False)
    # one at a time: the teacher's greedy decode of 4 prompts x (32 + 8): its KV cache
    # 2 x 3 layers x 4 x 2 kv heads x 40 x 24 x 4 B + the larger of prefill and the sampling buffers
    # [4, 49152] x (4 + 16) B
    kv_t, pick = 2 * 3 * 4 * 2 * 40 * 24 * s, 4 * 49152 * (s + 16)
    prefill_t = 4 * 32 * (2 * 96 + 3 * 192) * s + 2 * 4 * 4 * 32 * 40 * 4 + 2 * 4 * 4 * 40 * 24 * s
    assert pick > prefill_t
    assert one(its, "teacher", "greedy decode of 4 held-out prompts") == (kv_t + pick, True)
    kv_s = 2 * 2 * 4 * 2 * 40 * 16 * s
    assert one(its, "student", "greedy decode of 4 held-out prompts") == (kv_s + pick, True)
    # the held-out KL: both roles' hidden states [4 x 8, 96 + 64] + the larger of a forward over the
    # 4 x 40 tokens (teacher: 160 x max(2H + 3I, 2H + 5q) x 4 + its hidden states) and a KL chunk:
    # 5 fp32 [16, 49152] (both log-softmaxes, exp, difference, product)
    fwd_t = 160 * (2 * 96 + 3 * 192) * s + 160 * 96 * s
    kl_chunk = 5 * 16 * 49152 * 4
    assert kl_chunk > fwd_t
    assert one(its, "student", "held-out KL") == (32 * (96 + 64) * s + kl_chunk, True)
    held = sum(b for _, b, alt in its.values() if not alt)
    total = held + max(kv_t + pick, kv_s + pick, 32 * (96 + 64) * s + kl_chunk)
    assert held == 3_219_776 * s + 4 * 32_768 * 4 + 2 * 36_864 * s + (3 * 82_944 + 49152 * 96 + 7 * 96) * s \
        + 3 * 55_296 * s == 34_234_240
    assert total == 49_983_360
    assert est["placements"]["resident"]["phases"]["evaluate"]["total_gib"] == round(total / GIB, 4)
    assert est["evaluate_workload"]["tokens"] == 160 and est["evaluate_workload"]["response_positions"] == 32


def test_evaluate_holds_both_roles_under_every_placement():
    """stages/evaluate.py keeps the teacher's greedy engine for the whole evaluation and its accessor
    brings the teacher back beside the student: swap moves nothing there (measured on an H100, seed
    workload, one update: evaluate 7.69 GiB allocated resident, 7.76 under swap, whose loop peaked at
    3.44); shared_backbone counts the base once."""
    seed = ["student.name=arch:smollm2-360m", "student.init=random", "student.keep_layers=0",
            "teacher.name=arch:smollm2-1.7b", "teacher.init=random", "data.max_prompt_tokens=128",
            "rollout.max_new_tokens=64", "runtime.device=cuda", "memory.vram_gib=16", *TOKENIZER]
    est = plan.estimate(cfg(*seed))
    res, sw = est["placements"]["resident"], est["placements"]["swap"]
    assert res["phases"]["evaluate"]["total_gib"] == sw["phases"]["evaluate"]["total_gib"] > res["loop_peak_gib"]
    assert sw["loop_peak_gib"] < res["loop_peak_gib"] and est["peak_phase"] == "evaluate"
    same = plan.estimate(cfg(*TINY, *EVAL, "teacher.name=arch:tiny-llama"))
    shared, resident = (same["placements"][p]["phases"]["evaluate"]["total_gib"] for p in ("shared_backbone",
                                                                                         "resident"))
    assert abs(resident - shared - 3_219_776 * 4 / GIB) <= 1e-4 + 1e-12  # one fp32 copy of the base less


def test_the_issue_pair_peaks_in_evaluate_and_fits_24_gb(tmp_path, available):
    """Qwen2.5-Coder 0.5B student + 1.5B teacher, fp32 on a CPU (issue #44: 12.8 GB RSS in the loop,
    16.0 GB in evaluate): evaluate is the plan's peak, the teacher's greedy engine (its fused q/k/v
    and gate/up, 3.20 GiB) most of what it adds; with 20 GiB available it fits without a warning."""
    for name, h, i, layers, heads in (("s", 896, 4864, 24, 14), ("t", 1536, 8960, 28, 12)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({
            "model_type": "qwen2", "vocab_size": 151936, "hidden_size": h, "intermediate_size": i,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 2,
            "tie_word_embeddings": True}))
    c = cfg(f"student.name={tmp_path / 's'}", f"teacher.name={tmp_path / 't'}", "student.keep_layers=0",
            "runtime.device=cpu")
    available(20 * GIB)
    est = plan.estimate(c)
    assert est["peak_phase"] == "evaluate" and est["loop_peak_gib"] < est["peak_gib"] < 14
    assert one(items(est), "teacher", "evaluation's greedy engine weights")[0] == \
        28 * 1536 * (1536 + 2 * 256 + 2 * 8960) * 4
    assert est["host_check"]["verdict"] == "ok"
    available(15 * GIB)  # 12.98 GiB > 85% of 15: a warning, the run goes on
    assert plan.estimate(c)["host_check"]["verdict"] == "warn"


# ---- the CPU run's check ----

def test_default_run_fits_a_24_gb_machine(available, monkeypatch, capsys):
    """The default pipeline (embedded SmolLM2-135M, 24 of 30 layers) on a 24 GB machine with 20 GiB
    available: planned, fits, no warning."""
    monkeypatch.setattr(plan, "device_total", lambda device: (24 * 10**9, "detected: host RAM"))
    available(20 * GIB)
    c = cfg("runtime.device=cpu")
    est = plan.estimate(c)
    assert est["feasible"] and est["host_check"]["verdict"] == "ok" and est["peak_gib"] < 3
    assert plan.decide(c) == ("resident", est["placement"]["why"])
    assert capsys.readouterr().err == ""


def test_a_peak_past_the_available_memory_is_refused_before_anything_loads(tmp_path, monkeypatch, capsys,
                                                                            available):
    peak = plan.estimate(cfg(*TINY))["peak_gib"] * GIB
    available(0.8 * peak)
    monkeypatch.chdir(tmp_path)
    code = cli.main(["run", *TINY])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"error: planned host memory peak {peak / GIB:.2f} GiB (")
    assert f"> {0.8 * peak / GIB:.2f} GiB available (host memory available now, of 24.00 GiB RAM)" in err
    assert "fits with: " in err or "no change tried fits" in err
    assert "set memory.vram_gib to the GiB this run may take" in err  # the override
    assert not (tmp_path / "artifacts").exists()  # refused before prepare: nothing read, written or loaded
    # doctor says the same: a blocker
    (c,) = doctor.check_memory(cfg(*TINY))
    assert c.status == doctor.FAIL and c.detail == lines[0].removeprefix("error: ")


def test_memory_vram_gib_overrides_the_check(available):
    """memory.vram_gib is the host budget on the CPU: set above the planned peak, the run goes on
    whatever is available now (and set below it, it is what refuses)."""
    c = cfg(*TINY)
    peak = plan.estimate(c)["peak_gib"] * GIB
    available(0.5 * peak)
    with pytest.raises(UserError, match="planned host memory peak"):
        plan.decide(c)
    assert plan.decide(cfg(*TINY, f"memory.vram_gib={2 * peak / GIB:.4f}"))[0] == "resident"
    with pytest.raises(UserError, match=r"GiB \(memory.vram_gib\)"):
        plan.decide(cfg(*TINY, f"memory.vram_gib={0.5 * peak / GIB:.4f}"))


def test_within_15_percent_of_the_available_memory_is_one_warning(available, capsys):
    c = cfg(*TINY)
    est = plan.estimate(c)
    peak = est["peak_gib"] * GIB
    available(peak / 0.9)  # the peak is 90% of what is available: within 15%
    assert plan.decide(c)[0] == "resident"
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("warning: planned host memory peak") and "within 15% of" in err
    (d,) = doctor.check_memory(c)
    assert d.status == doctor.WARN and d.detail == lines[0].removeprefix("warning: ")
    available(peak / 0.8)  # 80%: no word
    assert plan.decide(c)[0] == "resident" and capsys.readouterr().err == ""
    assert doctor.check_memory(c)[0].status == doctor.OK
    available(peak / 0.8)  # a larger memory.margin widens the band
    plan.decide(cfg(*TINY, "memory.margin=0.25"))
    assert "within 25% of" in capsys.readouterr().err


def test_unreadable_shapes_and_cuda_leave_the_decision_to_the_session(capsys):
    """Before prepare a model not fetched yet has no shapes: `opd run` leaves the plan to the session
    (after prepare). On CUDA the session decides at its first model load, as before."""
    c = cfg(*TINY, "student.name=/nonexistent/model")
    assert plan.preflight(c) is None and capsys.readouterr().err == ""
    assert plan.decide(c) == ("resident", "no plan") and "no memory plan" in capsys.readouterr().err
    assert plan.preflight(cfg(*TINY, "runtime.device=cuda", "memory.vram_gib=0.01")) is None
    assert capsys.readouterr().err == ""


def test_doctor_and_plan_agree_on_nf4_on_a_cpu(available):
    """teacher.quant=nf4 without CUDA: bitsandbytes' CPU kernels; doctor's quantization and memory
    checks pass where the plan fits (they once said FAIL where `opd plan` said it fits)."""
    available(20 * GIB)
    c, _ = doctor.load_config(None, ["teacher.quant=nf4", "runtime.device=cpu"])
    est = plan.estimate(c)
    assert est["feasible"] and est["device"] == "cpu"
    (q,) = doctor.check_quant(c)
    (m,) = doctor.check_memory(c)
    assert q.status == doctor.OK and m.status == doctor.OK and f"peak {est['peak_gib']:.2f} GiB" in m.detail


# ---- host memory available ----

def test_available_memory_is_memavailable_plus_the_free_heap(monkeypatch):
    monkeypatch.setattr(hostmem, "_meminfo", lambda: {"MemTotal": 24 * GIB, "MemAvailable": 20 * GIB})
    monkeypatch.setattr(hostmem, "free_heap_bytes", lambda: GIB)  # freed by this process, kept for reuse
    monkeypatch.setattr(hostmem, "_cgroup_headroom", lambda: None)
    assert hostmem.available() == (21 * GIB, "detected: host memory available now, of 24.00 GiB RAM")
    monkeypatch.setattr(hostmem, "_cgroup_headroom", lambda: 6 * GIB)  # a container's limit is lower
    n, what = hostmem.available()
    assert n == 7 * GIB and "cgroup" in what
    monkeypatch.setattr(hostmem, "_meminfo", lambda: {})  # not Linux: the plan falls back to the RAM
    assert hostmem.available() is None


@pytest.mark.parametrize("files,headroom", [
    ({"/proc/self/cgroup": "0::/\n", "/sys/fs/cgroup/memory.max": "8589934592\n",
      "/sys/fs/cgroup/memory.current": "4294967296\n",
      "/sys/fs/cgroup/memory.stat": "anon 1\ninactive_file 1073741824\n"},
     5 * GIB),  # v2: 8 GiB limit, 4 GiB used of which 1 GiB inactive page cache
    ({"/proc/self/cgroup": "0::/\n", "/sys/fs/cgroup/memory.max": "max\n", "/sys/fs/cgroup/memory.current": "1\n"},
     None),  # v2, no limit
    ({"/proc/self/cgroup": "4:memory:/job\n", "/sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
      "/sys/fs/cgroup/memory/memory.usage_in_bytes": "1\n"}, None),  # v1, no limit (seen from inside the group)
    ({"/proc/self/cgroup": "4:memory:/job\n", "/sys/fs/cgroup/memory/job/memory.limit_in_bytes": "4294967296\n",
      "/sys/fs/cgroup/memory/job/memory.usage_in_bytes": "3221225472\n",
      "/sys/fs/cgroup/memory/job/memory.stat": "total_inactive_file 0\n"}, GIB),  # v1: 4 GiB limit, 3 used
])
def test_cgroup_headroom(monkeypatch, files, headroom):
    monkeypatch.setattr(hostmem, "_read", files.get)
    assert hostmem._cgroup_headroom() == headroom
