"""exact_full_vocab: the divergence over the whole vocabulary from the teacher's logits row
(`chunk.teacher_logits` [n, V]); default forward KL(teacher || student), also reverse / jsd
(`divergence`, `jsd_beta`; jsd is TRL's generalised JSD). No log-prob floor: this is the exact
reference the top-k objectives approximate. Guarded: a chunk of n positions holds n x V fp32
elements per side, so n * V above `full_vocab_limit` is refused before anything is allocated.
"""
from __future__ import annotations

import torch

from ..errors import UserError
from ._common import check_divergence, clamp_loss, divergence

NEEDS = {"full"}


def check(cfg, source: str = "config") -> None:
    if cfg.use_policy_gradient:
        raise UserError(f"{source}: key 'objective.use_policy_gradient' = true with objective 'exact_full_vocab'; "
                        "expected false (a supervised distribution loss; use forward_kl_topk or k1..k3 for PG)")
    check_divergence(cfg, source)


def guard(n: int, vocab: int, cfg) -> None:
    """Refuse a chunk of n positions over a vocabulary of `vocab` ids if it exceeds the limit."""
    if n * vocab > cfg.full_vocab_limit:
        fit = cfg.full_vocab_limit // vocab
        hint = (f"at most {fit} positions per chunk fit (set train.chunk <= {fit}, or raise the limit)" if fit
                else f"not even one position fits (raise the limit to >= {vocab})")
        raise UserError(f"key 'objective.full_vocab_limit' = {cfg.full_vocab_limit}: a chunk of {n} positions x "
                        f"vocab {vocab} = {n * vocab} elements exceeds it; {hint}")


def per_token(chunk, cfg):
    n, vocab = chunk.student_logits.shape
    guard(n, vocab, cfg)
    s_logp = torch.log_softmax(chunk.student_logits, dim=-1)  # [n, V]
    t_logp = torch.log_softmax(chunk.teacher_logits.float(), dim=-1)  # [n, V]
    loss = clamp_loss(divergence(t_logp, s_logp, cfg.divergence, cfg.jsd_beta), cfg)  # [n]
    with torch.no_grad():
        diag = {
            "teacher_entropy": -(t_logp.exp() * t_logp.nan_to_num(neginf=0.0)).sum(-1),
            "top1_agree": (t_logp.argmax(-1) == s_logp.argmax(-1)).float(),
        }
    return loss, diag
