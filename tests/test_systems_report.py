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
