"""benchmarks/systems.py's Markdown report, from a recorded H200 result."""
from __future__ import annotations

import json
import sys

from support import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import systems  # noqa: E402


def test_report_lists_the_construction_pieces_in_the_order_they_finished():
    r = json.loads((ROOT / "benchmarks" / "results" / "2026-12-02-h200-17b3be2-systems.json").read_text())
    md = systems.markdown(r)
    line = next(ln for ln in md.splitlines() if ln.startswith("opd-stages-inplace_ckpt: the construction"))
    assert line.endswith("prepared 0.0411, student_loaded 8.1019, policy0_published 8.2713, engine_built 8.7425, "
                         "rollout_done 10.8665, teacher_loaded 11.7558, score_done 12.0928, update_done 15.8809")
    # a result without the timings (older records, the peers) gets no such line
    assert sum("the construction before the first update" in ln for ln in md.splitlines()) == 2  # our two arms
    r["workloads"]["a"]["systems"] = [{k: v for k, v in s.items() if k != "startup_s"} for s in r["workloads"]["a"]["systems"]]
    assert "the construction before the first update" not in systems.markdown(r)


def test_a_system_skipped_by_the_deadline_leaves_the_exit_code_zero_and_a_failure_does_not(capsys):
    r = json.loads((ROOT / "benchmarks" / "results" / "2026-12-04-h200-3085b35-systems.json").read_text())
    assert [s["name"] for s in r["workloads"]["a"]["systems"] if "error" in s] == ["miniVERL 0.16"]  # skipped
    assert systems.exit_code(r) == 0
    assert "not measured: miniVERL 0.16" in capsys.readouterr().err
    r["workloads"]["a"]["systems"][2] = {"name": "TRL 1.16 DistillationTrainer", "error": "CalledProcessError: 1"}
    assert systems.exit_code(r) == 1


def test_each_steps_phases_and_the_rest_add_up_to_its_wall_time():
    """per_step_s (systems.ours_pipeline): every step's three phases and the time outside them, from a
    recorded H200 run of 24 updates (--updates), make up that step's wall time (to the rounding of
    four figures), and the shape records the count the run was given."""
    r = json.loads((ROOT / "benchmarks" / "results" / "2026-12-04-h200-10ce6a9-updates24-systems.json").read_text())
    a = r["workloads"]["a"]
    assert a["shape"]["updates"] == 24 and "--updates 24" in r["command"]
    for s in a["systems"]:
        per = s["per_step_s"]
        assert all(len(v) == 24 for v in per.values()) and len(s["step_wall_s"]) == 24
        for k, wall in enumerate(s["step_wall_s"]):
            assert abs(sum(per[ph][k] for ph in ("rollout", "score", "update", "outside")) - wall) <= 2e-4, (s["name"], k)
        assert abs(s["median_outside_phases_s"] - systems.median(per["outside"][1:])) <= 2e-4  # (update 1 left out)


def test_the_roofline_is_the_bytes_and_flops_of_each_phase_over_the_peaks():
    """Workload a at round peaks: each decode step reads the student's weights (tied head) and the KV
    cache so far; scoring and the update are bound by their FLOPs; the report prints our multiple."""
    import roofline

    peaks = {"bandwidth_gbs": 1000.0, "bf16_tflops": 1000.0}
    w = systems.WORKLOAD_A
    st = roofline.shape(w["student"])
    # SmolLM2-360M: 32 layers, hidden 960, 15 heads of 64, 5 kv heads, inter 2560, vocab 49,152
    assert st["linear"] == 32 * (960 * 960 + 2 * 960 * 320 + 960 * 960 + 3 * 960 * 2560)
    assert st["head"] == 49152 * 960
    f = roofline.floors(w, peaks)
    weights_s = (st["linear"] + st["head"]) * 2 / 1e12
    kv_s = sum(2 * 32 * 320 * 4 * (128 + t) * 2 for t in range(64)) / 1e12
    assert 64 * weights_s + kv_s < f["rollout"] < 64 * weights_s + kv_s + 1e-3  # + the prefill's compute
    assert f["step"] == f["rollout"] + f["score"] + f["update"]
    ours = {"name": "opd-stages", "median_rollout_s": 0.064, "median_score_s": 0.0104,
            "median_update_phase_s": 0.0574, "median_update_s": 0.158}
    rows = roofline.table(w, ours, peaks)
    assert rows["update"]["x_floor"] == round(0.0574 / f["update"], 1)
    assert "| rollout |" in "\n".join(roofline.markdown(rows, peaks))
    assert roofline.table(w, {"name": "opd-stages", "error": "skipped"}, peaks) is None


def test_workload_b_records_trl_beside_ours_with_its_ratio_and_batching():
    """TRL on workload b (systems.py, 09cb011's H100 run): the ratio is TRL's median over ours, our own
    arms are no peers, and the report says how TRL was batched."""
    r = json.loads((ROOT / "benchmarks" / "results" / "2026-12-06-h100-09cb011-systems.json").read_text())
    b = r["workloads"]["b"]["systems"]
    assert b[1]["name"].startswith("TRL") and b[1]["gradient_accumulation_steps"] == 4 and b[1]["micro_batch"] == 16
    assert systems.peer_ratios(b) == {b[1]["name"]: round(b[1]["median_update_s"] / b[0]["median_update_s"], 2)} \
        == r["workloads"]["b"]["ratios"] == {b[1]["name"]: 7.59}
    assert systems.peer_ratios([b[0], {**b[0], "name": "opd-stages-layers"}, b[1]]) == {b[1]["name"]: 7.59}
    assert systems.peer_ratios([b[1]]) == {}  # without ours first there is nothing to divide by
    assert "TRL 1.16 DistillationTrainer: 16 prompts per forward, 4 accumulated per update, gradient checkpointing on" \
        in systems.markdown(r)


def test_an_unknown_workload_b_arm_is_refused_before_anything_runs(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        systems.main(["--ours-b", "layers,fast", "--tokenizer", str(tmp_path), "--work", str(tmp_path / "w")])
    assert e.value.code == 2 and "--ours-b: unknown ['fast']" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()
