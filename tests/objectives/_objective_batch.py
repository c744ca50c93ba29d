"""A tiny random batch in the update stage's layout, shared by the objective tests."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from stages.run.config import ObjectiveCfg
from stages.objectives import Chunk

# every registered objective with settings that make it valid
CONFIGS = {
    "forward_kl_topk": dict(),
    "forward_kl_topk+pg": dict(name="forward_kl_topk", use_policy_gradient=True),
    "k1": dict(use_policy_gradient=True),
    "k2": dict(), "mse": dict(), "k3": dict(), "low_var_kl": dict(), "abs": dict(),
    "k3+pg": dict(name="k3", use_policy_gradient=True),
    "pg_k1_rewarded": dict(use_policy_gradient=True, reward_coef=0.7, distill_coef=1.3),
    "bucketed_topk_tail": dict(),
    "bucketed_topk_tail+reverse": dict(name="bucketed_topk_tail", divergence="reverse"),
    "bucketed_topk_tail+jsd": dict(name="bucketed_topk_tail", divergence="jsd", jsd_beta=0.3),
    "exact_full_vocab": dict(),
    "exact_full_vocab+jsd": dict(name="exact_full_vocab", divergence="jsd"),
}


def cfg_for(key: str, **over) -> ObjectiveCfg:
    kw = {"name": key.split("+")[0], "topk": 3, **CONFIGS[key], **over}
    return ObjectiveCfg(**kw)


@dataclass
class Batch:
    mask: torch.Tensor  # [B, T] {0,1}
    logits: torch.Tensor  # [B, T, V] student logits (values; tests make their own leaf)
    sampled: torch.Tensor  # [B, T]
    old_lp: torch.Tensor  # [B, T]
    teacher_lp: torch.Tensor  # [B, T]
    topk_ids: torch.Tensor  # [B, T, k]
    topk_lp: torch.Tensor  # [B, T, k]
    adv: torch.Tensor  # [B, T]
    teacher_logits: torch.Tensor  # [B, T, V]

    def chunk(self, leaf: torch.Tensor, pos: torch.Tensor) -> Chunk:
        """Chunk over positions pos [n, 2] = (row, col) pairs, logits taken from `leaf` [B, T, V]."""
        b, t = pos[:, 0], pos[:, 1]
        return Chunk(student_logits=leaf[b, t], sampled_ids=self.sampled[b, t], old_logprobs=self.old_lp[b, t],
                     teacher_logprobs=self.teacher_lp[b, t], topk_ids=self.topk_ids[b, t],
                     topk_logprobs=self.topk_lp[b, t], advantages=self.adv[b, t],
                     teacher_logits=self.teacher_logits[b, t])


def make_batch(seed=0, B=3, T=5, V=11, k=3, mask=None) -> Batch:
    g = torch.Generator().manual_seed(seed)
    if mask is None:
        mask = (torch.rand(B, T, generator=g) > 0.3).long()
        mask[1] = 0  # a sequence with no response token (tool output only)
    logits = torch.randn(B, T, V, generator=g) * 2
    sampled = torch.randint(0, V, (B, T), generator=g)
    own = torch.log_softmax(logits, -1).gather(-1, sampled.unsqueeze(-1)).squeeze(-1)
    old_lp = own + 0.4 * torch.randn(B, T, generator=g)  # ratios spread over and beyond the clip band
    t_logits = torch.randn(B, T, V, generator=g) * 2
    t_logp = torch.log_softmax(t_logits, -1)
    top = t_logp.topk(k, dim=-1)
    return Batch(mask=mask, logits=logits, sampled=sampled, old_lp=old_lp,
                 teacher_lp=t_logp.gather(-1, sampled.unsqueeze(-1)).squeeze(-1), topk_ids=top.indices,
                 topk_lp=top.values, adv=torch.randn(B, T, generator=g), teacher_logits=t_logits)
