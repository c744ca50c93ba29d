"""Where the seconds before the first update go: fresh `opd stage train` processes (1 update, a
fresh store each) on the seed workload's models, timed piece by piece, the last one sampled by
py-spy (a sampling profiler: unlike cProfile it does not slow each Python call, so imports and
calls through torch's dispatcher keep their real proportions).

    python benchmarks/first_update.py --tokenizer DIR --out DIR [--runs 2] [--sampler py-spy|py-spy-gil] [--smoke]
        [--workload a|b] [--against runtime.warmup=false] [--against-tree DIR] [--cold]
    python benchmarks/first_update.py --explain FILE.pyspy.gz --under 'make_graphed_callables' [--under ...] [--imports]

Writes <out>/first-update.json and .md: per process its wall time, `first_update_s` and
`timings.startup_s` (train.json), and for the sampled one the main thread's inclusive and own
seconds per function (samples / rate), every thread's total, and the raw stacks (first-update.pyspy.gz).
The first process runs on whatever compile caches the machine has; the later ones find them warm.
--against KEY=VALUE (repeatable) runs as many processes more with those overrides, interleaved with
the others (against, ours, against, ours: the same machine and caches), and the summary compares the
two sets' first updates without the first process of all (cold caches). --against-tree DIR runs
the comparison set on another checkout's `stages` (e.g. `git archive REV stages conf | tar -x -C DIR`:
the code before a change, interleaved with the code after it, where two sets one after the other
also measure the machine's drift); the runs' params are this checkout's, so both must read them.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import systems  # noqa: E402  (seed store, overrides, fresh artifacts: the systems benchmark's own)

RATE = 200  # samples per second
FRAME = re.compile(r"^(?P<fn>.*) \((?P<where>[^()]*?)(?::\d+)?\)$")


def frame_key(frame: str) -> str:
    """'forward (/x/site-packages/transformers/models/llama/modeling_llama.py:364)' ->
    'forward (transformers/models/llama/modeling_llama.py)': one key per function, lines merged."""
    m = FRAME.match(frame)
    if not m:
        return frame
    where = re.sub(r"^.*?/(site|dist)-packages/", "", m["where"])
    where = re.sub(rf"^{re.escape(str(ROOT))}/", "", where)
    return f"{m['fn']} ({where})"


def stacks(raw: Path) -> tuple[Counter, list[tuple[list[str], int]]]:
    """py-spy's raw (collapsed) stacks, gzipped or not -> (samples per thread, the main thread's
    stacks as (function keys outermost first, samples))."""
    rows = []
    text = gzip.open(raw, "rt").read() if raw.suffix == ".gz" else raw.read_text()
    for line in text.splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            frames = stack.split(";")
            head = next((f for f in frames if f.startswith("thread (")), "thread (?)")
            rows.append((re.match(r"thread \((\w+)", head)[1] if head != "thread (?)" else "?", head, frames, int(n)))
    names = {tid: head for tid, head, _, _ in rows if ":" in head}  # 'thread (0x..): MainThread' once named
    threads = Counter()
    for tid, _, _, n in rows:
        threads[names.get(tid, f"thread ({tid})")] += n
    main = next((tid for tid, head in names.items() if head.endswith("MainThread")), None)
    return threads, [([frame_key(f) for f in frames if not f.startswith(("thread (", "process "))], n)
                     for tid, _, frames, n in rows if tid == main]


def seconds(c: Counter, k: int) -> list[list]:
    return [[key, round(v / RATE, 3)] for key, v in c.most_common(k)]


def summarise(raw: Path, top: int = 60) -> dict:
    """Seconds per thread, and the main thread's inclusive (each function once per stack) and own
    (innermost frame) seconds per function."""
    threads, main = stacks(raw)
    incl, own = Counter(), Counter()
    for body, n in main:
        for k in set(body):
            incl[k] += n
        if body:
            own[body[-1]] += n
    return {"rate_hz": RATE, "threads_s": seconds(threads, 20), "main_inclusive_s": seconds(incl, top),
            "main_own_s": seconds(own, top // 2)}


def under(raw: Path, name: str, top: int = 15) -> list[list]:
    """The main thread's seconds inside the outermost frame whose key starts with `name`, per
    function it called there ('(itself)': the frame's own samples)."""
    c = Counter()
    for body, n in stacks(raw)[1]:
        i = next((i for i, k in enumerate(body) if k.startswith(name)), None)
        if i is not None:
            c[body[i + 1] if i + 1 < len(body) else "(itself)"] += n
    return seconds(c, top)


def imports(raw: Path, name: str = "", top: int = 25) -> list[list]:
    """The main thread's seconds importing each module (inclusive: the modules it imported count
    too), inside the outermost frame whose key starts with `name` (anywhere when empty)."""
    c = Counter()
    for body, n in stacks(raw)[1]:
        i = next((i for i, k in enumerate(body) if k.startswith(name)), None) if name else 0
        if i is not None:
            for mod in dict.fromkeys(k[len("<module> ("):-1] for k in body[i:] if k.startswith("<module> (")):
                c[mod] += n
    return seconds(c, top)


def one_process(w: dict, work: Path, tok: str, tag: str, sampler: str | None, extra: tuple[str, ...],
                cold: bool = False, tree: Path | None = None) -> dict:
    cmd, cwd, env, art = systems.one_update_run(w, work, tok, tag, extra)
    if tree is not None:  # another checkout's stages, first on the path
        env = {**env, "PYTHONPATH": f"{tree}{os.pathsep}{env['PYTHONPATH']}"}
    if cold:  # compile caches of its own, empty: Triton's and Inductor's (a fresh machine's first run)
        env = {**env, "TRITON_CACHE_DIR": str(cwd / "cold-triton"), "TORCHINDUCTOR_CACHE_DIR": str(cwd / "cold-inductor")}
    raw = cwd / "first-update.pyspy"
    out: dict = {"name": tag}
    if sampler in ("py-spy", "py-spy-gil"):
        # --nonblocking: samples without stopping the process (~3% on a tiny CPU run, where --native,
        # which stops it to unwind C++ frames, made it ten times slower); time in C is charged to
        # the Python function that called it. py-spy-gil: only the thread holding the interpreter
        # lock, at each sample (--gil, no --idle): whose Python the main thread waits behind
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        how = ["--gil"] if sampler == "py-spy-gil" else ["--idle"]
        cmd = [spy, "record", "-r", str(RATE), *how, "--threads", "--nonblocking", "-f", "raw", "-o", str(raw),
               "--", *cmd]
        out["sampler"] = f"py-spy --nonblocking {how[0]}"
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    out["process_wall_s"] = round(time.perf_counter() - t, 2)
    if r.returncode:
        raise RuntimeError(f"{tag} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    timings = json.loads((art / "runs" / tag / "train.json").read_text())["timings"]
    out["first_update_s"] = timings.get("first_update_s")
    out["startup_s"] = timings.get("startup_s")
    out["warmup"] = {k: v for k, v in timings.items() if k.startswith(("warmup_", "precompile_"))}
    if raw.exists():
        out["profile"] = summarise(raw)
        out["raw"] = str(raw)
    return out


def tree_imports(tree: Path) -> str:
    """The stages package a process imports with `tree` first on its path, as --against-tree's do (an
    installed checkout could otherwise win): its __init__.py, or the import's last error line."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(tree), str(ROOT), os.environ.get("PYTHONPATH"))
                                                       if p)}
    r = subprocess.run([sys.executable, "-c", "import stages; print(stages.__file__)"], env=env, cwd=tree,
                       capture_output=True, text=True)
    return r.stdout.strip() or (r.stderr.strip().splitlines() or ["no output"])[-1]


def compare(processes: list[dict], cold: bool = False) -> dict[str, list[float]]:
    """First updates per set (ours: first-N, the comparison: against-N), the first process of all left
    out (its compile caches were cold, the others' warm) unless every process ran cold."""
    out: dict[str, list[float]] = {"ours": [], "against": []}
    for p in processes[0 if cold else 1:]:
        out["against" if p["name"].startswith("against-") else "ours"].append(p["first_update_s"])
    return out


def _warmup(w: dict) -> str:
    """The warm-up's record: its seconds in the order they came, then what it names (the children's
    parts, an error's line)."""
    secs = {k: v for k, v in w.items() if isinstance(v, (int, float))}
    named = [f"{k} {'+'.join(v) if isinstance(v, list) else v}" for k, v in w.items() if k not in secs]
    return ", ".join(x for x in (systems.pieces(secs), *named) if x)


def markdown(res: dict) -> str:
    lines = [f"# First update, piece by piece ({res['device']}, torch {res['torch']})", "",
             f"Command: `{res['command']}`", "",
             "| process | wall s | first update s | construction pieces (s since the session opened) "
             "| warm-up (s since it started, just before `prepared`) |", "|---|---|---|---|---|"]
    for p in res["processes"]:
        lines.append(f"| {p['name']} ({p.get('sampler', 'unsampled')}) | {p['process_wall_s']} | {p['first_update_s']} | "
                     f"{systems.pieces(p.get('startup_s') or {})} | {_warmup(p.get('warmup') or {})} |")
    if res.get("against") or res.get("against_tree"):
        which = ("every process on empty compile caches of its own (--cold), median:" if res.get("cold") else
                 "first update without the first process of all (cold caches), median over the rest:")
        what = " ".join([*res.get("against", []), *([f"the stages of {res['against_tree']} ({res['against_imports']})"]
                                                    if res.get("against_tree") else [])])
        lines += ["", f"Against `{what}` (the `against-N` processes), {which}", ""]
        for name, vals in compare(res["processes"], res.get("cold", False)).items():
            lines.append(f"- {name}: {statistics.median(vals):.3f} s over {len(vals)} ({', '.join(f'{v:.3f}' for v in vals)})"
                         if vals else f"- {name}: no process to compare")
    for p in res["processes"]:
        if "profile" not in p:
            continue
        prof = p["profile"]
        held = "--gil" in p["sampler"]
        lines += ["", f"## {p['name']}: {p['sampler']}, {prof['rate_hz']} Hz, "
                  f"{'the interpreter lock holder alone' if held else 'idle time included'}", "",
                  ("Seconds holding the interpreter lock, per thread: " if held else "Seconds per thread: ")
                  + "; ".join(f"{k} {v}" for k, v in prof["threads_s"]), "",
                  "Main thread, inclusive (each function once per stack):", "", "| s | function |", "|---|---|"]
        lines += [f"| {v} | `{k}` |" for k, v in prof["main_inclusive_s"]]
        lines += ["", "Main thread, own (the innermost frame):", "", "| s | function |", "|---|---|"]
        lines += [f"| {v} | `{k}` |" for k, v in prof["main_own_s"]]
    return "\n".join(lines) + "\n"


def shape(workload: str, smoke: bool, sets: list[str]) -> tuple[dict, list[str]]:
    """The workload's shape and our runs' overrides: b's settings (systems.B_DEFAULT) first, so that
    --set (and --against, after these) win."""
    if workload == "b":
        sets = [*systems.B_DEFAULT, *sets]
    return (systems.WORKLOAD_SMOKE if smoke else systems.WORKLOAD_B if workload == "b" else systems.WORKLOAD_A), sets


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--explain", type=Path, default=None,
                    help="a recorded first-update.pyspy[.gz]: print where the main thread's time went under each "
                         "--under function, and measure nothing")
    ap.add_argument("--under", action="append", default=[], help="a function key's start, e.g. 'load (stages/'")
    ap.add_argument("--imports", action="store_true",
                    help="with --explain: seconds importing each module, under each --under function (or anywhere)")
    ap.add_argument("--tokenizer")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--runs", type=int, default=2, help="fresh processes, one after another")
    ap.add_argument("--sampler", choices=["py-spy", "py-spy-gil", "none"], default="py-spy",
                    help="for the last process (py-spy-gil: the lock holder's stacks alone)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny random models (the driver end to end)")
    ap.add_argument("--workload", choices=["a", "b"], default="a",
                    help="b: workload b's models and batch, with its default settings (systems.B_DEFAULT)")
    ap.add_argument("--set", action="append", default=[], help="more overrides for our runs (key=value)")
    ap.add_argument("--against", action="append", default=[],
                    help="overrides (key=value) of a comparison set of processes, interleaved with ours")
    ap.add_argument("--against-tree", type=Path, default=None,
                    help="run the comparison set on this checkout's stages package (with --against's overrides, if any)")
    ap.add_argument("--cold", action="store_true",
                    help="every process on empty Triton and Inductor caches of its own (a fresh machine's first run)")
    args = ap.parse_args(argv)
    if args.explain:
        for name in args.under:
            print(f"\n{name}: s (main thread) per function it called\n" +
                  "\n".join(f"{v:8.3f}  {k}" for k, v in under(args.explain, name)))
        for name in (args.under or [""]) if args.imports else ():
            print(f"\n{name or 'the main thread'}: s importing each module (inclusive)\n" +
                  "\n".join(f"{v:8.3f}  {k}" for k, v in imports(args.explain, name)))
        return 0
    if not (args.tokenizer and args.out):
        ap.error("--tokenizer and --out are needed to measure")
    if args.smoke:
        systems.DEVICE = "cpu"
    w, args.set = shape(args.workload, args.smoke, args.set)
    work = Path(tempfile.mkdtemp(prefix="opd-first-"))
    tok = str(Path(args.tokenizer).resolve())
    import torch

    res = {"command": " ".join(["python", *sys.argv]), "torch": torch.__version__,
           "device": torch.cuda.get_device_name(0) if systems.DEVICE == "cuda" else "cpu",
           "shape": w, "seed": systems.seed_store(w, work, tok), "processes": [], "against": args.against,
           "cold": args.cold}
    tree = args.against_tree.resolve() if args.against_tree else None
    if tree is not None:
        res["against_tree"], res["against_imports"] = str(tree), tree_imports(tree)
        if not res["against_imports"].startswith(str(tree)):
            ap.error(f"--against-tree {tree}: its processes would import {res['against_imports']}, not its stages")
    args.out.mkdir(parents=True, exist_ok=True)
    for i in range(args.runs):
        last = i == args.runs - 1
        if args.against or tree is not None:
            res["processes"].append(one_process(w, work, tok, f"against-{i + 1}", None, (*args.set, *args.against),
                                                args.cold, tree))
        res["processes"].append(one_process(w, work, tok, f"first-{i + 1}", args.sampler if last else None,
                                            tuple(args.set), args.cold))
        (args.out / "first-update.json").write_text(json.dumps(res, indent=1) + "\n")
        (args.out / "first-update.md").write_text(markdown(res))
    raw = res["processes"][-1].get("raw")
    if raw:  # the raw stacks, for `summarise` or flamegraph.pl (~6 MB of text, ~0.2 MB compressed)
        with open(raw, "rb") as f, gzip.open(args.out / "first-update.pyspy.gz", "wb") as g:
            shutil.copyfileobj(f, g)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
