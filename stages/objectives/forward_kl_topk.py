"""forward_kl_topk (verl v0.8): sum over the teacher's top-k ids of p_T (log p_T - log p_S).

verl 0.8.0 (`trainer/distillation/fsdp/losses.py`) sums over the teacher's top-k ids only (the
student's top-k is used for the overlap diagnostic, not the loss); so do we. Both log-prob sets are
clamped from below (`log_prob_min_clamp`); the top-k sets are not normalised, so the sum can go
negative and is floored at 0, then verl's `clamp(-c, c)` with c = `loss_max_clamp` applies.
With `use_policy_gradient` (verl allows it, with a warning) the detached loss becomes the advantage
-loss of a PPO loss on the sampled token, as verl does.

Across two tokenizers (objective.cross_tokenizer=spans, objectives/spans.py) the top-k term is exact
only where a span is one token on each side: the same text precedes it, and the teacher's candidates
whose bytes are single student tokens carry over as student ids (score.student_topk; id -1 where
none does). Every other position takes its span's sampled-token term instead: the span's log-ratio
as a policy-gradient reward (k1). `topk_exact` records which positions had the exact term.
"""
from __future__ import annotations

import torch

from ._common import check_pg, clamp_loss, ppo_per_token
from .spans import compared

NEEDS = {"topk"}


def check(cfg, source: str = "config") -> None:
    if cfg.use_policy_gradient:
        check_pg(cfg, source)


def per_token(chunk, cfg):
    if getattr(chunk, "span_ids", None) is not None:
        return _across_tokenizers(chunk, cfg)
    s_logp = torch.log_softmax(chunk.student_logits, dim=-1)  # [n, V]
    s_top = s_logp.gather(-1, chunk.topk_ids)  # [n, k]
    t_top = chunk.topk_logprobs.float()  # [n, k]
    t_c = t_top.clamp_min(cfg.log_prob_min_clamp)
    s_c = s_top.clamp_min(cfg.log_prob_min_clamp)
    kl = (t_c.exp() * (t_c - s_c)).sum(-1).clamp_min(0.0)  # [n]
    kl = clamp_loss(kl, cfg)
    with torch.no_grad():
        diag = {
            "teacher_topk_mass": t_top.exp().sum(-1),
            "student_topk_mass": s_top.exp().sum(-1),
            # fraction of the teacher's top-k ids that are also among the student's top-k
            "topk_overlap": _overlap(s_logp, chunk.topk_ids),
            "distill_loss": kl.detach(),
        }
    if not cfg.use_policy_gradient:
        return kl, diag
    logp = s_logp.gather(-1, chunk.sampled_ids.unsqueeze(-1)).squeeze(-1)  # [n]
    loss, pg_diag = ppo_per_token(logp, chunk.old_logprobs, -kl.detach(), cfg)
    return loss, {**diag, **pg_diag}


def _overlap(s_logp: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    k = topk_ids.shape[-1]
    s_ids = s_logp.topk(k, dim=-1).indices  # [n, k]
    return (topk_ids.unsqueeze(-1) == s_ids.unsqueeze(-2)).any(-1).float().mean(-1)



def _across_tokenizers(chunk, cfg):
    """The exact top-k term at one-token spans with carried-over candidates, the span's k1 policy
    gradient elsewhere (module docstring)."""
    s_logp = torch.log_softmax(chunk.student_logits, dim=-1)  # [n, V]
    live = chunk.topk_ids >= 0  # [n, k] candidates with a student id
    exact = live.any(-1)  # [n]
    s_top = s_logp.gather(-1, chunk.topk_ids.clamp_min(0))  # [n, k]
    t_c = torch.where(live, chunk.topk_logprobs.float(), 0.0).clamp_min(cfg.log_prob_min_clamp)
    s_c = s_top.clamp_min(cfg.log_prob_min_clamp)
    kl = clamp_loss(torch.where(live, t_c.exp() * (t_c - s_c), 0.0).sum(-1).clamp_min(0.0), cfg)  # [n]
    logp = s_logp.gather(-1, chunk.sampled_ids.unsqueeze(-1)).squeeze(-1)  # [n]
    s_lp, t_lp, share = compared(logp, chunk)  # [n]: each position's span
    k1 = clamp_loss(s_lp - t_lp, cfg)  # [n]
    span_loss, pg_diag = ppo_per_token(logp, chunk.old_logprobs, -k1.detach(), cfg)
    if cfg.use_policy_gradient:
        top_loss, _ = ppo_per_token(logp, chunk.old_logprobs, -kl.detach(), cfg)
    else:
        top_loss = kl
    loss = torch.where(exact, top_loss, span_loss)
    diag = {"distill_loss": torch.where(exact, kl, k1 * share).detach(), "topk_exact": exact.float(),
            "kl_estimate": (k1 * share).detach(), **pg_diag}
    return loss, diag
