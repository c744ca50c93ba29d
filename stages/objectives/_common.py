"""Per-position math the objectives share: sampled-token log-prob, verl's loss clamp, verl's vanilla
PPO policy loss, and divergences between two log-distributions.

Everything here is a pure function of one position (no reduction over positions), so the update can
apply it to any chunk of positions and aggregate with `agg_weights` afterwards.
"""
from __future__ import annotations

import math

import torch

from ..errors import UserError

# verl's compute_policy_loss_vanilla reads `config.get("clip_ratio_c", 3.0)`; the distillation loss
# config has no such field, so verl's distillation PG always uses the dual-clip bound 3.0.
CLIP_RATIO_C = 3.0
# verl clamps log(pi/pi_old) to [-20, 20] before exponentiating (overflow guard).
LOG_RATIO_BOUND = 20.0


def sampled_logprob(chunk) -> torch.Tensor:
    """log pi_student(sampled token) [n], differentiable through chunk.student_logits [n, V]."""
    logp = torch.log_softmax(chunk.student_logits, dim=-1)  # [n, V]
    return logp.gather(-1, chunk.sampled_ids.unsqueeze(-1)).squeeze(-1)  # [n]


def clamp_loss(loss: torch.Tensor, cfg) -> torch.Tensor:
    """verl: `clamp(min=-c, max=c)` with c = loss_max_clamp (the min side exists for k1, which can be < 0)."""
    if cfg.loss_max_clamp is None:
        return loss
    return loss.clamp(min=-cfg.loss_max_clamp, max=cfg.loss_max_clamp)


def clip_bounds(cfg) -> tuple[float, float]:
    low = cfg.clip_ratio_low if cfg.clip_ratio_low is not None else cfg.clip_ratio
    high = cfg.clip_ratio_high if cfg.clip_ratio_high is not None else cfg.clip_ratio
    return low, high


def ppo_per_token(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, cfg):
    """verl `compute_policy_loss_vanilla` before aggregation: dual-clip PPO, per position.

    logp, old_logp, adv: [n]. Returns (loss [n], diag). Written op for op like verl's so that ties in
    max/min route gradients the same way.
    """
    low, high = clip_bounds(cfg)
    log_ratio = (logp - old_logp).clamp(min=-LOG_RATIO_BOUND, max=LOG_RATIO_BOUND)  # [n]
    ratio = torch.exp(log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1 - low, 1 + high)
    clipped1 = torch.maximum(loss1, loss2)
    loss3 = -adv * CLIP_RATIO_C  # dual clip: bounds the loss when adv < 0 and ratio explodes
    clipped2 = torch.minimum(loss3, clipped1)
    loss = torch.where(adv < 0, clipped2, clipped1)
    with torch.no_grad():
        diag = {"ratio": ratio.detach(), "pg_clipped": (loss2 > loss1).float()}
    return loss, diag


def check_pg(cfg, source: str) -> None:
    """Refuse clip settings that make the PPO trust region empty or inverted."""
    if not cfg.clip_ratio > 0:
        raise UserError(f"{source}: key 'objective.clip_ratio' = {cfg.clip_ratio}; expected > 0")
    low, high = clip_bounds(cfg)
    if not 0 <= low < 1:
        raise UserError(f"{source}: key 'objective.clip_ratio_low' = {low}; expected 0 <= value < 1 "
                        "(the ratio is clipped to [1 - low, 1 + high])")
    if not high >= 0:
        raise UserError(f"{source}: key 'objective.clip_ratio_high' = {high}; expected >= 0")


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends (Maechler 2012): expm1 near 0, log1p far out."""
    x = x.clamp_max(-1e-30)  # a top-k mass that rounds to >= 1 leaves an (almost) empty tail, not NaN
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last dim [.., K] -> [..]. Entries with p = 0 contribute exactly 0 with a
    finite gradient even where log p or log q is -inf (torch's kl_div(log_target=True) gives NaN)."""
    p = log_p.exp()
    live = p > 0
    zero = torch.zeros((), dtype=log_p.dtype, device=log_p.device)
    term = p * (torch.where(live, log_p, zero) - torch.where(live, log_q, zero))
    return torch.where(live, term, zero).sum(-1)


def divergence(t_logp: torch.Tensor, s_logp: torch.Tensor, kind: str, beta: float) -> torch.Tensor:
    """Divergence between teacher and student log-distributions [n, K] -> [n].

    forward = KL(T || S) (mode-covering), reverse = KL(S || T) (mode-seeking), jsd = TRL's generalised
    JSD: beta * KL(T || M) + (1 - beta) * KL(S || M), M = beta * T + (1 - beta) * S.
    """
    if kind == "forward":
        return _kl(t_logp, s_logp)
    if kind == "reverse":
        return _kl(s_logp, t_logp)
    if kind == "jsd":
        m = torch.logsumexp(torch.stack([t_logp + math.log(beta), s_logp + math.log1p(-beta)]), dim=0)
        return beta * _kl(t_logp, m) + (1 - beta) * _kl(s_logp, m)
    raise UserError(f"key 'objective.divergence' = {kind!r}; expected one of forward, reverse, jsd")


def check_divergence(cfg, source: str) -> None:
    if cfg.divergence == "jsd" and not 0 < cfg.jsd_beta < 1:
        raise UserError(f"{source}: key 'objective.jsd_beta' = {cfg.jsd_beta}; expected 0 < value < 1 for "
                        "divergence=jsd (use divergence=forward or reverse for the end points)")
