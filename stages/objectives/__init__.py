"""Objective registry. Each objective is a small module exposing

    NEEDS: set[str]           what the update must be fed: "teacher_logprobs" (teacher log-prob of the
                              sampled token), "topk" (teacher top-k ids + log-probs), "full" (teacher
                              logits rows [n, V]), "advantages" (task-reward advantage per position,
                              from the rollout's rewards via `reward_advantages`)
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
from . import bucketed_topk_tail, estimators, exact_full_vocab, forward_kl_topk, nll, pg_k1_rewarded
from .pg_k1_rewarded import reward_advantages

REGISTRY = {
    "forward_kl_topk": forward_kl_topk,
    **{name: estimators for name in estimators.NAMES},  # k1 k2 mse k3 low_var_kl abs
    "pg_k1_rewarded": pg_k1_rewarded,
    "bucketed_topk_tail": bucketed_topk_tail,
    "exact_full_vocab": exact_full_vocab,
    "nll": nll,  # SFT on the sampled tokens: with rollout.sampler=teacher, the off-policy control
}
# objectives that run span-wise across two tokenizers (objective.cross_tokenizer=spans): the sampled-
# token ones, whose log-probabilities add up over a span's tokens (stages/objectives/spans.py), and
# forward_kl_topk, exact at one-token spans and the span's k1 elsewhere
SPAN_WISE = frozenset(estimators.NAMES) | {"pg_k1_rewarded", "forward_kl_topk"}
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# objectives that read `divergence`; elsewhere a non-default value would be silently ignored
_HAS_DIVERGENCE = ("bucketed_topk_tail", "exact_full_vocab")


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
    # cross-tokenizer runs (stages/objectives/spans.py): each position's span within the chunk [n]
    # int64, its offset within that span [n] int64, and log p_T of the chunk's spans [S] float32
    span_ids: Optional[torch.Tensor] = None
    span_offsets: Optional[torch.Tensor] = None
    span_teacher_logprobs: Optional[torch.Tensor] = None


def get(name: str):
    if name not in REGISTRY:
        raise UserError(f"key 'objective.name' = {name!r}; expected one of {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def needs(cfg) -> set[str]:
    return set(get(cfg.name).NEEDS)


def check(cfg, source: str = "config") -> None:
    """Settings shared by all objectives first, then the objective's own combinations."""
    if cfg.name not in REGISTRY:
        raise UserError(f"{source}: key 'objective.name' = {cfg.name!r}; expected one of {', '.join(sorted(REGISTRY))}")
    mod = REGISTRY[cfg.name]
    if cfg.loss_agg_mode not in AGG_MODES:
        raise UserError(f"{source}: key 'objective.loss_agg_mode' = {cfg.loss_agg_mode!r}; "
                        f"expected one of {', '.join(AGG_MODES)}")
    if cfg.loss_max_clamp is not None and not cfg.loss_max_clamp > 0:
        raise UserError(f"{source}: key 'objective.loss_max_clamp' = {cfg.loss_max_clamp}; expected > 0 or null")
    if not cfg.log_prob_min_clamp < 0:
        raise UserError(f"{source}: key 'objective.log_prob_min_clamp' = {cfg.log_prob_min_clamp}; "
                        "expected a log-probability floor < 0 (verl's is log(1e-8) = -18.42)")
    if cfg.name not in _HAS_DIVERGENCE and cfg.divergence != "forward":
        raise UserError(f"{source}: key 'objective.divergence' = {cfg.divergence!r} is not used by objective "
                        f"{cfg.name!r}; only {', '.join(_HAS_DIVERGENCE)} read it")
    mod.check(cfg, source)


def agg_weights(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Per-token weights w [B, T] such that sum(w * loss) is verl's agg_loss(loss, mask, mode).

    mask: [B, T] {0,1} over response positions (T = the padded response length, which is verl's
    horizon for seq-mean-token-sum-norm). Computed once per batch so every chunk is normalised by the
    global counts. Matches agg_loss called without global batch info (dp_size 1): sequences with no
    unmasked token are not counted. One deliberate difference: an all-masked batch gives weights 0
    (loss 0, zero grads) where verl divides 0 by 0.
    """
    m = mask.float()
    if mode == "token-mean":
        return m / m.sum().clamp_min(1.0)
    seq_len = m.sum(-1, keepdim=True)  # [B, 1]
    n_seq = (seq_len > 0).float().sum().clamp_min(1.0)  # non-empty sequences
    if mode == "seq-mean-token-mean":
        return m / (seq_len + 1e-8) / n_seq  # verl's +1e-8, kept for bit-closeness
    if mode == "seq-mean-token-sum":
        return m / n_seq
    if mode == "seq-mean-token-sum-norm":
        return m / n_seq / mask.shape[-1]
    raise UserError(f"key 'objective.loss_agg_mode' = {mode!r}; expected one of {', '.join(AGG_MODES)}")


__all__ = ["REGISTRY", "Chunk", "get", "needs", "check", "agg_weights", "reward_advantages", "AGG_MODES"]
