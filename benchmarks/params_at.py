"""Host cost of `graphs.params_at` (asked before every graph replay): the module list walked once
(what it does) against `Module.parameters()` walked per call (what it did), on a LoRA'd 32-layer
Llama of tiny widths (the walk's cost depends on the module count, not the widths). CPU only.

    python benchmarks/params_at.py   # -> benchmarks/results/<date>-params-at-cpu.{json,md}
"""
from __future__ import annotations

import datetime as dt
import json
import platform
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from stages.engine import graphs


def per_call_ms(fn, n: int = 200) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=32, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1000)
    proj = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    inner = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=4, target_modules=proj)).base_model.model.model
    walked = lambda: tuple(p.data_ptr() for p in inner.parameters())  # noqa: E731
    assert graphs.params_at(inner) == walked()
    res = {"date": dt.date.today().isoformat(), "cpu": platform.processor() or platform.machine(),
           "torch": torch.__version__, "parameters": len(walked()),
           "modules": sum(1 for _ in inner.modules()),
           "parameters_walk_ms": round(per_call_ms(walked), 3),
           "params_at_ms": round(per_call_ms(lambda: graphs.params_at(inner)), 3)}
    out = Path(__file__).resolve().parent / "results" / f"{res['date']}-params-at-cpu"
    out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    out.with_suffix(".md").write_text(
        f"# graphs.params_at on CPU ({res['date']}, torch {res['torch']})\n\n"
        f"LoRA'd 32-layer Llama: {res['modules']} modules, {res['parameters']} parameters. Per call: "
        f"`Module.parameters()` walk {res['parameters_walk_ms']} ms, `params_at` (module list kept) "
        f"{res['params_at_ms']} ms.\n")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
