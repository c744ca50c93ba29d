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
