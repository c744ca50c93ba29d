"""bucketed_topk_tail: the teacher's top-k ids plus one tail bucket holding the remaining mass, so
teacher and student are both proper distributions over k + 1 buckets and the divergence is >= 0.

Teacher tail: log(1 - sum_k p_T) = log1mexp(logsumexp(top-k log-probs)) (only top-k is recorded).
Student tail: logsumexp of the student's log-probs over the ids outside the teacher's top-k, read
from the full student row: exact even when the student's top-k mass rounds to 1 in fp32, where
1 - sum would cancel. All k + 1 log-probs are floored at `log_prob_min_clamp` as verl floors top-k
log-probs. Divergence: `divergence` forward / reverse / jsd (`jsd_beta`); then `loss_max_clamp`.
"""
from __future__ import annotations

import torch

from ..errors import UserError
from ._common import check_divergence, clamp_loss, divergence, log1mexp

NEEDS = {"topk"}


def check(cfg, source: str = "config") -> None:
    if cfg.use_policy_gradient:
        raise UserError(f"{source}: key 'objective.use_policy_gradient' = true with objective 'bucketed_topk_tail'; "
                        "expected false (a supervised distribution loss; use forward_kl_topk or k1..k3 for PG)")
    check_divergence(cfg, source)


def per_token(chunk, cfg):
    s_logits = chunk.student_logits  # [n, V]
    s_norm = torch.logsumexp(s_logits, dim=-1, keepdim=True)  # [n, 1]
    s_top = s_logits.gather(-1, chunk.topk_ids) - s_norm  # [n, k]
    # finfo.min, not -inf: a finite fill keeps logsumexp's backward NaN-free even when k = V
    outside = s_logits.scatter(-1, chunk.topk_ids, torch.finfo(s_logits.dtype).min)  # [n, V]
    s_tail = torch.logsumexp(outside, dim=-1, keepdim=True) - s_norm  # [n, 1]
    t_top = chunk.topk_logprobs.float()  # [n, k]
    t_tail = log1mexp(torch.logsumexp(t_top, dim=-1, keepdim=True))  # [n, 1]
    floor = cfg.log_prob_min_clamp
    s_b = torch.cat([s_top, s_tail], dim=-1).clamp_min(floor)  # [n, k+1]
    t_b = torch.cat([t_top, t_tail], dim=-1).clamp_min(floor)  # [n, k+1]
    loss = clamp_loss(divergence(t_b, s_b, cfg.divergence, cfg.jsd_beta), cfg)  # [n]
    with torch.no_grad():
        diag = {
            "teacher_topk_mass": t_top.exp().sum(-1),
            "student_topk_mass": s_top.exp().sum(-1),
            "teacher_tail_mass": t_tail.squeeze(-1).exp(),
            "student_tail_mass": s_tail.squeeze(-1).exp(),
        }
    return loss, diag
