"""nll: the negative log-likelihood of the sampled token, -log p_S(a), backpropagated directly.

With rollout.sampler=teacher the sampled tokens are the teacher's, and this is SFT on teacher samples
(sequence-level knowledge distillation): the off-policy control of an OPD run, with its optimizer, LoRA
and update count (docs/architecture.md, "Off-policy control"). It reads none of the teacher's scores
(NEEDS is empty; score still runs the teacher's forward and records its log-probs). On the student's
own samples its expected gradient is zero (E[grad log p_S] = 0): a valid setting, but no control.
`loss_max_clamp` caps the per-token loss as for every objective; there is no log-prob floor.
"""
from __future__ import annotations

import torch

from ..errors import UserError
from ._common import clamp_loss, sampled_logprob

NEEDS: set[str] = set()


def check(cfg, source: str = "config") -> None:
    if cfg.use_policy_gradient:
        raise UserError(f"{source}: key 'objective.use_policy_gradient' = true with objective 'nll'; expected false "
                        "(supervised: the sampled tokens' log-likelihood is backpropagated directly, no reward)")


def per_token(chunk, cfg):
    loss = clamp_loss(-sampled_logprob(chunk), cfg)  # [n]
    with torch.no_grad():
        diag = {"nll": loss.detach()}
    return loss, diag
