"""benchmarks/realpair.py: the committed real-pair record renders to its Markdown, its statistics are
right, and the README quotes it. (The run itself takes an hour on 2 cores and real weights: not here.)"""
from __future__ import annotations

import json
import math
import re
import sys

import pytest

from support import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import realpair  # noqa: E402

NAME = "2026-12-06-cpu-realpair-defaults"


def test_mcnemar_is_the_exact_binomial_tail():
    assert realpair.mcnemar(0, 0) == 1.0
    assert realpair.mcnemar(11, 4) == 2 * sum(math.comb(15, i) for i in range(5)) / 2 ** 15  # 0.1185
    assert realpair.mcnemar(4, 11) == realpair.mcnemar(11, 4)
    assert realpair.mcnemar(5, 5) == 1.0  # capped: both tails overlap at the middle
    assert realpair.mcnemar(10, 0) == 2 / 2 ** 10


@pytest.mark.parametrize("name,arms", [(NAME, {"opd", "sft"}), ("2026-12-06-cpu-realpair-plain-defaults", {"opd"})])
def test_the_records_render_to_their_markdown_and_are_consistent(name, arms):
    rec = json.loads((ROOT / "benchmarks" / "results" / f"{name}.json").read_text())
    assert (ROOT / "benchmarks" / "results" / f"{name}.md").read_text() == realpair.markdown(rec)
    assert set(rec["arms"]) == arms
    if "sft" in arms:
        assert "rollout.sampler=teacher objective.name=nll" in rec["arms"]["sft"]["command"]
    for arm in rec["arms"].values():
        e, f = arm["eval"], arm["flips"]
        assert e["final"]["task"]["correct"] - e["initial"]["task"]["correct"] == f["gained"] - f["lost"]
        assert f["p"] == round(realpair.mcnemar(f["gained"], f["lost"]), 4)
        assert "optim.lr" not in arm["command"]  # the defaults, as the README says


def test_the_readme_quotes_the_record():
    rec = json.loads((ROOT / "benchmarks" / "results" / f"{NAME}.json").read_text())
    o, s = rec["arms"]["opd"]["eval"], rec["arms"]["sft"]["eval"]
    readme = (ROOT / "README.md").read_text()
    (row,) = re.findall(r"^\| task accuracy \(95% CI\) \|.*$", readme, flags=re.M)
    want = [o["initial"]["task"], o["final"]["task"], s["final"]["task"], o["teacher"]["task"]]
    assert row.split("|")[2:6] == [f" {t['accuracy']:.3f} ({t['ci95'][0]:.3f}-{t['ci95'][1]:.3f}) " for t in want]
    (row,) = re.findall(r"^\| KL\(teacher‖student\), top-1 agreement \|.*$", readme, flags=re.M)
    cells = [(e["on_teacher_text"]["kl"], e["on_teacher_text"]["top1_agreement"])
             for e in (o["initial"], o["final"], s["final"])]
    assert row.split("|")[2:5] == [f" {k:.3f}, {a:.3f} " for k, a in cells]
