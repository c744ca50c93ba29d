"""The interpreter's switch interval against a thread running Python: the student's LoRA built by
PEFT (~1,300 small torch calls, each of which gives the interpreter lock up) alone, and beside a
thread running Python bytecode (as the read-ahead thread's imports do while the student's LoRA is
built: docs/architecture.md, "Startup") at each given interval: Python's default 5 ms, and the
construction's (stages/blocks/ahead.py).

    python benchmarks/switch_interval.py --out DIR [--repeats 5] [--device cuda] [--switch 0.005,0.0001]

Each build gets a fresh base (SmolLM2-360M's shape, bf16, uninitialised weights on the device: the
values do not matter to the construction). Writes DIR/switch-interval.json and .md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import stages  # noqa: E402,F401  (before torch: the package's process settings)
import torch  # noqa: E402

from stages.blocks import ahead, lora  # noqa: E402
from stages.blocks.config import LoraCfg  # noqa: E402


def base(device: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = {k: v for k, v in json.loads((ROOT / "conf/arch/smollm2-360m.json").read_text()).items() if k != "_comment"}
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(AutoConfig.for_model(**spec), dtype=torch.bfloat16)
    return m.to_empty(device=device).eval().requires_grad_(False)


def busy(stop: threading.Event) -> None:
    """Interpreter-bound work, like the body of a module being imported: Python bytecode, over and over."""
    while not stop.is_set():
        sum(i * i for i in range(10_000) if i % 3)


def timed(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--switch", default=f"0.005,{ahead.SWITCH_S}", help="intervals (s) for the busy runs")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    lcfg = LoraCfg()
    res = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
           "command": "python benchmarks/switch_interval.py " + " ".join(sys.argv[1:]), "runs": {}}
    lora.add(base(args.device), lcfg, 0)  # first calls (imports, CUDA context) paid outside
    default = sys.getswitchinterval()
    for switch in [None, *(float(x) for x in args.switch.split(","))]:
        stop = threading.Event()
        t = threading.Thread(target=busy, args=(stop,), daemon=True)
        if switch is not None:
            sys.setswitchinterval(switch)
            t.start()
        times = []
        for _ in range(args.repeats):
            m = base(args.device)
            times.append(round(timed(lambda: lora.add(m, lcfg, 0), args.device), 4))
        stop.set()
        if switch is not None:
            t.join()
        sys.setswitchinterval(default)
        res["runs"]["alone" if switch is None else f"beside a thread running Python, switch interval {switch * 1000:g} ms"] = {
            "median_s": statistics.median(times), "runs_s": times}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "switch-interval.json").write_text(json.dumps(res, indent=1))
    lines = [f"# The student's LoRA built by PEFT ({res['device']}, torch {res['torch']})", "",
             f"Command: `{res['command']}`.", "", "| condition | median s | runs s |", "|---|---|---|"]
    lines += [f"| {k} | {r['median_s']} | {r['runs_s']} |" for k, r in res["runs"].items()]
    (out / "switch-interval.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
