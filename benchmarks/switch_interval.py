"""The interpreter's switch interval against a thread running Python: work of the main thread made
of many small torch calls (each gives the interpreter lock up and waits to get it back) alone, and
beside a thread running Python bytecode (as the read-ahead thread's imports, tokenizer and pandas
do during the construction: docs/architecture.md, "Startup") at each given interval: Python's
default 5 ms, and the construction's (stages/weights/ahead.py).

    python benchmarks/switch_interval.py --out DIR [--repeats 5] [--device cuda] [--switch 0.005,0.0001]
        [--what lora,publish] [--tree DIR]

--what calls: single torch calls (a reshape, a view, a tensor's metadata reads), ms each: those that
give the lock up wait for it behind the thread, those that keep it (metadata) do not; lora: the
student's LoRA built by PEFT; publish: policy 0's publish (`adapters.save_adapter`:
the snapshot and the adapter file) and one update's snapshots (adapter and AdamW moments, as
update.py takes them), into a temporary dir. Each gets a fresh base (SmolLM2-360M's shape, bf16,
uninitialised weights on the device: the values do not matter here). --tree: import `stages` from
another checkout (the code before a change; its `stages` must have what this driver calls).
Writes DIR/switch-interval.json and .md.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_tree = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--tree=")),
             sys.argv[sys.argv.index("--tree") + 1] if "--tree" in sys.argv[:-1] else str(ROOT))
sys.path.insert(0, _tree)  # (before the imports below: --tree's `stages`)
from stages.tools.process import process_settings  # noqa: E402

process_settings()  # before torch, as `opd` does (stages/cli.py)
import torch  # noqa: E402

from stages.weights import adapters, ahead, lora  # noqa: E402
from stages.run.config import LoraCfg, OptimCfg  # noqa: E402


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


def publish(student, optim, work: Path) -> None:
    """Policy 0's publish and one update's snapshots, as init and update take them."""
    adapters.save_adapter(student, work / "policy", "opd-store/model/x")
    adapter_now = adapters.host_copy(adapters.adapter_state(student))
    moments_now = adapters.host_copy(adapters.optimizer_state(*optim))
    adapters.save_tensors(work / "optimizer.safetensors", moments_now())
    adapter_now()


CALLS = {  # one call each, on a small host tensor t (bf16 b for the dtype view)
    "t.reshape(-1)": lambda t, b: t.reshape(-1), "t.view(-1)": lambda t, b: t.view(-1),
    "t.detach()": lambda t, b: t.detach(), "b.view(torch.uint8)": lambda t, b: b.view(torch.uint8),
    "t.split([8, 8])": lambda t, b: t.split([8, 8]), "t.numel()": lambda t, b: t.numel(),
    "t.element_size()": lambda t, b: t.element_size(), "t.is_contiguous()": lambda t, b: t.is_contiguous(),
    "t.storage_offset()": lambda t, b: t.storage_offset(), "t.untyped_storage()": lambda t, b: t.untyped_storage(),
    "t.data_ptr()": lambda t, b: t.data_ptr(), "t.shape": lambda t, b: t.shape,
}


def calls(n: int = 200) -> dict[str, float]:
    """ms per call of each of CALLS, n calls in a row."""
    t, b = torch.randn(16, 960), torch.zeros(1000, dtype=torch.bfloat16)
    out = {}
    for name, fn in CALLS.items():
        t0 = time.perf_counter()
        for _ in range(n):
            fn(t, b)
        out[name] = round((time.perf_counter() - t0) / n * 1e3, 4)
    return out


def prepared(what: str, device: str, lcfg: LoraCfg):
    """A fresh job: (what to time, its argument-free call)."""
    if what == "calls":
        return calls
    m = base(device)
    if what == "lora":
        return lambda: lora.add(m, lcfg, 0)
    student = lora.add(m, lcfg, 0)
    opt, named = adapters.make_optimizer(OptimCfg(), student, None)
    for _, p in named:  # AdamW's moments exist from its first step
        p.grad = torch.zeros_like(p)
    opt.step()
    work = Path(tempfile.mkdtemp())
    return lambda: (publish(student, (opt, named), work), shutil.rmtree(work))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--switch", default=f"0.005,{ahead.SWITCH_S}", help="intervals (s) for the busy runs")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--what", default="lora", help="calls, lora, publish (comma-separated)")
    ap.add_argument("--tree", default=None, help="import stages from this checkout")
    args = ap.parse_args()
    lcfg = LoraCfg()
    res = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
           "command": "python benchmarks/switch_interval.py " + " ".join(sys.argv[1:]), "stages": _tree, "runs": {}}
    default = sys.getswitchinterval()
    for what in args.what.split(","):
        prepared(what, args.device, lcfg)()  # first calls (imports, CUDA context) paid outside
        for switch in [None, *(float(x) for x in args.switch.split(","))]:
            stop = threading.Event()
            t = threading.Thread(target=busy, args=(stop,), daemon=True)
            if switch is not None:
                sys.setswitchinterval(switch)
                t.start()
            times = []
            for _ in range(args.repeats):
                job = prepared(what, args.device, lcfg)
                times.append(job() if what == "calls" else round(timed(job, args.device), 4))
            stop.set()
            if switch is not None:
                t.join()
            sys.setswitchinterval(default)
            cond = "alone" if switch is None else f"beside a thread running Python, switch interval {switch * 1000:g} ms"
            res["runs"][f"{what}, {cond}"] = {"median_s": statistics.median(times), "runs_s": times} if what != "calls" \
                else {"median_ms_per_call": {k: statistics.median(r[k] for r in times) for k in CALLS}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "switch-interval.json").write_text(json.dumps(res, indent=1))
    lines = [f"# Many small torch calls beside a thread running Python ({res['device']}, torch {res['torch']})", "",
             f"Command: `{res['command']}` (stages from {res['stages']}).", "",
             "| work, condition | median s | runs s |", "|---|---|---|"]
    lines += [f"| {k} | {r['median_s']} | {r['runs_s']} |" for k, r in res["runs"].items() if "median_s" in r]
    for k, r in res["runs"].items():
        if "median_ms_per_call" in r:
            lines += ["", f"{k}, ms per call (median): " + ", ".join(f"`{c}` {v}" for c, v in r["median_ms_per_call"].items())]
    (out / "switch-interval.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
