"""Span-wise sampled-token objectives (stages/objectives/spans.py, objective.cross_tokenizer=spans):
with one tokenizer (every span one token) they are the same-tokenizer objectives; on longer spans the
policy gradient is the span's reward on every token of the span, and a supervised estimate counts
each span once; chunks end where spans end."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from stages import objectives
from stages.objectives.spans import Spans, compared, span_sum
from stages.run.config import ObjectiveCfg

PG = ObjectiveCfg(name="k1", use_policy_gradient=True)
CASES = [PG, ObjectiveCfg(name="k3"), ObjectiveCfg(name="k2", use_policy_gradient=True),
         ObjectiveCfg(name="pg_k1_rewarded", use_policy_gradient=True, reward_coef=0.5)]


def batch(n=13, V=17, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, V, generator=g)
    ids = torch.randint(0, V, (n,), generator=g)
    old = torch.log_softmax(logits, -1).gather(-1, ids[:, None])[:, 0] + 0.01 * torch.randn(n, generator=g)
    return logits, ids, old, -torch.rand(n, generator=g) * 3, torch.randn(n, generator=g)


def run(cfg, logits, ids, old, t_lp, adv, spans=None):
    leaf = logits.clone().requires_grad_(True)
    ch = objectives.Chunk(student_logits=leaf, sampled_ids=ids, old_logprobs=old, advantages=adv,
                          teacher_logprobs=None if spans else t_lp)
    if spans:
        ch.span_ids, ch.span_offsets, ch.span_teacher_logprobs = spans
    loss, diag = objectives.get(cfg.name).per_token(ch, cfg)
    loss.sum().backward()
    return loss.detach(), diag["kl_estimate"], leaf.grad


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: f"{c.name}-pg{int(c.use_policy_gradient)}")
def test_one_token_spans_are_the_same_tokenizer_objective(cfg):
    logits, ids, old, t_lp, adv = batch()
    n = len(ids)
    same = run(cfg, logits, ids, old, t_lp, adv)
    spans = run(cfg, logits, ids, old, t_lp, adv, (torch.arange(n), torch.zeros(n, dtype=torch.long), t_lp))
    for a, b in zip(same, spans):  # a one-token span's sum is its token's value: not a bit differs
        assert torch.equal(a, b)


def test_span_sum_is_each_span_s_sum_in_a_fixed_order():
    x = torch.randn(9, dtype=torch.float64)
    ids = torch.tensor([0, 0, 0, 1, 2, 2, 3, 3, 3])
    off = torch.tensor([0, 1, 2, 0, 0, 1, 0, 1, 2])
    got = span_sum(x, ids, off, 4)
    want = torch.stack([x[0:3].sum(), x[3], x[4:6].sum(), x[6:9].sum()])
    assert torch.allclose(got, want, rtol=0, atol=1e-15)


def test_policy_gradient_pushes_every_token_of_a_span_by_the_span_s_reward():
    """On policy (ratio 1, inside the clip band) the loss gradient of a position is -A_span times the
    gradient of its token's log-prob: A_span = -(log p_S(span) - log p_T(span))."""
    logits, ids, _, _, _ = batch(n=6)
    logp = torch.log_softmax(logits.double(), -1).gather(-1, ids[:, None])[:, 0]
    old = logp.float()
    sid, off = torch.tensor([0, 0, 1, 2, 2, 2]), torch.tensor([0, 1, 0, 0, 1, 2])
    t_span = torch.tensor([-1.0, -2.0, -0.5])
    _, kl, grad = run(PG, logits, ids, old, None, None, (sid, off, t_span))
    s_span = torch.stack([logp[0:2].sum(), logp[2], logp[3:6].sum()])
    adv = -(s_span - t_span.double())  # [3]
    leaf = logits.double().clone().requires_grad_(True)
    lp = torch.log_softmax(leaf, -1).gather(-1, ids[:, None])[:, 0]
    (-(adv[sid] * lp).sum()).backward()
    assert torch.allclose(grad.double(), leaf.grad, rtol=1e-5, atol=1e-6)
    # the estimate is counted once per span: its sum over positions is the spans' sum
    assert torch.allclose(kl.sum().double(), (s_span - t_span.double()).sum(), rtol=1e-5)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7, 100])
def test_chunks_end_where_spans_end_and_cover_every_position(size):
    ids = np.array([0, 0, 0, 1, 2, 2, 3, 4, 4, 4, 4, 4, 5])
    sp = Spans(ids, np.zeros(6, dtype=np.float32))
    cs = sp.chunks(size)
    assert cs[0].start == 0 and cs[-1].stop == len(ids)
    assert all(a.stop == b.start for a, b in zip(cs, cs[1:]))
    for c in cs:
        assert c.stop == len(ids) or ids[c.stop] != ids[c.stop - 1]  # never inside a span
        assert c.stop - c.start <= size or len(set(ids[c])) == 1  # longer only for one long span
    local, off, t = sp.chunk_tensors(slice(3, 12), "cpu")
    assert local.tolist() == [0, 1, 1, 2, 3, 3, 3, 3, 3] and off.tolist() == [0, 0, 1, 0, 0, 1, 2, 3, 4]
    assert t.numel() == 4


def test_compared_with_one_tokenizer_is_the_token_itself():
    logits, ids, old, t_lp, _ = batch()
    ch = objectives.Chunk(student_logits=logits, sampled_ids=ids, old_logprobs=old, teacher_logprobs=t_lp)
    s, t, share = compared(old, ch)
    assert s is old and torch.equal(t, t_lp) and share is None


def _topk_chunk(logits, ids, old, topk_ids, topk_lp, spans=None):
    leaf = logits.clone().requires_grad_(True)
    ch = objectives.Chunk(student_logits=leaf, sampled_ids=ids, old_logprobs=old, topk_ids=topk_ids,
                          topk_logprobs=topk_lp)
    if spans:
        ch.span_ids, ch.span_offsets, ch.span_teacher_logprobs = spans
    return leaf, ch


@pytest.mark.parametrize("pg", [False, True])
def test_forward_kl_topk_at_one_token_spans_is_the_same_tokenizer_objective(pg):
    """Every span one token, every candidate carried over: the exact term everywhere, bit for bit."""
    cfg = ObjectiveCfg(name="forward_kl_topk", use_policy_gradient=pg)
    logits, ids, old, t_lp, _ = batch()
    n, k = len(ids), 4
    topk_ids = torch.randint(0, logits.shape[1], (n, k), generator=torch.Generator().manual_seed(3))
    topk_lp = torch.log_softmax(torch.randn(n, k), -1) - 0.5
    out = []
    for spans in (None, (torch.arange(n), torch.zeros(n, dtype=torch.long), t_lp)):
        leaf, ch = _topk_chunk(logits, ids, old, topk_ids, topk_lp, spans)
        loss, diag = objectives.get(cfg.name).per_token(ch, cfg)
        loss.sum().backward()
        out.append((loss.detach(), leaf.grad))
        if spans:
            assert diag["topk_exact"].eq(1).all()
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


def test_forward_kl_topk_without_carried_candidates_takes_the_span_term():
    """Candidates with no student id (-1) drop out of the sum; a position with none left takes its
    span's k1 policy gradient, as the k1 objective computes it."""
    cfg = ObjectiveCfg(name="forward_kl_topk")
    logits, ids, old, t_lp, _ = batch(n=6)
    sid, off = torch.tensor([0, 0, 1, 2, 2, 2]), torch.tensor([0, 1, 0, 0, 1, 2])
    t_span = torch.tensor([-1.0, -2.0, -0.5])
    topk_ids = torch.full((6, 3), -1)
    topk_ids[2] = torch.tensor([5, -1, 7])  # the one-token span: two candidates carried over
    topk_lp = torch.full((6, 3), float("nan"))
    topk_lp[2] = torch.tensor([-0.5, -1.0, -2.0])
    _, ch = _topk_chunk(logits, ids, old, topk_ids, topk_lp, (sid, off, t_span))
    loss, diag = objectives.get(cfg.name).per_token(ch, cfg)
    assert diag["topk_exact"].tolist() == [0, 0, 1, 0, 0, 0]
    s_lp = torch.log_softmax(logits, -1)
    want2 = sum(torch.exp(torch.tensor(t)) * (t - s_lp[2, i]) for i, t in ((5, -0.5), (7, -2.0)))
    assert torch.allclose(loss[2], want2.clamp_min(0), rtol=1e-6)
    k1_loss, _, _ = run(PG, logits, ids, old, None, None, (sid, off, t_span))
    keep = torch.tensor([True, True, False, True, True, True])
    assert torch.allclose(loss.detach()[keep], k1_loss[keep], rtol=1e-6)
