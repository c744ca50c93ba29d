"""Teacher-forced forwards shared by score, update and evaluate.

Only the positions that predict response tokens reach the LM head, in position chunks, so no
[tokens, vocab] fp32 tensor exists beyond one chunk ([chunk, vocab]).
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from . import decoder, graphs
from ..weights import models
from ..weights.state import state


@dataclass
class Packed:
    ids: torch.Tensor  # [B, T] prompt+response, right-padded
    attn: torch.Tensor  # [B, T] 1 on real tokens
    rows: torch.Tensor  # [n] batch row of each response position (all response tokens, mask 0 included)
    cols: torch.Tensor  # [n] sequence position whose hidden state predicts that response token
    targets: torch.Tensor  # [n] the response token
    mask: torch.Tensor  # [B, R] response_mask padded to the longest response (0 beyond length)
    offsets: list[int]  # start of each row's response positions within the n positions


def pack(prompts: list[list[int]], responses: list[list[int]], masks: list[list[int]], pad: int,
         device) -> Packed:
    # numpy over the concatenated tokens (no Python loop per token); the same tensors as row by row
    pr = [np.asarray(x, dtype=np.int64).reshape(-1) for x in prompts]
    rs = [np.asarray(x, dtype=np.int64).reshape(-1) for x in responses]
    ms = [np.asarray(x, dtype=np.float32).reshape(-1) for x in masks]
    B = len(pr)
    lp = np.array([len(x) for x in pr], dtype=np.int64)  # [B]
    lr = np.array([len(x) for x in rs], dtype=np.int64)  # [B]
    lm = np.array([len(x) for x in ms], dtype=np.int64)  # [B]
    T = int((lp + lr).max())
    R = max(1, int(lr.max()))
    ids = np.full((B, T), pad, dtype=np.int64)
    attn = np.zeros((B, T), dtype=np.int64)
    mask = np.zeros((B, R), dtype=np.float32)
    ls = lp + lr
    tok_row = np.repeat(np.arange(B), ls)  # [sum ls] row of each prompt+response token
    tok_col = np.arange(int(ls.sum())) - np.repeat(np.cumsum(ls) - ls, ls)  # its position in the row
    ids[tok_row, tok_col] = np.concatenate([x for pair in zip(pr, rs) for x in pair] or [np.zeros(0, np.int64)])
    attn[tok_row, tok_col] = 1
    m_row = np.repeat(np.arange(B), lm)
    mask[m_row, np.arange(int(lm.sum())) - np.repeat(np.cumsum(lm) - lm, lm)] = (
        np.concatenate(ms) if ms else np.zeros(0, np.float32))
    starts = np.cumsum(lr) - lr  # [B] first response position of each row among the n
    rows = np.repeat(np.arange(B), lr)  # [n]
    j = np.arange(int(lr.sum())) - np.repeat(starts, lr)  # [n] offset within the row's response
    cols = np.repeat(lp - 1, lr) + j  # the position before each response token predicts it
    targets = np.concatenate(rs) if rs else np.zeros(0, np.int64)
    t = lambda x: torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64)).to(device)  # noqa: E731
    return Packed(t(ids), t(attn), t(rows), t(cols), t(targets), torch.from_numpy(mask).to(device),
                  [int(x) for x in starts])


def to_host(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Device -> host with one synchronisation for all of them: each is copied into pinned memory
    without blocking, then the stream is waited for once (a blocking `.cpu()` waits per tensor).
    CPU tensors come back as they are (as `.cpu()` returns them)."""
    dev = [t for t in tensors if t.device.type != "cpu"]
    if not dev:
        return tensors
    out = tuple(t if t.device.type == "cpu" else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                for t in tensors)
    for o, t in zip(out, tensors):
        if o is not t:
            o.copy_(t, non_blocking=True)
    torch.cuda.current_stream(dev[0].device).synchronize()
    return out


def hidden(model, p: Packed) -> torch.Tensor:
    """Backbone hidden states at the response-predicting positions: [n, H].

    On CUDA the forward runs in the padded layout of `graphs` (its bytes are part of the CUDA
    digests), replayed from a captured graph where the session allows it (graphs.hidden).
    Layers compiled for training (models.compile_layers) run eager in eval mode (another grad mode
    would compile again). A compilation that fails (no working Triton) falls back to the eager
    layers for the rest of the process, with one warning."""
    decoder.base_ready(model)  # memory.merge_in_place: the rollout's merge undone before the weights are read
    base, st = models.base_of(model), state(model)
    compiled = st.compiled
    eager = compiled == "training" and not getattr(model, "training", False)

    def forward():
        if p.ids.device.type == "cuda" and graphs.layout_ok(base):
            return graphs.hidden(base, base.model, p.ids, p.attn, st.use_graphs, st.forward_length)
        return base.model(input_ids=p.ids, attention_mask=p.attn, use_cache=False).last_hidden_state

    with torch.compiler.set_stance("force_eager") if eager else contextlib.nullcontext():
        try:
            out = forward()
        except torch._dynamo.exc.TorchDynamoException as e:
            if not compiled or eager:
                raise
            print(f"warning: runtime.compile_layers: compiling the decoder layers failed ({type(e).__name__}: "
                  f"{str(e).splitlines()[0][:160]}); running them eager (runtime.compile_layers=false skips "
                  "the attempt)", file=sys.stderr)
            models.uncompile_layers(model)
            out = forward()
    return out[p.rows, p.cols]


def head_weight(model) -> torch.Tensor:
    return models.base_of(model).lm_head.weight


def chunks(n: int, size: int):
    for s in range(0, n, size):
        yield slice(s, min(n, s + size))


@torch.no_grad()
def score_positions(h: torch.Tensor, head: torch.Tensor, targets: torch.Tensor, chunk: int, topk: int,
                    temperature: float = 1.0, want_topk: bool = True):
    """Per position: log-prob of the target, top-k ids/log-probs, entropy. h [n, H] -> [n], [n,k], [n,k], [n]."""
    n = h.shape[0]
    lp = torch.empty(n, device=h.device)
    ent = torch.empty(n, device=h.device)
    k = topk if want_topk else 0
    ids = torch.empty(n, k, dtype=torch.long, device=h.device)
    tlp = torch.empty(n, k, device=h.device)
    for c in chunks(n, chunk):
        logits = F.linear(h[c], head).float()  # [c, V]
        if temperature != 1.0:  # x / 1.0 == x exactly: at T = 1 a pass over [c, V] is skipped, not a bit changes
            logits = logits / temperature
        logp = torch.log_softmax(logits, dim=-1)  # [c, V]
        del logits
        lp[c] = logp.gather(-1, targets[c, None]).squeeze(-1)
        if k:
            v, i = logp.topk(k, dim=-1)
            ids[c], tlp[c] = i, v
        p = logp.exp()  # [c, V]; p * log p in place: the same products and sum as -(exp(logp) * logp).sum
        ent[c] = -p.mul_(logp).sum(-1)
        del logp, p
    return lp, ids, tlp, ent


@torch.no_grad()
def kl_positions(h_t: torch.Tensor, head_t: torch.Tensor, h_s: torch.Tensor, head_s: torch.Tensor, chunk: int):
    """Exact per-position KL(teacher || student) over the full vocabulary and top-1 agreement, chunked.

    h_t/h_s [n, H] -> kl [n], agree [n] (1.0 where both argmaxes coincide)."""
    n = h_t.shape[0]
    kl = torch.empty(n, device=h_t.device)
    agree = torch.empty(n, device=h_t.device)
    for c in chunks(n, chunk):
        lt = torch.log_softmax(F.linear(h_t[c], head_t).float(), -1)  # [c, V]
        ls = torch.log_softmax(F.linear(h_s[c], head_s).float(), -1)
        kl[c] = (lt.exp() * (lt - ls)).sum(-1)
        agree[c] = (lt.argmax(-1) == ls.argmax(-1)).float()
    return kl, agree
