"""Peer runner: TRL 1.16 DistillationTrainer on the benchmark's model dirs and prompts (one process).

Invoked by benchmarks/systems.py with a JSON spec; writes per-step wall times (CUDA-synchronised,
measured with a TrainerCallback), construction time and peak memory to spec["out"].
"""
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

# our process-age reading, loaded by path: importing the `stages` package would also apply its
# process settings (malloc, MKL) to the peer's process
_spec = importlib.util.spec_from_file_location("hostmem", Path(__file__).resolve().parent.parent / "stages/memory/hostmem.py")
hostmem = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hostmem)


def main(spec: dict) -> None:
    import pyarrow.parquet as pq
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import DistillationConfig, DistillationTrainer

    rows = pq.read_table(spec["prompts"]).to_pylist()
    train_rows = [r for r in rows if r["extra_info"]["split"] == "train"]
    ds = Dataset.from_list([{"prompt": r["prompt"]} for r in train_rows])
    tok = AutoTokenizer.from_pretrained(spec["student"])
    steps, marks = [], {}

    class Timer(TrainerCallback):
        # one step = from the previous step's end (the first: training's start) to this one's, so that
        # whatever the trainer does between optimizer steps (batch preparation, its generation if it runs
        # there, the micro-batches of an accumulation) counts toward the step
        def on_train_begin(self, args, state, control, **kw):
            torch.cuda.synchronize()
            marks["t"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            torch.cuda.synchronize()
            now = time.perf_counter()
            steps.append(now - marks["t"])
            marks["t"] = now
            if len(steps) == 1:
                marks["first_end"] = now
                marks["first_end_age"] = hostmem.process_age_s()

    t0 = time.perf_counter()
    args = DistillationConfig(
        # micro_batch: prompts per forward, accumulated to n_prompts per optimizer step (workload b's 64
        # prompts x 640 positions of 151,936-wide fp32 logits do not fit one H100 at once)
        output_dir=spec["out"] + ".d", per_device_train_batch_size=spec.get("micro_batch", spec["n_prompts"]),
        gradient_accumulation_steps=spec["n_prompts"] // spec.get("micro_batch", spec["n_prompts"]),
        gradient_checkpointing=spec.get("gradient_checkpointing", False),
        max_completion_length=spec["response"], beta=0.0, temperature=1.0, top_p=1.0, bf16=True,
        max_steps=spec["updates"], generation_kwargs={"min_new_tokens": spec["response"]}, report_to=[],
        save_strategy="no", logging_steps=1, learning_rate=1e-4)
    trainer = DistillationTrainer(
        model=spec["student"], teacher_model=spec["teacher"], args=args, train_dataset=ds, processing_class=tok,
        peft_config=LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                               target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"]),
        callbacks=[Timer()])
    construct = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    tail = steps[1:] if len(steps) > 1 else steps
    out = {"name": "TRL 1.16 DistillationTrainer", "micro_batch": args.per_device_train_batch_size,
           "gradient_accumulation_steps": args.gradient_accumulation_steps,
           "gradient_checkpointing": args.gradient_checkpointing, "steps_s": [round(s, 4) for s in steps],
           "median_update_s": round(statistics.median(tail), 4), "construction_s": round(construct, 2),
           "first_update_incl_construction_s": round(marks["first_end"] - t0, 2),
           # from the process's start: the interpreter, its imports (trl, transformers, datasets), the tokenizer
           "first_update_since_process_start_s": marks["first_end_age"],
           "rollout_tok_per_s": None,
           "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
           "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3)}
    json.dump(out, open(spec["out"], "w"), indent=1)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
