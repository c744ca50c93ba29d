"""`opd plan --probe`: a bounded CUDA calibration of the plan. Loads the models as the chosen
placement does and measures, with the same `phase()` records the pipeline writes: one rollout batch
(every prompt at data.max_prompt_tokens, every response forced to its full length), one score chunk,
one update forward+backward. Zero optimizer updates: nothing is published but the measurement,
cached in the store by an identity digest of shapes, settings and versions.
"""
from __future__ import annotations

import gc
import json

import numpy as np
import torch

from .. import objectives, train, update
from ..run import identity as stage_identity
from ..engine import lmhead
from ..weights import models
from ..run.config import logit_temperature
from ..errors import UserError
from ..run.store import Store, write_json
from ..session import phase


def identity(cfg, est: dict) -> dict:
    return {"models": est["models"], "workload": est["workload"], "placement": est["placement"]["chosen"],
            "lora": {"r": cfg.lora.r, "target_modules": sorted(cfg.lora.target_modules)},
            "objective": {"needs": sorted(objectives.needs(cfg.objective)), "topk": cfg.objective.topk},
            "dtype": est["dtype"], "vram_gib": cfg.memory.vram_gib, "forward_graphs": cfg.runtime.cuda_graphs,
            "env": models.env_versions()}


def run(cfg, est: dict) -> dict:
    """Measured peaks per phase (cached); the plan puts them beside its estimates."""
    if not torch.cuda.is_available() or est["device"] != "cuda":
        raise UserError("--probe measures on CUDA and this run's device is not a CUDA device here; "
                        "the table above is the weight-free estimate")
    dig = stage_identity.make("probe", identity(cfg, est), {})
    d, computed = Store(cfg.artifacts).ensure("probe", dig, lambda tmp: write_json(tmp / "probe.json",
                                                                                  measure(cfg, est)))
    out = json.loads((d / "probe.json").read_text())
    out.update(digest=dig, cached=not computed)
    for ph, rec in out["phases"].items():
        if ph in est["phases"]:
            est["phases"][ph]["measured_gib"] = rec["peak_allocated_gib"]
            rec["estimate_gib"] = est["phases"][ph]["total_gib"]
            rec["ratio"] = round(rec["peak_allocated_gib"] / max(rec["estimate_gib"], 1e-9), 4)
    return out


def measure(cfg, est: dict) -> dict:
    # what this process already holds on the device before the probe loads anything (nothing under
    # `opd plan --probe`; an earlier probe's models in a longer-lived process) is not this run's
    gc.collect()  # an earlier session's models (and graph pools) that are garbage go now, not mid-probe
    torch.cuda.empty_cache()
    held = torch.cuda.memory_allocated()
    sess = train.session(cfg, placement=est["placement"]["chosen"])
    w = est["workload"]
    B, P, N, V, k = w["sequences"], w["prompt_tokens"], w["new_tokens"], w["vocab"], cfg.objective.topk
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, V, (B, P), generator=g).tolist()  # the worst case: every prompt at the limit
    phases: dict[str, dict] = {}

    # steady state before the phases: both roles loaded as placed, the LoRA grads and the resident
    # AdamW moments a previous update leaves (zeros: no step is ever taken)
    sess.models.activate("teacher")
    sess.models.teacher()
    sess.models.activate("student")
    student = sess.models.student()
    named = [(n, q) for n, q in student.named_parameters() if q.requires_grad]
    opt = torch.optim.AdamW([q for _, q in named])
    for _, q in named:
        q.grad = torch.zeros_like(q)
        opt.state[q] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(q), "exp_avg_sq": torch.zeros_like(q)}
    sess.models.optimizer = (None, opt, named)
    if sess.models.placement != "swap":
        sess.models.engine()  # resident: built once at step 1 (under swap each rollout rebuilds it, in-phase)

    phases["rollout"] = {}
    with phase(sess.device, phases["rollout"]):
        ro = sess.models.generate(prompts, N, seed=0, min_new=N)
    responses = [ro.tokens[b, :int(ro.lengths[b])].tolist() for b in range(B)]
    p = lmhead.pack(prompts, responses, [[1] * len(r) for r in responses], pad=0, device=sess.device)
    n = p.targets.numel()

    sess.models.activate("teacher")
    teacher = sess.models.teacher()
    phases["score"] = {}
    with phase(sess.device, phases["score"]), torch.no_grad():
        h = lmhead.hidden(teacher, p)  # [n, H]
        c = slice(0, min(cfg.train.chunk, n))  # one score chunk
        lmhead.score_positions(h[c], lmhead.head_weight(teacher), p.targets[c], cfg.train.chunk, k,
                               logit_temperature(cfg.rollout))
        del h

    sess.models.activate("student")
    sc = {"teacher_logprobs": np.full(n, -3.0, np.float32),
          "topk_ids": torch.randint(0, V, (n, k), generator=g).numpy(),
          "topk_logprobs": np.full((n, k), -5.0, np.float32)}
    adv = torch.zeros(n, device=sess.device)
    student.train()
    phases["update"] = {}
    with phase(sess.device, phases["update"]):
        update.backward_sums(sess, student, p, torch.zeros(n, device=sess.device), sc, adv,
                             chunk=cfg.train.chunk)  # forward + backward; no optimizer step
    student.eval()
    for rec in phases.values():
        rec["peak_allocated_gib"] = round(rec["peak_allocated_gib"] - held / 2**30, 4)
    return {"device": torch.cuda.get_device_name(), "phases": phases, "optimizer_updates": 0,
            "held_before_gib": round(held / 2**30, 4),
            "tokens": {"prompt": P, "new": N, "sequences": B, "positions": n}}
