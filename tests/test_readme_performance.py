"""README's performance table is generated from the committed benchmark result (byte for byte)."""
import subprocess
import sys

from support import ROOT


def test_performance_table_matches_the_result_file():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "readme_table.py"), "--check"], cwd=ROOT)
    assert r.returncode == 0, "README's performance table is stale: run python benchmarks/readme_table.py"
