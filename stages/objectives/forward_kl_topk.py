"""forward_kl_topk (verl v0.8): sum over the teacher's top-k ids of p_T (log p_T - log p_S).

Both log-prob sets are clamped from below (verl clamps at log 1e-8), the per-token loss is
optionally capped (`loss_max_clamp`) and floored at 0 (top-k sets are not normalised, so the sum
can go negative).
"""
from __future__ import annotations

import torch

from ..errors import UserError

NEEDS = {"topk"}


def check(cfg, source: str = "config") -> None:
    if cfg.loss_max_clamp is not None and cfg.loss_max_clamp <= 0:
        raise UserError(f"{source}: key 'objective.loss_max_clamp' = {cfg.loss_max_clamp}; expected > 0 or null")


def per_token(chunk, cfg):
    s_logp = torch.log_softmax(chunk.student_logits, dim=-1)  # [n, V]
    s_top = s_logp.gather(-1, chunk.topk_ids)  # [n, k]
    t_top = chunk.topk_logprobs  # [n, k]
    t_c = t_top.clamp_min(cfg.log_prob_min_clamp)
    s_c = s_top.clamp_min(cfg.log_prob_min_clamp)
    loss = (t_c.exp() * (t_c - s_c)).sum(-1)  # [n]
    if cfg.loss_max_clamp is not None:
        loss = loss.clamp_max(cfg.loss_max_clamp)
    loss = loss.clamp_min(0.0)
    with torch.no_grad():
        diag = {
            "teacher_topk_mass": t_top.exp().sum(-1),
            "student_topk_mass": s_top.exp().sum(-1),
            # overlap: fraction of the teacher's top-k that is also in the student's top-k
            "topk_overlap": _overlap(s_logp, chunk.topk_ids),
        }
    return loss, diag


def _overlap(s_logp: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    k = topk_ids.shape[-1]
    s_ids = s_logp.topk(k, dim=-1).indices  # [n, k]
    return (topk_ids.unsqueeze(-1) == s_ids.unsqueeze(-2)).any(-1).float().mean(-1)
