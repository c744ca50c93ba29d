"""The student's LoRA projections, forward and backward, as PEFT computes them and with
stages/weights/lora_kernels.py's kernels, side by side in one process (CUDA).

    python benchmarks/lora_kernels.py [--workload a,b] [--rows 3072,12288] [--iters 20] --out DIR
    TRITON_INTERPRET=1 python benchmarks/lora_kernels.py --smoke --out DIR   (CPU: the driver end to end,
    tiny shapes, fp16, through Triton's interpreter; times of no meaning)

Per workload: one decoder layer's seven LoRA Linears (q, k, v, o, gate, up, down; conf/arch shapes of
the workload's student, bf16 bases, r 16 in fp32 as lora.add makes them), each over the workload's
rows (prompts x (prompt + response) positions), inputs and output gradients random. A step is the
seven forwards then the seven backwards; the median over --iters steps (CUDA events) per variant,
interleaved, and that times the student's layer count: launched one by one (eager, the CPU's dispatch
included) and replayed from CUDA graphs of the forwards and of the backward (as the update runs where
runtime.cuda_graphs is on: little of the CPU's time). Also the memory each variant's forwards keep
for the backward, and the share of outputs whose bytes agree (tests/lora_kernel_cases.py bounds the
rest). Writes lora-kernels.json and .md under --out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

import lora_kernel_cases  # noqa: E402  (tests/: the PEFT layer the tests build)
from systems import WORKLOAD_A, WORKLOAD_B, WORKLOAD_SMOKE  # noqa: E402
from stages.weights import lora_kernels, models  # noqa: E402

WORKLOADS = {"a": WORKLOAD_A, "b": WORKLOAD_B, "smoke": WORKLOAD_SMOKE}


def projections(arch: dict) -> dict[str, tuple[int, int]]:
    """name -> (in, out) of one decoder layer's LoRA'd projections."""
    E, I, H = arch["hidden_size"], arch["intermediate_size"], arch["num_attention_heads"]
    KV, D = arch.get("num_key_value_heads") or H, arch.get("head_dim") or E // H
    return {"q_proj": (E, H * D), "k_proj": (E, KV * D), "v_proj": (E, KV * D), "o_proj": (H * D, E),
            "gate_proj": (E, I), "up_proj": (E, I), "down_proj": (I, E)}


def run(w: dict, iters: int, device: str, dtype, rows: int = 0) -> dict:
    arch = models.arch_config(w["student"])
    N = rows or w["prompts"] * (w["prompt_tokens"] + w["response"])
    gen = torch.Generator().manual_seed(0)
    cuda = device == "cuda"
    layers, data = {}, {}
    for name, (K, O) in projections(arch).items():
        peft = lora_kernel_cases.layer(K, O, 16, 32.0, dtype, device, gen)
        ours = lora_kernel_cases.layer(K, O, 16, 32.0, dtype, device, gen)
        ours.load_state_dict(peft.state_dict())  # (the same weights)
        assert lora_kernels.install(ours) == 1
        layers[name] = {"peft": peft, "kernels": ours}
        data[name] = (torch.randn(N, K, generator=gen).to(device, dtype), torch.randn(N, O, generator=gen).to(device, dtype))

    def step(variant: str) -> tuple[float, int, list]:
        xs = {n: x.detach().requires_grad_() for n, (x, _) in data.items()}
        if cuda:
            torch.cuda.synchronize()
        before = torch.cuda.memory_allocated() if cuda else 0
        start, end = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else (None, None)
        t = time.perf_counter()
        if cuda:
            start.record()
        ys = {n: layers[n][variant](xs[n]) for n in data}
        kept = torch.cuda.memory_allocated() - before if cuda else 0  # (outputs and what autograd saved)
        for n, y in ys.items():
            y.backward(data[n][1])
        if cuda:
            end.record()
            torch.cuda.synchronize()
        return (start.elapsed_time(end) / 1e3 if cuda else time.perf_counter() - t), kept, [ys[n].detach() for n in data]

    def zero(variant: str) -> None:
        for layer in layers.values():
            layer[variant].zero_grad(set_to_none=True)

    class Seven(torch.nn.Module):
        """The layer's seven projections as one module: the seven inputs -> the seven outputs."""
        def __init__(self, variant: str):
            super().__init__()
            self.mods = torch.nn.ModuleList(layers[n][variant] for n in data)

        def forward(self, *xs):
            return tuple(m(x) for m, x in zip(self.mods, xs))

    def graph(variant: str):
        """The seven forwards and their backward captured as a pair (make_graphed_callables, as the
        update's forwards are captured: stages/engine/graphs.py)."""
        xs = tuple(x.detach().requires_grad_() for x, _ in data.values())
        return torch.cuda.make_graphed_callables(Seven(variant), xs, num_warmup_iters=1), xs

    def replay(variant: str) -> float:
        fn, xs = graphs[variant]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.autograd.backward(fn(*xs), [g for _, g in data.values()])
        end.record()
        torch.cuda.synchronize()
        zero(variant)
        return start.elapsed_time(end) / 1e3

    variants = ("peft", "kernels")
    for _ in range(3):  # (first calls: Triton's compilations, cuBLAS's choices)
        step("peft"), step("kernels")
    times, kept, last = {v: [] for v in variants}, {}, {}
    for _ in range(iters):
        for v in variants:
            t, kept[v], last[v] = step(v)
            times[v].append(t)
            zero(v)
    ref, ys = last["peft"], last["kernels"]  # (the inputs are the same every step)
    same = sum(int((a == b).sum()) for a, b in zip(ref, ys)) / sum(a.numel() for a in ys)
    graphed = {}
    if cuda:
        graphs = {v: graph(v) for v in variants}
        replays = {v: [] for v in variants}
        for _ in range(iters):
            for v in variants:
                replays[v].append(replay(v))
        graphed = {v: statistics.median(ts) for v, ts in replays.items()}
    L = arch["num_hidden_layers"]
    med = {v: statistics.median(ts) for v, ts in times.items()}
    return {"student": w["student"], "rows": N, "layers": L, "iters": iters,
            "layer_s": {v: round(t, 6) for v, t in med.items()},
            "model_s": {v: round(t * L, 4) for v, t in med.items()},
            "speedup": round(med["peft"] / med["kernels"], 3),
            "graphed_layer_s": {v: round(t, 6) for v, t in graphed.items()},
            "graphed_model_s": {v: round(t * L, 4) for v, t in graphed.items()},
            "graphed_speedup": round(graphed["peft"] / graphed["kernels"], 3) if graphed else None,
            "kept_gib_per_layer": {v: round(b / 2 ** 30, 4) for v, b in kept.items()},
            "outputs_identical": round(same, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="a,b")
    ap.add_argument("--rows", default="", help="more row counts, each workload's student at each (where the "
                    "kernels start to win launched eagerly, where the CPU's launches weigh more than the GPU's time)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if lora_kernels.triton is None or not (args.smoke or torch.cuda.is_available()):
        sys.exit("benchmarks/lora_kernels.py: needs Triton, and CUDA (or --smoke under TRITON_INTERPRET=1)")
    if args.smoke:
        lora_kernels.usable = lora_kernels.fits  # (CPU tensors: the interpreter runs the kernels)
        cases, iters, device, dtype = ["smoke"], 2, "cpu", torch.float16
    else:
        cases, iters, device, dtype = args.workload.split(","), args.iters, "cuda", torch.bfloat16
    extra = [int(n) for n in args.rows.split(",") if n]
    rows = {f"{k}@{n}" if n else k: run(WORKLOADS[k], iters, device, dtype, n) for k in cases for n in [0, *extra]}
    res = {"device": torch.cuda.get_device_name() if not args.smoke else "cpu (Triton's interpreter)",
           "torch": torch.__version__, "workloads": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lora-kernels.json").write_text(json.dumps(res, indent=1) + "\n")
    md = [f"# The LoRA projections: PEFT and lora_kernels ({res['device']}, torch {res['torch']})", "",
          "| workload | student, rows | one layer: PEFT | kernels | x | graphed: PEFT | kernels | x | whole model "
          "graphed: PEFT | kernels | kept per layer: PEFT | kernels | outputs identical |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ms = lambda d, v: f"{d[v] * 1e3:.3f} ms" if d else "-"  # noqa: E731
    for k, r in rows.items():
        g = r["graphed_layer_s"]
        md.append(f"| {k} | {r['student']}, {r['rows']} | {ms(r['layer_s'], 'peft')} | {ms(r['layer_s'], 'kernels')} | "
                  f"{r['speedup']} | {ms(g, 'peft')} | {ms(g, 'kernels')} | {r['graphed_speedup'] or '-'} | "
                  f"{r['graphed_model_s'].get('peft', '-')} s | {r['graphed_model_s'].get('kernels', '-')} s | "
                  f"{r['kept_gib_per_layer']['peft']} GiB | {r['kept_gib_per_layer']['kernels']} GiB | "
                  f"{r['outputs_identical']} |")
    (args.out / "lora-kernels.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
