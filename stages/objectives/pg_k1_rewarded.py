"""pg_k1_rewarded: task reward plus the k1 distillation reward, both as PPO policy losses.

verl 0.8 with `use_task_rewards` and `use_policy_gradient` (loss_mode k1) computes
    ppo(A_task) + distillation_loss_coef * ppo(-clamp(k1))
as two separate vanilla PPO losses on the sampled token, summed; we compute
    reward_coef * ppo(A_task) + distill_coef * ppo(-clamp(k1))
(reward_coef = 1 is verl's). Inside the clip band the PPO loss is linear in the advantage, so this is
the same as one PPO loss on the summed advantage reward_coef * A_task - distill_coef * k1; they
differ only on clipped positions, where verl clips each part by its own sign.

A_task [n] arrives in `chunk.advantages`, computed upstream per trajectory by `reward_advantages`.
"""
from __future__ import annotations

import torch

from ..errors import UserError
from ._common import check_pg, clamp_loss, ppo_per_token, sampled_logprob
from .spans import compared

# "advantages": the update must fill chunk.advantages from the rollout's rewards (reward_advantages)
NEEDS = {"teacher_logprobs", "advantages"}
MODES = ("raw", "group_centered", "group_standardized", "leave_one_out")
EPS = 1e-6  # verl's GRPO epsilon in (r - mean) / (std + eps)


def check(cfg, source: str = "config") -> None:
    if not cfg.use_policy_gradient:
        raise UserError(f"{source}: key 'objective.use_policy_gradient' = false with objective 'pg_k1_rewarded'; "
                        "expected true (k1 is only usable as a policy-gradient reward)")
    check_pg(cfg, source)
    for key in ("reward_coef", "distill_coef"):
        if not getattr(cfg, key) >= 0:
            raise UserError(f"{source}: key 'objective.{key}' = {getattr(cfg, key)}; expected >= 0")
    if cfg.advantage not in MODES:
        raise UserError(f"{source}: key 'objective.advantage' = {cfg.advantage!r}; expected one of {', '.join(MODES)}")


def per_token(chunk, cfg):
    if chunk.advantages is None:
        raise ValueError("pg_k1_rewarded needs chunk.advantages (task-reward advantage per position)")
    logp = sampled_logprob(chunk)  # [n]
    s_lp, t_lp, share = compared(logp, chunk)  # [n]: the position's own token, or its span (cross-tokenizer)
    k1 = clamp_loss(s_lp - t_lp, cfg)  # [n]
    distill, pg_diag = ppo_per_token(logp, chunk.old_logprobs, -k1.detach(), cfg)
    task, _ = ppo_per_token(logp, chunk.old_logprobs, chunk.advantages.float(), cfg)
    loss = cfg.reward_coef * task + cfg.distill_coef * distill
    kl = k1.detach() if share is None else k1.detach() * share  # a span's estimate counted once
    diag = {"kl_estimate": kl, "task_advantage": chunk.advantages.detach().float(), **pg_diag}
    return loss, diag


def reward_advantages(rewards: torch.Tensor, group_ids, mode: str) -> torch.Tensor:
    """Per-trajectory task advantage from scalar rewards [N] and prompt group ids [N] -> [N] float32.

    Matches verl 0.8's outcome estimators: group_centered = GRPO without std (Dr.GRPO),
    group_standardized = GRPO ((r - mean) / (std + 1e-6), unbiased std), leave_one_out = RLOO
    (r - mean of the others). A group of one has no baseline: verl leaves its reward as is
    (mean 0, std 1), and so do we, so rollout.n = 1 degrades to raw rewards, not to zero.
    """
    r = torch.as_tensor(rewards, dtype=torch.float32)  # [N]
    if mode == "raw":
        return r.clone()
    if mode not in MODES:
        raise UserError(f"key 'objective.advantage' = {mode!r}; expected one of {', '.join(MODES)}")
    _, g = torch.unique(torch.as_tensor(group_ids), return_inverse=True)  # [N] dense group index
    n_groups = int(g.max()) + 1 if g.numel() else 0
    count = torch.zeros(n_groups).index_add_(0, g, torch.ones_like(r))[g]  # [N] group size
    mean = torch.zeros(n_groups).index_add_(0, g, r)[g] / count  # [N]
    single = count < 2
    if mode == "group_centered":
        return torch.where(single, r, r - mean)
    if mode == "leave_one_out":
        return torch.where(single, r, (r - mean) * count / (count - 1).clamp_min(1))
    sq = torch.zeros(n_groups).index_add_(0, g, (r - mean).square())[g]  # [N] sum of squared deviations
    std = (sq / (count - 1).clamp_min(1)).sqrt()
    return torch.where(single, r / (1 + EPS), (r - mean) / (std + EPS))
