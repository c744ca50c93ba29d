"""sft: supervised LoRA updates on verified oracle traces of a tool environment's training tasks.

Two uses, one stage ("sft" in the store: adapter/, optimizer.safetensors, state.json, like update):
- the student's cold start: sft.steps > 0 makes policy 0 the SFT adapter instead of a fresh LoRA;
  `continued` runs more steps from it (the benchmark's sft-continued arm: same optimizer, the
  trace walk carries on where the cold start stopped);
- the protocol-competent teacher: a LoRA on the teacher's base trained for sft.teacher_steps,
  merged into the teacher when teacher_mode=protocol_sft.

A trace is the environment's own solver transcript (`oracle_trace`), kept only if its final answer
passes the strict verifier and every tool result in it is what the tool returns when replayed.
Tokens are laid out exactly as a rollout lays them out (tooluse.trace_ids), so the student learns
the format it will sample in; tool messages are masked out of the loss, the EOS closing each
assistant turn is not. Loss: token-mean NLL over the assistant tokens, LM head in position chunks.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from . import envs, objectives
from .weights import adapters, lora, models
from .engine import lmhead
from .rows import prompts, tooluse
from .errors import UserError
from .run import codepaths
from .run.store import seed_of, write_json
from .envs import protocol
from .session import Session, phase

# ---- traces ----

def verified(env, task, turns: list[dict]) -> bool:
    """Final answer passes the strict verifier; every shown tool result replays identically."""
    if not turns or turns[-1]["role"] != "assistant":
        return False
    last = protocol.parse(turns[-1]["content"])
    if last.kind != "final" or not env.verify(task, last.answer):
        return False
    for i, m in enumerate(turns[:-1]):
        if m["role"] != "assistant":
            continue
        action = protocol.parse(m["content"])
        if action.kind != "tool_call" or i + 1 >= len(turns) or turns[i + 1]["role"] != protocol.TOOL_ROLE:
            return False
        if protocol.format_result(env.call_tool(task, action.name, action.arguments)) != turns[i + 1]["content"]:
            return False
    return True


def traces(sess: Session) -> tuple[list[tuple[list[int], list[int], list[int]]], int]:
    """([(prompt_ids, response_ids, response_mask)] of the verified traces, number rejected)."""
    tok = sess.models.tokenizer()
    g = tooluse.glue(tok)
    env = envs.get(sess.cfg.env.name)
    out, rejected = [], 0
    for task in tooluse.load_tasks(sess, "train"):
        turns = env.oracle_trace(task)
        if not verified(env, task, turns):
            rejected += 1
            continue
        resp, mask = tooluse.trace_ids(tok, g, turns)
        out.append((tooluse.initial_ids(tok, env, task), resp, mask))
    return out, rejected


# ---- loss ----

def _weights(p: lmhead.Packed) -> torch.Tensor:
    """[n] token-mean weight of each packed position (0 on tool tokens)."""
    w = objectives.agg_weights(p.mask, "token-mean")  # [B, R]
    j = torch.arange(p.rows.numel(), device=p.rows.device) - torch.tensor(p.offsets, device=p.rows.device)[p.rows]
    return w[p.rows, j]


def nll_and_backward(model, p: lmhead.Packed, chunk: int) -> float:
    """Token-mean NLL over mask-1 positions; one backward through the backbone (as update does)."""
    wpos = _weights(p)
    h = lmhead.hidden(model, p)  # [n, H]
    leaf = h.detach().requires_grad_(True)
    head = lmhead.head_weight(model)
    total = 0.0
    for c in lmhead.chunks(p.rows.numel(), chunk):
        logits = F.linear(leaf[c], head).float()  # [c, V]: one chunk at a time
        loss = (F.cross_entropy(logits, p.targets[c], reduction="none") * wpos[c]).sum()
        loss.backward()
        total += float(loss.detach())
    if leaf.grad is not None:
        h.backward(leaf.grad)
    return total


@torch.no_grad()
def nll(model, p: lmhead.Packed, chunk: int) -> float:
    wpos = _weights(p)
    h = lmhead.hidden(model, p)
    head = lmhead.head_weight(model)
    return float(sum((F.cross_entropy(F.linear(h[c], head).float(), p.targets[c], reduction="none") * wpos[c]).sum()
                     for c in lmhead.chunks(p.rows.numel(), chunk)))


def pack(sess: Session, batch) -> lmhead.Packed:
    return lmhead.pack([b[0] for b in batch], [b[1] for b in batch], [b[2] for b in batch], pad=0, device=sess.device)


# ---- the stage ----

def _train(sess: Session, model, dig: str, parent: Path | None, start: int, steps: int, seed: int, tmp: Path,
           base_name: str) -> None:
    cfg = sess.cfg
    trs, rejected = traces(sess)
    if not trs:
        raise UserError(f"sft: no verified oracle traces among {rejected} {cfg.env.name} training tasks")
    opt, named = adapters.make_optimizer(cfg.optim, model, parent / "optimizer.safetensors" if parent else None)
    for gr in opt.param_groups:
        gr["lr"] = cfg.sft.lr
    key = f"sft:{sess.prepared['tasks_train']}:{seed}"
    state: dict = {"stage": "sft", "digest": dig, "start": start, "steps": steps, "traces": len(trs),
                   "rejected_traces": rejected, "losses": []}
    torch.manual_seed(seed_of(dig))  # LoRA dropout, if any
    model.train()
    # enable_grad: a caller may hold a no_grad block (SFT trains regardless)
    with phase(sess.device, state) as ph, torch.enable_grad():
        for j in range(start + 1, start + steps + 1):
            p = pack(sess, [trs[i] for i in prompts.batch_indices(len(trs), cfg.sft.batch_size, j, key)])
            opt.zero_grad(set_to_none=True)
            loss = nll_and_backward(model, p, cfg.train.chunk)
            if not np.isfinite(loss):
                raise UserError(f"sft step {j}: loss is {loss}; stopped before publishing")
            torch.nn.utils.clip_grad_norm_([q for _, q in named], cfg.optim.max_grad_norm or float("inf"))
            opt.step()
            state["losses"].append(round(loss, 6))
            ph["tokens"] += int(p.mask.sum())
    model.eval()
    adapters.save_adapter(model, tmp / "adapter", base_name)
    adapters.save_optimizer(opt, named, tmp / "optimizer.safetensors")
    write_json(tmp / "state.json", state)


def cold_start(sess: Session) -> Path:
    """Policy 0 when sft.steps > 0: the fresh LoRA (init, published first by the driver) trained on the traces."""
    dig = sess.chain.cold_start()

    def produce(tmp: Path) -> None:
        student = sess.models.use_adapter("init", sess.chain.init())
        _train(sess, student, dig, None, 0, sess.cfg.sft.steps, sess.cfg.sft.seed, tmp,
               f"opd-store/model/{sess.prepared['student']}")
        sess.models.adapter_changed(dig)

    d, _ = sess.store.ensure("sft", dig, produce)
    return d


def continued(sess: Session, steps: int) -> tuple[str, str]:
    """`steps` more SFT steps from policy 0 (published first by the driver), optimizer state carried on;
    returns (stage, digest)."""
    parent_stage, parent = sess.chain.policy_stage(0), sess.chain.policy(0)
    dig = sess.chain.continued(steps)

    def produce(tmp: Path) -> None:
        student = sess.models.use_adapter(parent_stage, parent)
        _train(sess, student, dig, sess.store.path(parent_stage, parent), sess.cfg.sft.steps, steps, sess.cfg.sft.seed,
               tmp, f"opd-store/model/{sess.prepared['student']}")
        sess.models.adapter_changed(dig)

    sess.store.ensure("sft", dig, produce)
    return "sft", dig


def teacher_adapter(sess: Session) -> Path:
    """A LoRA on the teacher's base trained on the traces (teacher_mode=protocol_sft reads it)."""
    dig = sess.chain.teacher_adapter()

    def produce(tmp: Path) -> None:
        cfg = sess.cfg
        base = models.load(sess.store.path("model", sess.prepared["teacher"]), cfg.teacher, sess.device, sess.dtype)
        kernels = codepaths.lora_kernels(cfg, "teacher", sess.device.type)
        model = lora.add(base, cfg.lora, seed_of(dig), kernels=kernels)
        _train(sess, model, dig, None, 0, cfg.sft.teacher_steps, cfg.sft.teacher_seed, tmp,
               f"opd-store/model/{sess.prepared['teacher']}")
        del model, base

    d, _ = sess.store.ensure("sft", dig, produce)
    return d
