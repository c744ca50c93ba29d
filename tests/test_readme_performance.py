"""README's measured figures are generated from committed records (byte for byte): the performance
table from the benchmark result, the default run's figures and answers from the record of README
line 1 (which must also be a run of today's default config)."""
import subprocess
import sys

from support import ROOT


def test_performance_table_matches_the_result_file():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "readme_table.py"), "--check"], cwd=ROOT)
    assert r.returncode == 0, "README's performance table is stale: run python benchmarks/readme_table.py"


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
    assert len(lines) == 2 and lines[0].startswith("Arm ckpt") and "`new.json`): 0.32 s/update" in lines[0]
    assert lines[1].startswith("Arm nf4") and "`old.json`): 0.4 s/update" in lines[1]
    assert "the default there: 0.2 s/update" in lines[0]
    assert readme_table._earlier_arms([old, new], {"ckpt", "nf4"}) == []
