"""update(k): one AdamW step of the student's LoRA on rollout(k) + score(k) -> policy version k.

One backbone forward; the LM head and the objective run in position chunks against a detached
leaf of the hidden states, each chunk backpropagates into that leaf, then a single backward runs
through the backbone. Loss weights come from the whole batch (`agg_weights`), so chunking does not
change the value. Writes the PEFT adapter dir, optimizer.safetensors and state.json.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from . import objectives
from .objectives.spans import Spans
from .weights import adapters, models
from .engine import batch, lmhead
from .memory import placement
from .rows import alignment, tables
from .run.config import logit_temperature
from .errors import UserError
from .run.store import fault, write_json
from .session import Session, phase


def load_scores(sess: Session, k: int, topk: int, cross: bool = False) -> dict:
    """The teacher's per-position numbers; a cross-tokenizer run's top-k only (over the student's
    positions, in student ids: score.student_topk)."""
    need = {"uid": None} if cross else {"uid": None, "teacher_logprobs": None, "selected": None}
    if topk:
        need.update(topk_ids=None, topk_logprobs=None)
    t = sess.table("score", sess.chain.score(k), "scores.parquet", need)
    if cross:
        return {"topk_ids": tables.flat(t, "topk_ids", np.int64).reshape(-1, topk),
                "topk_logprobs": tables.flat(t, "topk_logprobs", np.float32).reshape(-1, topk)}
    # the packed positions are the rows' lists end to end: one flat array each (no split and re-join)
    out = {"teacher_logprobs": tables.flat(t, "teacher_logprobs", np.float32),
           "selected": tables.flat(t, "selected", np.int8).astype(bool)}
    if topk:
        out["topk_ids"] = tables.flat(t, "topk_ids", np.int64).reshape(-1, topk)
        out["topk_logprobs"] = tables.flat(t, "topk_logprobs", np.float32).reshape(-1, topk)
    return out


def span_inputs(sess: Session, k: int) -> tuple[np.ndarray, Spans]:
    """A cross-tokenizer run's inputs (stages/align.py): (keep [n] bool over the packed student
    positions: those in exact spans the teacher scored, Spans)."""
    al = sess.table("align", sess.chain.align(k), "spans.parquet", alignment.NEEDS)
    t = sess.table("score", sess.chain.score(k), "scores.parquet", {"uid": None, "span_logprobs": None})
    span_lp = tables.flat(t, "span_logprobs", np.float32)  # [S] over the batch's spans, rows end to end
    n_spans = [len(x) for x in al.column("span_exact").to_pylist()]
    base = np.r_[0, np.cumsum(n_spans)[:-1]].astype(np.int64)  # each row's first span
    ids = np.concatenate([b + np.asarray(s, dtype=np.int64) for b, s in zip(base, al.column("student_span").to_pylist())]
                         or [np.zeros(0, np.int64)])  # [n]
    exact = tables.flat(al, "span_exact", np.int8).astype(bool)  # [S]
    keep = exact[ids] & np.isfinite(span_lp[ids])
    return keep, Spans(ids, span_lp)


@dataclass
class Sums:
    """The update's scalars, still on the device: vals [2 + len(names)] holds the loss, the count of
    loss positions and each diagnostic's sum over them. Read with one transfer."""
    vals: torch.Tensor
    names: list[str]

    def read(self, vals: list[float] | None = None) -> dict:
        """{"loss": ..., diagnostic: its mean}; vals: self.vals already on the host (a list)."""
        vals = self.vals.tolist() if vals is None else vals
        return {"loss": vals[0], **{k: v / vals[1] for k, v in zip(self.names, vals[2:])}}


def backward_sums(sess: Session, student, p: lmhead.Packed, sample_lp: torch.Tensor, sc: dict,
                  advantages: torch.Tensor | None = None, keep: np.ndarray | None = None,
                  chunk: int | None = None, spans: Spans | None = None) -> Sums:
    """Chunked objective with one backward through the backbone. Returns its scalar sums, unread.
    chunk: positions per LM-head/loss chunk (default train.chunk; smaller after a CUDA OOM).

    keep: [n] bool over the packed positions (score's `selected`): only those reach the LM head and
    count in the loss; the aggregation treats them as the response mask. spans: a cross-tokenizer
    run's aligned spans over the packed positions (chunks then end where spans end)."""
    cfg, dev = sess.cfg, sess.device
    ob = objectives.get(cfg.objective.name)
    # host inputs go to the device without blocking (a blocking copy waits for the device, and
    # after the backbone forward is queued it would stall the host until that forward finishes)
    # offset j of each packed position within its row's response
    j = torch.arange(p.rows.numel(), device=dev) - torch.tensor(p.offsets).to(dev, non_blocking=True)[p.rows]
    mask = p.mask  # [B, R]
    if keep is not None and not keep.all():
        kt = torch.as_tensor(keep).to(dev, non_blocking=True)
        mask = p.mask.clone()
        mask[p.rows[~kt], j[~kt]] = 0
        p, j, sample_lp = batch.subset(p, kt), j[kt], sample_lp[kt]
        sc = {name: v[keep] for name, v in sc.items()}
        advantages = advantages[kt] if advantages is not None else None
        spans = spans.subset(keep) if spans is not None else None
    # teacher arrays move to the device once, before the forward is queued
    sc = {name: torch.as_tensor(v).to(dev, non_blocking=True) for name, v in sc.items() if v is not None}
    w = objectives.agg_weights(mask, cfg.objective.loss_agg_mode)  # [B, R]
    wpos = w[p.rows, j]  # [n]: weight of each position (row b, offset j within its response)
    h = lmhead.hidden(student, p)  # [n, H], graph through the backbone (LoRA)
    leaf = h.detach().requires_grad_(True)
    head = lmhead.head_weight(student)
    T = logit_temperature(cfg.rollout)  # 0 (greedy rollouts): untempered
    h_t = head_t = None
    if "full" in ob.NEEDS:  # a full teacher row per token is too big to store: recompute it here, chunked
        with torch.no_grad():
            h_t, head_t = lmhead.hidden(sess.models.teacher(), p), lmhead.head_weight(sess.models.teacher())  # [n, H]
    # sums stay on the device (one transfer at the end)
    loss_sum = torch.zeros((), device=dev)
    diag_sums: dict[str, torch.Tensor] = {}
    size = chunk or cfg.train.chunk
    for c in (spans.chunks(size) if spans is not None else lmhead.chunks(p.rows.numel(), size)):
        logits = F.linear(leaf[c], head).float()  # [c, V]: the only vocab-sized tensor, one chunk
        if T != 1.0:  # x / 1.0 == x (and its gradient g / 1.0 == g) exactly: at T = 1 two [c, V] passes saved
            logits = logits / T
        ch = objectives.Chunk(
            student_logits=logits, sampled_ids=p.targets[c], old_logprobs=sample_lp[c],
            teacher_logprobs=sc["teacher_logprobs"][c] if "teacher_logprobs" in sc else None,
            topk_ids=sc["topk_ids"][c] if "topk_ids" in sc else None,
            topk_logprobs=sc["topk_logprobs"][c] if "topk_logprobs" in sc else None,
            advantages=advantages[c] if advantages is not None else None,
            teacher_logits=None if h_t is None else F.linear(h_t[c], head_t).float() / T)
        if spans is not None:
            ch.span_ids, ch.span_offsets, ch.span_teacher_logprobs = spans.chunk_tensors(c, dev)
        per_tok, diag = ob.per_token(ch, cfg.objective)  # [c]
        loss = (per_tok * wpos[c]).sum()
        if loss.requires_grad:
            loss.backward()
        loss_sum += loss.detach()
        m = mask[p.rows[c], j[c]]
        for name, v in diag.items():
            diag_sums[name] = diag_sums.get(name, 0.0) + (v.detach().float() * m).sum()
        del logits, ch, per_tok, loss
    if leaf.grad is not None:
        h.backward(leaf.grad)  # the single backward through the backbone
    names = list(diag_sums)
    # every scalar in one float32 tensor: one transfer when read (divided on the host)
    return Sums(torch.stack([loss_sum, mask.sum().clamp_min(1).float(), *(diag_sums[k] for k in names)]), names)


def guarded_step(opt, sums: Sums, grad_norm: torch.Tensor, k: int) -> tuple[dict, float]:
    """The optimizer step, never taken on a non-finite loss or gradient norm, and the update's
    diagnostics and norm, read in one transfer. A fused AdamW (CUDA's) is queued before anything is
    read, the device skipping the step where `found_inf` says so: the host launches it while the
    backward still runs instead of waiting for it. Other optimizers step once the values are read."""
    fused = bool(opt.defaults.get("fused"))
    if fused:
        opt.found_inf = (~torch.isfinite(sums.vals[0] + grad_norm)).float()  # [] 1.0: skip the step
        opt.step()
    vals = torch.cat([sums.vals, grad_norm.reshape(1).to(sums.vals.dtype)]).tolist()
    stats, gn = sums.read(vals[:-1]), vals[-1]
    if not np.isfinite(stats["loss"]):
        raise UserError(f"update step {k}: loss is {stats['loss']}; stopped before publishing policy {k}")
    if not np.isfinite(gn):
        raise UserError(f"update step {k}: gradient norm is {gn}; stopped before publishing")
    if not fused:
        opt.step()
    return stats, gn


def trajectory_advantages(ro, cfg, k: int) -> torch.Tensor:
    """[B] task-reward advantage of each trajectory (objective.advantage over prompt groups)."""
    rewards = ro.column("reward").to_pylist() if "reward" in ro.column_names else [None] * ro.num_rows
    missing = sum(r is None for r in rewards)
    if missing:
        raise UserError(f"update step {k}: objective '{cfg.objective.name}' needs task rewards, but {missing} of "
                        f"{len(rewards)} trajectories have none (their prompt rows lack reward_model.ground_truth; "
                        "use data.generator=arith or a Parquet with ground truths)")
    groups = ro.column("prompt_index").to_pylist()
    return objectives.reward_advantages(torch.tensor(rewards, dtype=torch.float32), groups, cfg.objective.advantage)


def run(sess: Session, k: int) -> Path:
    dig = sess.chain.update(k)

    def produce(tmp: Path) -> None:
        t_in = time.perf_counter()
        cfg = sess.cfg
        prev = sess.policy_dir(k - 1)  # init, the SFT cold start, or update k-1
        ro = sess.table("rollout", sess.chain.rollout(k), "rollout.parquet", batch.ROLLOUT_NEEDS)
        needs = objectives.needs(cfg.objective)
        spans = None
        if cfg.objective.cross_tokenizer != "off":  # the teacher's numbers are per aligned span
            keep, spans = span_inputs(sess, k)
            sc = load_scores(sess, k, cfg.objective.topk, cross=True) if "topk" in needs else {}
        else:
            sc = load_scores(sess, k, cfg.objective.topk if "topk" in needs else 0)
            keep = sc.pop("selected")
        student = sess.models.use_policy(k - 1)
        p = batch.packed(ro, sess.device)
        sample_lp = torch.as_tensor(tables.flat(ro, "sample_logprobs", np.float32), device=sess.device)
        adv = None
        if "advantages" in needs:  # task-reward advantage per trajectory, spread over its positions
            traj = trajectory_advantages(ro, cfg, k)  # [B]
            adv = traj.to(sess.device)[p.rows]  # [n]
        # after an SFT cold start the distillation starts its own Adam moments (the SFT loss's are not its)
        live = sess.models.optimizer
        if live and live[0] == sess.chain.policy(k - 1):  # resident AdamW already holds policy k-1's state
            opt, named = live[1], live[2]
        else:  # after an SFT cold start the distillation starts its own Adam moments (the SFT loss's are not its)
            sess.store.wait(prev)  # (read from its published file)
            opt, named = adapters.make_optimizer(cfg.optim, student,
                                                 None if prev.parent.name == "sft" else prev / "optimizer.safetensors")
        lr = cfg.optim.lr * min(1.0, k / cfg.optim.warmup_updates) if cfg.optim.warmup_updates else cfg.optim.lr
        for gr in opt.param_groups:
            gr["lr"] = lr
        state: dict = {"stage": "update", "step": k, "digest": dig, "lr": lr}
        if spans is not None:  # the share of the student's tokens whose loss compares exact spans
            state["exact_token_share"] = round(float(keep.mean()) if keep.size else 0.0, 6)
        io = state["io_s"] = {"inputs": round(time.perf_counter() - t_in, 4)}  # outside the timed phase
        models.set_training(student, True)

        def attempt(chunk: int):  # run again with a halved chunk after a CUDA OOM (placement.chunk_retry)
            opt.zero_grad(set_to_none=True)  # a failed attempt's partial gradients are discarded
            torch.manual_seed(int(dig[:8], 16))  # LoRA dropout, if any, draws from the stage's own seed
            return backward_sums(sess, student, p, sample_lp, sc, adv, keep, chunk=chunk, spans=spans)

        with phase(sess.device, state, tokens=int(p.mask.sum())):
            sums = placement.chunk_retry(sess, "update", k, state, attempt)
            gn = torch.nn.utils.clip_grad_norm_([q for _, q in named], cfg.optim.max_grad_norm or float("inf"))
            stats, gn = guarded_step(opt, sums, gn, k)
        # the files' values, snapshotted in order with the step that made them: the publish thread
        # writes them while the next step runs (whose optimizer step changes the live tensors)
        adapter_now = adapters.host_copy(adapters.adapter_state(student))
        moments_now = adapters.host_copy(adapters.optimizer_state(opt, named))
        models.set_training(student, False)
        # the previous update's files were snapshotted at its step: its publish (on the worker thread)
        # overlapped this step's compute, and is joined here so that at most one is in flight
        t_w = time.perf_counter()
        sess.store.wait(prev)
        io["wait_previous_publish"] = round(time.perf_counter() - t_w, 4)
        t_r = time.perf_counter()
        if sess.models.adapter_changed(dig):  # the resident student now holds policy k; CUDA: engine refreshed in place
            io["engine_refresh"] = round(time.perf_counter() - t_r, 4)  # (CPU drops it; the next rollout builds it)
        sess.models.optimizer = (dig, opt, named)  # ...and the resident AdamW its moments (no reload next step)
        state.update({k2: round(v, 6) for k2, v in stats.items()}, grad_norm=round(gn, 6))
        state["kl"] = state["loss"] if cfg.objective.name == "forward_kl_topk" else None

        def rest(tmp: Path) -> None:  # the writes: on the publish thread under background publishing
            t_s = time.perf_counter()
            adapters.write_adapter(student, adapter_now(), tmp / "adapter", f"opd-store/model/{sess.prepared['student']}")
            io["save_adapter"] = round(time.perf_counter() - t_s, 4)
            fault("update.mid", tmp)  # half-written: adapter saved, optimizer not yet
            t_s = time.perf_counter()
            adapters.save_tensors(tmp / "optimizer.safetensors", moments_now())
            io["save_optimizer"] = round(time.perf_counter() - t_s, 4)
            write_json(tmp / "state.json", state)

        return rest

    # On CUDA the update's files (adapter + AdamW moments, snapshotted right after the optimizer step)
    # are written, sealed and renamed on a worker thread while the next step runs; the resident
    # student already holds policy k, and the next update joins this publish after its own compute.
    # Not on CPU: a kill between steps (train.between_steps) would lose the update still publishing
    # there and recompute it; the train loop would first have to join it at that point.
    d, _ = sess.store.ensure("update", dig, produce, background=sess.background_publish)
    return d


def init(sess: Session) -> Path:
    """Policy version 0: the freshly initialised LoRA (B = 0, so it equals the base) and no optimizer state."""
    dig = sess.chain.init()

    def produce(tmp: Path) -> None:
        student = sess.models.student()
        adapters.save_adapter(student, tmp / "adapter", f"opd-store/model/{sess.prepared['student']}")
        adapters.save_tensors(tmp / "optimizer.safetensors", {})
        n_train = sum(q.numel() for _, q in models.trainable(student))
        write_json(tmp / "state.json", {"stage": "init", "digest": dig, "trainable_params": n_train})
        sess.models.adapter_changed(dig)

    d, _ = sess.store.ensure("init", dig, produce)
    return d

