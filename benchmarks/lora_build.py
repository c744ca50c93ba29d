"""A fresh LoRA on the seed student, PEFT's construction against ours (stages/blocks/lora_init.py),
alternating in one process, with and without a second thread busy in the interpreter (as the
read-ahead thread is while the student's LoRA is built: docs/architecture.md, "Startup"), that one
at each given switch interval (Python's default 5 ms, and the construction's, stages/blocks/ahead.py).

    python benchmarks/lora_build.py --out DIR [--repeats 5] [--device cuda] [--switch 0.005,0.0001]

Each build gets a fresh base (SmolLM2-360M's shape, bf16, uninitialised weights on the device: the
values do not matter to the construction) and the same seed; the two adapters are compared byte for
byte every time. Writes DIR/lora-build.json and .md.
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

from stages.blocks import ahead, models  # noqa: E402
from stages.blocks.config import LoraCfg  # noqa: E402


def base(device: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = {k: v for k, v in json.loads((ROOT / "conf/arch/smollm2-360m.json").read_text()).items() if k != "_comment"}
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(AutoConfig.for_model(**spec), dtype=torch.bfloat16)
    return m.to_empty(device=device).eval().requires_grad_(False)


def peft_build(m, lcfg: LoraCfg, seed: int):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=lcfg.r, lora_alpha=lcfg.alpha, lora_dropout=lcfg.dropout,
                     target_modules=list(lcfg.target_modules), bias="none", task_type="CAUSAL_LM")
    with models.peft_wrap_quietly():
        return get_peft_model(m, cfg)


def busy(stop: threading.Event) -> None:
    """Interpreter-bound work, like the body of a module being imported: Python bytecode, over and over."""
    while not stop.is_set():
        sum(i * i for i in range(10_000) if i % 3)


def timed(fn, device: str) -> tuple[float, object]:
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--switch", default=f"0.005,{ahead.SWITCH_S}", help="intervals (s) for the busy runs")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    lcfg, seed = LoraCfg(), 1234
    res = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
           "command": "python benchmarks/lora_build.py " + " ".join(sys.argv[1:]), "runs": {}}
    peft_build(base(args.device), lcfg, seed)  # first calls (imports, CUDA context) paid outside
    default = sys.getswitchinterval()
    for switch in [None, *(float(x) for x in args.switch.split(","))]:
        times = {"peft": [], "ours": []}
        stop = threading.Event()
        t = threading.Thread(target=busy, args=(stop,), daemon=True)
        if switch is not None:
            sys.setswitchinterval(switch)
            t.start()
        for _ in range(args.repeats):
            built = {}
            for name, fn in (("peft", lambda m: peft_build(m, lcfg, seed)), ("ours", lambda m: models.add_lora(m, lcfg, seed))):
                m = base(args.device)
                s, built[name] = timed(lambda: fn(m), args.device)
                times[name].append(round(s, 4))
            a, b = (dict(built[k].named_parameters()) for k in ("peft", "ours"))
            same = list(a) == list(b) and all(torch.equal(a[n], b[n]) for n in a if "lora_" in n)
            if not same:
                raise SystemExit("lora_build: our adapter differs from PEFT's")
            del built
        stop.set()
        if switch is not None:
            t.join()
        sys.setswitchinterval(default)
        res["runs"]["alone" if switch is None else f"busy thread, switch interval {switch * 1000:g} ms"] = {
            k: {"median_s": statistics.median(v), "runs_s": v} for k, v in times.items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lora-build.json").write_text(json.dumps(res, indent=1))
    lines = [f"# A fresh LoRA on the 360M student ({res['device']}, torch {res['torch']})", "",
             f"Command: `{res['command']}`. Adapters byte-identical in every repeat.", "",
             "| beside it | PEFT's construction, median s | ours, median s | runs (PEFT / ours) |", "|---|---|---|---|"]
    for k, r in res["runs"].items():
        lines.append(f"| {k} | {r['peft']['median_s']} | "
                     f"{r['ours']['median_s']} | {r['peft']['runs_s']} / {r['ours']['runs_s']} |")
    (out / "lora-build.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
