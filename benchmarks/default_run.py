"""README line 1, measured: the line as written (install, then `dvc repro` of the default pipeline) in a
fresh clone with its own venv, from an empty store.

    python benchmarks/default_run.py [--out benchmarks/results] [--readme]   # run, record, (update README)
    python benchmarks/default_run.py --check                                  # README block == record == config

The run happens in `git clone` of this checkout's HEAD (commit first): README line 1 runs there as
written, so `./install.sh` builds the clone's own .venv (no test extras: no Triton, no bitsandbytes)
and `dvc repro` (prepare -> train -> evaluate -> export -> report) runs in it, the embedded model
materialised from its GGUF as a new user's first run does.
The record (<out>/default-run.json + .md) holds the machine, the wall time, the run view's
metrics.json (headline numbers), eval.json (the whole evaluation, as `eval`) and answers.json, and the
digest of the resolved default config (view.json's `config`); a record made before the view had an
eval.json holds the whole evaluation in `metrics` (`eval`, `updates`), and `block()` reads both.
`--readme` rewrites README's block between the `default-run` markers from the record; `--check`
fails when that block differs from what the record renders, or when the default config composed
from conf/ now has another digest than the recorded run had (the figures would be stale).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "benchmarks" / "results" / "default-run.json"
BEGIN, END = "<!-- default-run:begin (benchmarks/default_run.py --readme) -->", "<!-- default-run:end -->"


def line1() -> str:
    """README line 1 as written (the first line of its first code block)."""
    text = (ROOT / "README.md").read_text()
    return text.split("```bash\n", 1)[1].split("\n", 1)[0]


def measure(out: Path) -> dict:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="opd-default-run-") as tmp:
        clone = Path(tmp) / "project"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        # nothing of this process's environment: the clone's line 1 makes its own venv, as a user's does
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not p.startswith(sys.prefix))
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        r = subprocess.run(["bash", "-c", line1()], cwd=clone, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if r.returncode != 0:
            sys.exit(f"README line 1 failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        run = clone / "artifacts" / "runs" / "default"
        train = json.loads((run / "train.json").read_text())
        rec = {"date": os.environ.get("OPD_BENCH_DATE", dt.date.today().isoformat()), "commit": head,
               "command": f"{line1()}  (README line 1 as written: fresh clone, its own venv, empty store)",
               "machine": {"cpu": _cpu(), "cpus": os.cpu_count(), "python": platform.python_version(),
                           "load_before": load},
               "wall_s": round(wall, 1), "repro_s": _repro_seconds(clone),
               "config": json.loads((run / "view.json").read_text())["config"],
               "timings": train.get("timings"),
               "metrics": json.loads((run / "metrics.json").read_text()),
               "eval": json.loads((run / "eval.json").read_text()),
               "answers": json.loads((run / "answers.json").read_text())}
    out.mkdir(parents=True, exist_ok=True)
    (out / "default-run.json").write_text(json.dumps(rec, indent=1) + "\n")
    return rec


def _repro_seconds(clone: Path) -> float:
    """`dvc repro`'s share of line 1: from the venv's last install (the embedded model's package, the
    install's last step) to the newest file of the run view."""
    venv = max(p.stat().st_mtime for p in (clone / ".venv" / "lib").glob("python*/site-packages/*"))
    done = max(p.stat().st_mtime for p in (clone / "artifacts" / "runs" / "default").iterdir())
    return round(done - venv, 1)


def write_md(rec: dict, out: Path) -> None:
    (out / "default-run.md").write_text(f"# Default run ({rec['date']}, commit {rec['commit'][:10]})\n\n{block(rec)}\n")


def evaluation(rec: dict) -> tuple[dict, int]:
    """(the whole evaluation record, updates): the run view's eval.json, or in a record made before the
    view had one, metrics.json's `eval` and `updates`."""
    if "eval" in rec:
        return rec["eval"], rec["eval"]["updates"]
    return rec["metrics"]["eval"], rec["metrics"]["updates"]


def block(rec: dict) -> str:
    """README's figures, all read from the record."""
    (ev, updates), m = evaluation(rec), rec["machine"]
    t, o = ev["initial"]["on_teacher_text"], ev["final"]["on_teacher_text"]
    ko = ev["initial"]["on_own_text"]["kl"], ev["final"]["on_own_text"]["kl"]
    a = {w: ev[w]["answers"] for w in ("teacher", "initial", "final")}
    lines = [
        f"Measured with README line 1 on a {m['cpus']}-core {m['cpu']} (`python benchmarks/default_run.py`, "
        f"{rec['date']}): " + (f"line 1 took {rec['wall_s'] / 60:.1f} min, `dvc repro` {rec['repro_s'] / 60:.1f} min of it, "
                               if "repro_s" in rec else f"`dvc repro` took {rec['wall_s'] / 60:.1f} min ")
        + (f"on a busy machine (load {m['load_before']:.1f} as it started: other work shared the two cores) "
           if m.get("load_before", 0) >= 1 else "")
        + "from an empty store "
        f"({updates} updates). On the {t['tokens']} tokens of the teacher's greedy answers to the "
        f"held-out prompts, top-1 agreement with the teacher rose from {t['top1_agreement']:.3f} to "
        f"{o['top1_agreement']:.3f} and KL(teacher‖student) fell from {t['kl']:.2f} to {o['kl']:.2f} nats/token "
        f"(on the student's own greedy answers: {ko[0]:.2f} -> {ko[1]:.2f}). Non-blank greedy answers: "
        f"{a['initial']['nonblank']:.0%} before, {a['final']['nonblank']:.0%} after (teacher {a['teacher']['nonblank']:.0%}); "
        f"distinct bigrams {a['initial']['distinct_bigrams']:.2f} -> {a['final']['distinct_bigrams']:.2f} "
        f"(teacher {a['teacher']['distinct_bigrams']:.2f}).", "",
        "| held-out prompt | teacher | student before | student after |", "|---|---|---|---|"]
    cell = lambda s: s.strip().replace("|", "\\|").replace("\n", " ⏎ ") or "*(blank)*"  # noqa: E731  one row per prompt
    for s in rec["answers"]["side_by_side"]:
        lines.append(f"| {cell(s['prompt'])} | {cell(s['teacher'])} | {cell(s['initial'])} | {cell(s['final'])} |")
    return "\n".join(lines)


def readme_text(rec: dict) -> str:
    text = (ROOT / "README.md").read_text()
    if BEGIN not in text or END not in text:
        sys.exit(f"README.md: no block between {BEGIN!r} and {END!r}")
    head, rest = text.split(BEGIN, 1)
    return f"{head}{BEGIN}\n{block(rec)}\n{END}{rest.split(END, 1)[1]}"


def default_config_digest() -> str:
    sys.path.insert(0, str(ROOT))
    from stages.run import config, runview

    return runview.config_digest(config.compose([], config.conf_dir()))


def check() -> int:
    rec = json.loads(RECORD.read_text())
    problems = []
    if readme_text(rec) != (ROOT / "README.md").read_text():
        problems.append("README's default-run block differs from benchmarks/results/default-run.json "
                        "(python benchmarks/default_run.py --readme rewrites it from the record)")
    if rec["config"] != default_config_digest():
        problems.append("the default config (conf/) changed since the recorded run: rerun "
                        "python benchmarks/default_run.py --readme")
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


def _cpu() -> str:
    """The CPU as every stage's stack record names it (model and ISA)."""
    sys.path.insert(0, str(ROOT))
    from stages.run import reproducible

    return reproducible.stack()["cpu"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(RECORD.parent), help="where default-run.json/.md go")
    ap.add_argument("--readme", action="store_true", help="rewrite README's default-run block from the record")
    ap.add_argument("--check", action="store_true", help="verify README and the default config against the record")
    ap.add_argument("--no-run", action="store_true", help="with --readme: render the existing record, run nothing")
    a = ap.parse_args()
    if a.check:
        sys.exit(check())
    rec = json.loads(RECORD.read_text()) if a.no_run else measure(Path(a.out))
    write_md(rec, RECORD.parent if a.no_run else Path(a.out))
    if a.readme:
        (ROOT / "README.md").write_text(readme_text(rec))
    print(block(rec))


if __name__ == "__main__":
    main()
