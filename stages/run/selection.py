"""Position selection: which response positions reach the LM head and the loss.

    all             every generated position (response_mask 1)
    uniform_ratio   per trajectory, a uniform sample of `ratio` of its positions (at least one)
    uniform_budget  per update batch, a uniform sample of at most `budget` positions
    hybrid          every position inside a kept span (tool calls, final answers: `keep_patterns`),
                    plus a uniform sample of `ratio` of the other positions

score(k) draws the selection from a generator seeded by its own digest (so a replay selects the same
positions), runs the teacher's LM head only on the selected positions and records the 0/1 mask in
scores.parquet (`selected`); update(k) reads that mask back, so both stages always agree. Only
positions with response_mask 1 can be selected: tool output and padding are never trained on.
"""
from __future__ import annotations

import re

import numpy as np

from ..errors import UserError

MODES = ("all", "uniform_ratio", "uniform_budget", "hybrid")


def check(cfg, source: str = "config") -> None:
    """Refuse settings that would be silently ignored or select nothing."""
    if cfg.mode not in MODES:
        raise UserError(f"{source}: key 'selection.mode' = {cfg.mode!r}; expected one of {', '.join(MODES)}")
    if not 0 < cfg.ratio <= 1:
        raise UserError(f"{source}: key 'selection.ratio' = {cfg.ratio}; expected 0 < ratio <= 1")
    if cfg.ratio != 1 and cfg.mode not in ("uniform_ratio", "hybrid"):
        raise UserError(f"{source}: key 'selection.ratio' = {cfg.ratio} is not used by selection.mode "
                        f"{cfg.mode!r}; only uniform_ratio and hybrid read it")
    if cfg.budget < 0:
        raise UserError(f"{source}: key 'selection.budget' = {cfg.budget}; expected >= 0")
    if cfg.mode == "uniform_budget" and cfg.budget < 1:
        raise UserError(f"{source}: key 'selection.budget' = {cfg.budget}; selection.mode uniform_budget needs "
                        "a positive number of positions per update batch")
    if cfg.budget and cfg.mode != "uniform_budget":
        raise UserError(f"{source}: key 'selection.budget' = {cfg.budget} is not used by selection.mode "
                        f"{cfg.mode!r}; only uniform_budget reads it")
    for i, pat in enumerate(cfg.keep_patterns):
        try:
            re.compile(pat)
        except re.error as e:
            raise UserError(f"{source}: key 'selection.keep_patterns[{i}]' = {pat!r} is not a valid regex ({e})") \
                from None


def token_spans(tok, response_ids, patterns: list[str]) -> np.ndarray:
    """[len] int8: 1 where a response token overlaps a match of any pattern in the decoded response.

    Token i covers the characters its decode adds to the decoded prefix (prefix decoding keeps merges
    and byte-level pieces right, which per-token decoding does not)."""
    ids = [int(x) for x in response_ids]
    out = np.zeros(len(ids), dtype=np.int8)
    if not ids or not patterns:
        return out
    text = tok.decode(ids)
    matches = [(m.start(), m.end()) for pat in patterns for m in re.finditer(pat, text, re.DOTALL)
               if m.end() > m.start()]
    if not matches:
        return out
    ends = [len(tok.decode(ids[:i + 1])) for i in range(len(ids))]
    start = 0
    for i, end in enumerate(ends):
        if any(s < max(end, start + 1) and e > start for s, e in matches):
            out[i] = 1
        start = max(start, end)
    return out


def select(cfg, masks: list[np.ndarray], seed: int, spans: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """Per trajectory, a [len] int8 array: 1 = the position reaches the LM head and the loss.

    masks: response_mask per trajectory; spans: `token_spans` per trajectory (hybrid only)."""
    valid = [np.asarray(m) == 1 for m in masks]
    if cfg.mode == "all":
        return [v.astype(np.int8) for v in valid]
    rng = np.random.default_rng(seed)
    out = [np.zeros(len(v), dtype=np.int8) for v in valid]
    if cfg.mode == "uniform_budget":
        flat = [(b, i) for b, v in enumerate(valid) for i in np.flatnonzero(v)]
        keep = range(len(flat)) if len(flat) <= cfg.budget else rng.choice(len(flat), cfg.budget, replace=False)
        for j in keep:
            b, i = flat[j]
            out[b][i] = 1
        return out
    for b, v in enumerate(valid):
        span = (np.asarray(spans[b]) == 1) & v if cfg.mode == "hybrid" and spans is not None \
            else np.zeros(len(v), dtype=bool)
        rest = np.flatnonzero(v & ~span)
        k = int(round(cfg.ratio * len(rest)))
        if k == 0 and len(rest) and not span.any():
            k = 1  # every trajectory with a generated token contributes at least one position
        out[b][span] = 1
        if k:
            out[b][np.sort(rng.choice(rest, k, replace=False))] = 1
    return out
