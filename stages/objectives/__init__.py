"""Objective registry. Each objective is a small module exposing

    NEEDS: set[str]           what score(k) must record: {"teacher_logprobs", "topk", "full"}
    check(cfg, source)        refuse invalid settings (raise UserError naming the key)
    per_token(chunk, cfg)     -> (loss [n] float32, diagnostics {name: [n] tensor})

The update stage feeds one position chunk at a time (`Chunk`, all tensors over the n selected
response positions of the chunk) and aggregates globally with `agg_weights`, so a chunked loss
equals the unchunked one and no [tokens, vocab] tensor is kept beyond one chunk.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import UserError
from . import forward_kl_topk

REGISTRY = {
    "forward_kl_topk": forward_kl_topk,
}


@dataclass
class Chunk:
    student_logits: torch.Tensor  # [n, V] float32, grad flows into the student
    sampled_ids: torch.Tensor  # [n] int64, the token the rollout sampled at each position
    old_logprobs: torch.Tensor  # [n] float32, behaviour-policy (rollout) log-prob of the sampled token
    teacher_logprobs: Optional[torch.Tensor] = None  # [n] float32
    topk_ids: Optional[torch.Tensor] = None  # [n, k] int64, teacher's top-k token ids
    topk_logprobs: Optional[torch.Tensor] = None  # [n, k] float32
    advantages: Optional[torch.Tensor] = None  # [n] float32, task-reward advantage (pg_k1_rewarded)
    teacher_logits: Optional[torch.Tensor] = None  # [n, V] float32 (exact_full_vocab only)


def get(name: str):
    if name not in REGISTRY:
        raise UserError(f"key 'objective.name' = {name!r}; expected one of {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def needs(cfg) -> set[str]:
    return set(get(cfg.name).NEEDS)


def check(cfg, source: str = "config") -> None:
    get(cfg.name).check(cfg, source)


def agg_weights(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Per-token weights w [B, T] such that sum(w * loss) is verl's agg_loss(loss, mask, mode).

    mask: [B, T] {0,1}. Computed once per batch so every chunk is normalised by the global count.
    """
    m = mask.float()
    if mode == "token-mean":
        return m / m.sum().clamp_min(1.0)
    seq_len = m.sum(-1, keepdim=True)  # [B, 1]
    n_seq = (seq_len > 0).float().sum().clamp_min(1.0)
    if mode == "seq-mean-token-mean":
        return m / seq_len.clamp_min(1.0) / n_seq
    if mode == "seq-mean-token-sum":
        return m / n_seq
    if mode == "seq-mean-token-sum-norm":
        return m / mask.shape[-1]
    raise UserError(f"key 'objective.loss_agg_mode' = {mode!r}; unsupported")
