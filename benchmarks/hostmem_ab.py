"""Our CPU step with and without stages/memory/hostmem.py's malloc settings, alternating runs.

    python benchmarks/hostmem_ab.py [--pairs 4] [--out benchmarks/results]

Each run is `benchmarks/cpu_peer.py`'s ours side alone (`--mv-backends "" --no-repeat-ours`: the same
tiny-Llama workload, 8 updates, a fresh work dir), once with OPD_MALLOC=default (glibc's own
behaviour) and once without (the process keeps freed memory), alternating so drift in the machine's
state hits both alike. Reports the median step wall time (updates 2-8) per run and per mode.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one(mode: str, work: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OPD_MALLOC", None)
    if mode == "glibc default":
        env["OPD_MALLOC"] = "default"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_peer.py"), "--mv-backends", "", "--no-repeat-ours",
                    "--work", str(work), "--out", str(work / "out"), "--tag", "ab"], env=env, check=True,
                   capture_output=True)
    train = next(work.glob("artifacts*/runs/*/train.json"))
    return statistics.median(json.loads(train.read_text())["timings"]["step_wall_s"][1:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    modes = ("glibc default", "keep freed memory")
    runs: dict[str, list[float]] = {m: [] for m in modes}
    tmp = Path(tempfile.mkdtemp(prefix="opd-hostmem-ab-"))
    for i in range(args.pairs):
        for m in modes:
            runs[m].append(round(one(m, tmp / f"{i}-{m.split()[0]}"), 4))
            print(m, runs[m][-1], flush=True)
    med = {m: statistics.median(v) for m, v in runs.items()}
    res = {"date": dt.date.today().isoformat(), "command": " ".join(["python", *sys.argv]),
           "loadavg": os.getloadavg(), "cpu": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                                                    if ln.startswith("model name")), "?"),
           "median_step_s_per_run": runs, "median_of_runs": med,
           "ratio": round(med["keep freed memory"] / med["glibc default"], 3)}
    stem = args.out / f"{res['date']}-hostmem-ab"
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    stem.with_suffix(".md").write_text(
        f"# Host memory A/B — {res['date']} — {res['cpu']}\n\nCommand: `{res['command']}`; load average at the end "
        f"{[round(x, 2) for x in res['loadavg']]}.\n\n| mode | median step s per run (updates 2-8) | median |\n|---|---|---|\n"
        + "".join(f"| {m} | {', '.join(map(str, runs[m]))} | {med[m]} |\n" for m in modes)
        + f"\nKeeping freed memory: {res['ratio']}x the step time of glibc's default.\n")
    print(stem.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
