"""The measured figures in README.md and docs/performance.md are generated from committed records (byte
for byte): both performance tables from one benchmark result (README's compact, docs/performance.md's
full), the default run's figures and answers from the record of README line 1 (which must also be a run
of today's default config)."""
import subprocess
import sys

from support import ROOT


def test_performance_tables_match_the_result_file():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "readme_table.py"), "--check"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, f"{r.stderr}: run python benchmarks/readme_table.py"


def test_readme_and_performance_md_quote_the_same_run():
    """README's compact table and docs/performance.md's full one name the same result file, and the
    README's figures (time per update, rollout rate, speed-up) are the full table's."""
    import re

    def block(path):
        return path.read_text().split("<!-- performance:begin", 1)[1].split("<!-- performance:end -->", 1)[0]

    readme, full = block(ROOT / "README.md"), block(ROOT / "docs" / "performance.md")
    src = re.compile(r"`(benchmarks/results/[\w.-]+-systems\.json)`")
    assert src.search(readme).group(1) == src.search(full).group(1)
    assert (ROOT / src.search(readme).group(1)).exists()
    assert len(readme.splitlines()) <= 12 < len(full.splitlines())  # compact in the README, full in the doc
    per_update = re.search(r"^\| time per update[^|]*\| ([\d.]+) s \| ([\d.]+) s \(([\d.]+)x ours\)", readme, re.M)
    assert f"| {per_update.group(1)} s | {per_update.group(2)} s |" in full
    assert f"| {per_update.group(3)}x | 1x |" in full
    rate = re.search(r"^\| rollout \(sampling\) \| ([\d.]+) tok/s", readme, re.M).group(1)
    assert f"| {rate} tok/s |" in full


def test_default_run_figures_match_the_record_of_readme_line_1():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "default_run.py"), "--check"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_arms_missing_from_the_table_run_come_from_their_newest_run(tmp_path, monkeypatch):
    """readme_table lists an arm of ours that the table's run lacks once, from the newest earlier run
    that measured it, with that run's default beside it; an arm the table's run has is not listed."""
    import json

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import readme_table

    def run(name, arms):
        systems = [{"name": "opd-stages", **fig(0.2)}] + [{"name": f"opd-stages-{a}", **fig(t)} for a, t in arms]
        p = tmp_path / name
        p.write_text(json.dumps({"workloads": {"a": {"systems": systems}}}))
        return p

    def fig(t):
        return {"median_update_s": t, "median_rollout_s": 0.1, "rollout_tok_per_s": 2500.0, "median_score_s": 0.01,
                "median_update_phase_s": 0.05, "peak_allocated_gib": {"overall": 5.0},
                "first_update_incl_construction_s": 17.0}

    old, new = run("old.json", [("ckpt", 0.31), ("nf4", 0.4)]), run("new.json", [("ckpt", 0.32)])
    monkeypatch.setattr(readme_table, "ROOT", tmp_path)  # (paths are printed relative to it)
    lines = readme_table._earlier_arms([old, new], {"eager"})
    rows = [ln for ln in lines if ln.startswith("| ") and not ln.startswith("| arm ")]
    assert len(rows) == 2 and rows[0].startswith("| ckpt | `new.json` | 0.32 |")
    assert rows[1].startswith("| nf4 | `old.json` | 0.4 |")
    assert rows[0].endswith("| 0.2 s/update, peak 5.00 GiB |")  # that run's default, not the table run's
    assert readme_table._earlier_arms([old, new], {"ckpt", "nf4"}) == []


def test_both_tables_give_trl_on_workload_b_where_the_run_has_it(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import readme_table

    path = ROOT / "benchmarks" / "results" / "2026-12-06-h100-09cb011-systems.json"
    assert readme_table._trl_b(path) == "28.6449 s/update (7.59x ours), peak 15.39 GiB"
    assert readme_table._trl_b(path, True).endswith("; 16 prompts per forward x 4 accumulated, gradient checkpointing")
    row = next(ln for ln in readme_table.compact(path).splitlines() if ln.startswith("| workload b"))
    assert "| 28.6449 s/update (7.59x ours), peak 15.39 GiB |" in row
    older = ROOT / "benchmarks" / "results" / "2026-12-04-h200-89e6bc8-systems.json"  # (ours alone on b there)
    assert readme_table._trl_b(older) == "-"
