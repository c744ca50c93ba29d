"""Single-sample reverse-KL estimators (verl `core_algos.kl_penalty`), registered as k1, k2/mse,
k3/low_var_kl and abs. With d = log pi_S(a) - log pi_T(a) for the sampled token a:

    k1 = d            k2 = mse = d^2 / 2            abs = |d|
    k3 = low_var_kl = clamp(e^-d' + d' - 1, -10, 10), d' = clamp(d, -20, 20)

then verl's `clamp(-c, c)` with c = `loss_max_clamp`. Without `use_policy_gradient` the estimate is
backpropagated directly (supervised); with it, the detached estimate becomes the advantage -estimate
(the reward for moving toward the teacher) of verl's vanilla PPO loss. k1 without policy gradient is
refused, as verl refuses it: its gradient E[grad log pi_S] is zero and ignores the teacher.
"""
from __future__ import annotations

import torch

from ..errors import UserError
from ._common import check_pg, clamp_loss, ppo_per_token, sampled_logprob
from .spans import compared

NEEDS = {"teacher_logprobs"}
NAMES = ("k1", "k2", "mse", "k3", "low_var_kl", "abs")


def estimate(logp: torch.Tensor, teacher_logp: torch.Tensor, name: str) -> torch.Tensor:
    """verl `kl_penalty_forward` for one estimator; logp, teacher_logp: [n] -> [n]."""
    d = logp - teacher_logp
    if name == "k1":
        return d
    if name == "abs":
        return d.abs()
    if name in ("k2", "mse"):
        return 0.5 * d.square()
    if name in ("k3", "low_var_kl"):
        kl = (-d).clamp(min=-20, max=20)  # log(pi_T / pi_S), clamped before exp for stability
        return (kl.exp() - kl - 1).clamp(min=-10, max=10)
    raise UserError(f"key 'objective.name' = {name!r}; expected one of {', '.join(NAMES)}")


def check(cfg, source: str = "config") -> None:
    if cfg.name == "k1" and not cfg.use_policy_gradient:
        raise UserError(f"{source}: key 'objective.use_policy_gradient' = false with objective 'k1'; expected "
                        "true (the gradient of k1 itself does not depend on the teacher, so verl refuses it)")
    if cfg.use_policy_gradient:
        check_pg(cfg, source)


def per_token(chunk, cfg):
    logp = sampled_logprob(chunk)  # [n]
    s_lp, t_lp, share = compared(logp, chunk)  # [n]: the position's own token, or its span (cross-tokenizer)
    est = clamp_loss(estimate(s_lp, t_lp, cfg.name), cfg)  # [n]
    counted = est if share is None else est * share  # a span's estimate counted once over its positions
    diag = {"kl_estimate": counted.detach()}
    if not cfg.use_policy_gradient:
        return counted, diag
    loss, pg_diag = ppo_per_token(logp, chunk.old_logprobs, -est.detach(), cfg)
    return loss, {**diag, **pg_diag}
