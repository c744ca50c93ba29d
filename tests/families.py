"""The real families beside the tiny Llamas (issue #44, item 4), for tests/test_families.py (CPU) and
tests/gpu/test_gpu_families.py: Qwen2 (q/k/v biases, an untied LM head) and Qwen3 (per-head q/k
RMSNorm, head_dim set apart from hidden / heads) as the tiny random pairs of conf/arch/tiny-qwen*.json,
SmolLM2's vocabulary and tokenizer; what a finished `opd run` left, read back; and a transformers +
PEFT model of the policy a rollout sampled, made without the run's code."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import torch

import numerics
from engine_models import engine_hidden, tempered_logprob, tiny
from support import TINY

FAMILIES = ("qwen2", "qwen3")


def overrides(family: str) -> list[str]:
    """support.TINY with the family's pair (arch:tiny-<family>, arch:tiny-<family>-teacher) in place of the
    tiny Llamas (and OPD_TEST_TOKENIZER's tokenizer where it is set, as TINY has it)."""
    out = [o.replace("arch:tiny-llama", f"arch:tiny-{family}") for o in TINY]
    assert f"student.name=arch:tiny-{family}" in out and f"teacher.name=arch:tiny-{family}-teacher" in out
    return out


def model(family: str, seed: int = 0, bias_scale: float = 0.5, **over):
    """The family's tiny student as transformers makes it (fp32, eval mode), its biases drawn from
    N(0, bias_scale): transformers initialises a Linear's bias to zero, and a zero bias would let an
    engine that drops it pass."""
    m = tiny(f"tiny-{family}", seed=seed, **over)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, bias_scale)
    return m


def qkv_biases(m) -> list[torch.Tensor | None]:
    """Per layer, q|k|v's biases concatenated (None: the layer has none), from the model's own modules."""
    from stages.weights import models

    out = []
    for layer in models.base_of(m).model.layers:
        a = layer.self_attn
        bs = [getattr(getattr(p, "base_layer", p), "bias") for p in (a.q_proj, a.k_proj, a.v_proj)]
        out.append(None if bs[0] is None else torch.cat([b.detach() for b in bs]))
    return out


class Run:
    """What a finished `opd run` left in its run view (artifacts/runs/<run>) and store."""

    def __init__(self, work: Path, run: str = "default"):
        self.work, self.dir = work, work / "artifacts" / "runs" / run
        self.train = json.loads((self.dir / "train.json").read_text())
        self.config = json.loads((self.dir / "config.json").read_text())
        self.history = list(csv.DictReader(open(self.dir / "history.csv")))

    def model_dir(self, role: str) -> Path:
        return self.work / "artifacts" / "store" / "model" / self.train["prepared"][role]

    def rollout(self, k: int) -> list[dict]:
        import pyarrow.parquet as pq

        return pq.read_table(self.dir / f"step-{k:04d}" / "rollout.parquet").to_pylist()

    def policy(self, k: int, device="cpu", dtype=torch.float32):
        """The student at policy version k as plain transformers + PEFT build it from the store's base and
        the adapter update k published (what rollout k + 1 sampled), eval mode, no grad."""
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        from stages.weights import lora

        base = AutoModelForCausalLM.from_pretrained(self.model_dir("student"), dtype=dtype).to(device)
        with lora.peft_wrap_quietly():  # (PEFT's read of a property transformers 5 deprecates)
            m = PeftModel.from_pretrained(base, self.dir / f"step-{k:04d}" / "adapter").to(device).eval()
        m.requires_grad_(False)
        return m

    def check_finished(self, updates: int) -> None:
        """Every step's view and adapter are there, history and evaluation finite."""
        assert self.train["updates"] == updates and len(self.history) == updates
        for k in range(1, updates + 1):
            step = self.dir / f"step-{k:04d}"
            assert (step / "adapter" / "adapter_model.safetensors").is_file(), step
            assert (step / "rollout.parquet").is_file() and (step / "scores.parquet").is_file(), step
        assert [int(h["step"]) for h in self.history] == list(range(1, updates + 1))
        for h in self.history:
            for key in ("loss", "kl", "grad_norm"):
                assert math.isfinite(float(h[key])), (key, h)
            assert float(h["loss"]) > 0 and float(h["grad_norm"]) > 0 and int(h["response_tokens"]) > 0, h
        ev = json.loads((self.dir / "eval.json").read_text())
        for who in ("initial", "final"):
            assert math.isfinite(ev[who]["on_teacher_text"]["kl"]) and ev[who]["on_teacher_text"]["tokens"] > 0, who
        # the rollout engine sampled every rollout (Resident.engine marks it; the fallback never does)
        assert "engine_built" in self.train["timings"]["startup_s"], self.train["timings"]["startup_s"]


def check_logprobs(model, prompts, responses, recorded, temperature, pad, monkeypatch, label):
    """The log-probs an engine recorded for `responses` against transformers' teacher-forced forward of
    `model` (LoRA unmerged) at the same tokens, as tests/engine/test_sampler.py compares them: each side
    within its own fp32 error bound (numerics.fp32_bound_through) of its exact value, and the two exact
    values (merged and unmerged LoRA, one pass or token by token) one number up to float64 rounding."""
    import transformers.masking_utils as mu

    from stages.engine import lmhead

    p = lmhead.pack(prompts, responses, [[1] * len(r) for r in responses], pad, "cpu")
    with torch.no_grad():
        lp, *_ = lmhead.score_positions(lmhead.hidden(model, p), lmhead.head_weight(model), p.targets, 4, 0,
                                        temperature=temperature, want_topk=False)
    # tracing needs transformers' mask builder not to branch on the data (it builds the padding mask anyway)
    monkeypatch.setattr(mu, "_ignore_causal_mask_sdpa", lambda *a, **k: False)
    head = tempered_logprob(lmhead.head_weight(model), p.targets, temperature)
    ref_tf, b_tf = numerics.fp32_bound_through(lambda: lmhead.hidden(model, p), head)
    ref_en, b_en = numerics.fp32_bound_through(lambda: engine_hidden(model, prompts, responses, pad), head)
    rec = torch.as_tensor([x for r in recorded for x in r], dtype=torch.float32)
    assert rec.shape == lp.shape and len(rec) > 0
    numerics.check(lp, ref_tf, b_tf, f"{label}: transformers' teacher-forced forward")
    numerics.check(rec, ref_en, b_en, f"{label}: the engine's recorded log-probs")
    numerics.check(ref_en, ref_tf, (b_tf + b_en) * numerics.U64 / numerics.U32, f"{label}: engine vs transformers, exact")
