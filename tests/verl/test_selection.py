"""Position selection: the four modes, their checks, token spans, and the stages' use of it (score
records `selected`, only selected positions reach the LM head, update trains on exactly those)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow.parquet as pq
import pytest

from support import session
from stages.run import selection
from stages.run.config import SelectionCfg
from stages.errors import UserError
from stages.run.store import read_state


def masks(*lens, zero_at=None):
    out = [np.ones(n, dtype=np.int8) for n in lens]
    if zero_at:
        for b, i in zero_at:
            out[b][i] = 0
    return out


def test_all_keeps_every_generated_position_only():
    sel = selection.select(SelectionCfg(), masks(3, 4, zero_at=[(1, 2)]), seed=0)
    assert [s.tolist() for s in sel] == [[1, 1, 1], [1, 1, 0, 1]]


def test_uniform_ratio_per_trajectory_at_least_one_and_seeded():
    cfg = SelectionCfg(mode="uniform_ratio", ratio=0.25)
    m = masks(8, 2, 0, 12)
    a = selection.select(cfg, m, seed=7)
    assert [int(s.sum()) for s in a] == [2, 1, 0, 3]
    assert all(((s == 1) <= (mm == 1)).all() for s, mm in zip(a, m))
    b = selection.select(cfg, m, seed=7)
    assert all((x == y).all() for x, y in zip(a, b))  # same seed (stage digest): same positions
    c = selection.select(cfg, m, seed=8)
    assert any((x != y).any() for x, y in zip(a, c))


def test_uniform_budget_caps_the_batch():
    cfg = SelectionCfg(mode="uniform_budget", budget=5)
    sel = selection.select(cfg, masks(4, 4, 4), seed=1)
    assert sum(int(s.sum()) for s in sel) == 5
    sel = selection.select(cfg, masks(2, 1), seed=1)  # under budget: everything
    assert [s.tolist() for s in sel] == [[1, 1], [1]]


class Chars:
    """A tokenizer whose tokens are single characters (ids are code points)."""

    def decode(self, ids, **kw):
        return "".join(chr(i) for i in ids)


def ids(text):
    return [ord(c) for c in text]


def test_hybrid_keeps_spans_and_samples_the_rest():
    text = "think <final>42</final> ok"
    spans = selection.token_spans(Chars(), ids(text), SelectionCfg().keep_patterns)
    start, end = text.index("<final>"), text.index("</final>") + len("</final>")
    assert spans.tolist() == [1 if start <= i < end else 0 for i in range(len(text))]
    cfg = SelectionCfg(mode="hybrid", ratio=0.5)
    sel = selection.select(cfg, masks(len(text)), seed=3, spans=[spans])[0]
    assert (sel[spans == 1] == 1).all()
    assert int(sel[spans == 0].sum()) == round(0.5 * int((spans == 0).sum()))
    # an unterminated tool call at the end still counts (samplers drop the closing tag)
    t2 = 'x <tool_call>{"name": "c"'
    assert selection.token_spans(Chars(), ids(t2), SelectionCfg().keep_patterns)[t2.index("<"):].all()


@pytest.mark.parametrize("kw,key", [
    (dict(mode="uniform_ratio", ratio=0.0), "selection.ratio"),
    (dict(mode="all", ratio=0.5), "selection.ratio"),
    (dict(mode="uniform_budget"), "selection.budget"),
    (dict(mode="uniform_ratio", ratio=0.5, budget=3), "selection.budget"),
    (dict(mode="hybrid", keep_patterns=["(unclosed"]), "selection.keep_patterns[0]"),
])
def test_bad_selection_settings_name_the_key(kw, key):
    with pytest.raises(UserError, match=key.replace("[", r"\[")):
        selection.check(dataclasses.replace(SelectionCfg(), **kw))


def test_score_records_selection_and_update_trains_on_it(work):
    from stages import rollout, score, train, update
    from stages.engine import batch

    sess = session(work, "selection.mode=uniform_ratio", "selection.ratio=0.5", "train.updates=1")
    train.ensure_policy(sess, 0)
    rollout.run(sess, 1)
    d = score.run(sess, 1)
    t = pq.read_table(d / "scores.parquet")
    sel = t.column("selected").to_pylist()
    tl = t.column("teacher_logprobs").to_pylist()
    for s, lp in zip(sel, tl):
        assert sum(s) == max(1, round(0.5 * len(s)))
        assert all(np.isfinite(x) == bool(k) for x, k in zip(lp, s))  # unselected: never scored (NaN)
    assert pq.read_schema(d / "scores.parquet").metadata[b"opd.selection"] == b"uniform_ratio"
    st = read_state(d)
    assert st["selected_positions"] == sum(map(sum, sel)) and st["response_positions"] == sum(map(len, sel))
    u = update.run(sess, 1)
    assert read_state(u)["loss"] > 0
    # replay: the same digest selects the same positions
    from stages.run.store import seed_of

    ro = sess.table("rollout", sess.chain.rollout(1), "rollout.parquet", batch.ROLLOUT_NEEDS)
    again = score.select_positions(sess, ro, seed_of(st["digest"]))
    assert again.astype(int).tolist() == [x for s in sel for x in s]

def test_update_with_keep_equals_update_with_the_mask_zeroed(work):
    """Selecting positions = training on the batch with the unselected positions masked out."""
    import torch

    from stages import update
    from stages.engine import lmhead

    sess = session(work)
    student = sess.models.student()
    p = lmhead.pack([[1, 5, 7], [1, 9]], [[11, 12, 13, 14], [15, 16, 17]], [[1, 1, 1, 1], [1, 1, 1]], pad=0,
                    device=sess.device)
    n = p.rows.numel()
    g = torch.Generator().manual_seed(0)
    sc = {"teacher_logprobs": -torch.rand(n, generator=g).numpy() * 3,
          "topk_ids": torch.randint(0, 49152, (n, 8), generator=g).numpy(),
          "topk_logprobs": (-torch.rand(n, 8, generator=g) * 5).numpy()}
    old = torch.full((n,), -2.0)
    keep = np.array([1, 0, 1, 1, 0, 1, 1], dtype=bool)

    def grads(**kw):
        student.zero_grad(set_to_none=True)
        stats = update.backward_sums(sess, student, kw.pop("p"), old, dict(sc), **kw).read()
        return stats["loss"], [q.grad.clone() for _, q in sorted(student.named_parameters()) if q.grad is not None]

    loss_a, ga = grads(p=p, keep=keep)
    masked = dataclasses.replace(p, mask=p.mask.clone())
    masked.mask[0, 1] = 0
    masked.mask[1, 0] = 0
    loss_b, gb = grads(p=masked)
    assert abs(loss_a - loss_b) < 1e-5
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(ga, gb))
