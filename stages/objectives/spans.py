"""Sampled-token objectives across two tokenizers (objective.cross_tokenizer=spans; stages/align.py,
docs/architecture.md "Cross-tokenizer distillation").

On an aligned span both models score the same bytes, so with each side's log-probs summed over its
own tokens, d = log p_S(span) - log p_T(span) is exact. Every student position of a span compares
its span's d: a policy gradient pushes each token of the span by the span's reward (the gradient of
log p_S(span) is the sum of its tokens'), and a directly backpropagated estimate counts each span
once (a share 1/len(span) per position). With one tokenizer every span is one token on each side,
and these are the same-tokenizer objectives.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Spans:
    """A batch's spans over its packed student positions (rows end to end, the positions the loss keeps)."""
    ids: np.ndarray  # [n] int64, each position's span (global over the batch, non-decreasing)
    teacher_logprobs: np.ndarray  # [S] float32, log p_T of every span of the batch (indexed by ids)

    def subset(self, keep: np.ndarray) -> "Spans":
        return Spans(self.ids[keep], self.teacher_logprobs)

    def chunks(self, size: int) -> list[slice]:
        """Position chunks of about `size` that end where a span ends, so that each span's sum is
        taken inside one chunk (a span longer than `size` is one chunk of its own)."""
        n, ids, out, start = len(self.ids), self.ids, [], 0
        starts = np.flatnonzero(np.diff(ids) != 0) + 1  # positions where a span begins
        while start < n:
            stop = min(start + size, n)
            if stop < n and ids[stop] == ids[stop - 1]:  # inside a span: back to its start, else past its end
                before = starts[(starts > start) & (starts <= stop)]
                stop = int(before[-1]) if before.size else int(starts[starts > stop][0]) if (starts > stop).any() else n
            out.append(slice(start, stop))
            start = stop
        return out

    def chunk_tensors(self, c: slice, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(span index within the chunk [c], each position's offset within its span [c], the chunk's
        spans' teacher log-probs [S_c]) on `device`."""
        ids = self.ids[c]
        local = ids - ids[0]  # [c]
        first = np.r_[0, np.flatnonzero(np.diff(local) != 0) + 1]  # chunk position where each present span begins
        offset = np.arange(len(local)) - np.repeat(first, np.diff(np.r_[first, len(local)]))  # [c]
        t = self.teacher_logprobs[ids[0]:ids[-1] + 1]  # [S_c]
        dev = lambda a: torch.as_tensor(a).to(device, non_blocking=True)  # noqa: E731
        return dev(local.astype(np.int64)), dev(offset.astype(np.int64)), dev(t.astype(np.float32))


def span_sum(logp: torch.Tensor, ids: torch.Tensor, offset: torch.Tensor, n_spans: int) -> torch.Tensor:
    """Sum of logp [n] over each span -> [S]. Written into a [S, longest] grid and summed along it: a
    fixed order of additions on every device (index_add's atomics on CUDA have none, and replay must
    give the same bytes), and a one-token span is its token's value exactly."""
    grid = logp.new_zeros(n_spans, int(offset.max()) + 1 if offset.numel() else 1)
    return grid.index_put((ids, offset), logp).sum(-1)


def compared(logp: torch.Tensor, chunk) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(student log-prob, teacher log-prob, share) that each position's estimate compares [n]: its own
    sampled token's with one tokenizer (share None), or its span's, with share 1 / len(span)."""
    if getattr(chunk, "span_ids", None) is None:
        return logp, chunk.teacher_logprobs.float(), None
    ids, n_spans = chunk.span_ids, chunk.span_teacher_logprobs.numel()
    s = span_sum(logp, ids, chunk.span_offsets, n_spans)  # [S]
    count = torch.bincount(ids, minlength=n_spans).to(logp.dtype)  # [S] (integer counts: exact on any device)
    return s[ids], chunk.span_teacher_logprobs.float()[ids], 1.0 / count[ids]
