"""The update's loss (stages/update.py backward_sums) on a real tiny student, with single positions
masked inside a response (response_mask 0 between generated tokens, as tool output is):

* the loss and d loss / dh (h: the backbone's hidden state at each response position) equal the
  exact values taken by hand over the unmasked positions only, for every loss_agg_mode, within the
  fp32 error bound derived from the arithmetic (tests/numerics.py), not a tuned tolerance;
* whatever the student's logits or the teacher's records at a masked position, the loss and every
  gradient are the same bits.

Both with the score's selection passed as `keep`, as update.run passes it (masked positions never
reach the LM head), and without it (they do, with weight 0)."""
from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.func import grad_and_value

import numerics
from engine_models import tiny
from stages import objectives, update
from stages.run import config, selection
from stages.engine import lmhead
from stages.weights import lora
from stages.run.config import LoraCfg, SelectionCfg

PROMPTS = [[1, 50, 60, 7], [1, 42], [1, 9, 10]]
RESP = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17, 18, 19, 20, 21]]
MASKS = [[1, 1, 0, 1, 1, 1], [1, 0, 1], [1, 1, 1, 0, 1, 1, 0, 1]]  # single positions masked inside
V, K = 64, 4  # a small vocabulary keeps the log-softmax's bound (a V-term sum) tight
KEEP = np.concatenate(selection.select(SelectionCfg(), [np.array(m) for m in MASKS], 0)).astype(bool)
MODES = objectives.AGG_MODES


@pytest.fixture(scope="module")
def batch():
    student = lora.add(tiny(vocab_size=V), LoraCfg(r=4, alpha=8), seed=3)
    with torch.no_grad():  # B != 0: the LoRA gradients then depend on dloss/dh in every direction
        for n, q in student.named_parameters():
            if "lora_B" in n:
                q.normal_(0, 0.05)
    teacher = tiny("tiny-llama-teacher", seed=1, vocab_size=V)
    p = lmhead.pack(PROMPTS, RESP, MASKS, 2, "cpu")
    with torch.no_grad():
        lp, ids, tlp, _ = lmhead.score_positions(lmhead.hidden(teacher, p), lmhead.head_weight(teacher),
                                                 p.targets, 5, K)
    sc = {"teacher_logprobs": lp.numpy(), "topk_ids": ids.numpy(), "topk_logprobs": tlp.numpy()}
    return student, p, torch.full((p.targets.numel(),), -2.0), sc


def session(mode: str):
    # what backward_sums reads of a Session: its config and device; chunk 4 splits the positions
    return SimpleNamespace(cfg=config.compose([f"objective.topk={K}", f"objective.loss_agg_mode={mode}",
                                               "train.chunk=4"]), device=torch.device("cpu"))


@contextmanager
def hidden_seen(bump: float = 0.0, where: str = "masked"):
    """Record h and the gradient the loss sends back into it; add `bump` times a fixed direction to
    h (so to the logits) at the masked (or, as a control, the first unmasked) positions."""
    seen, real = {}, lmhead.hidden
    offset = torch.tensor([len(x) - 1 for x in PROMPTS])

    def hidden(model, pk):
        h = real(model, pk)
        seen["h"] = h.detach().clone()
        masked = pk.mask[pk.rows, pk.cols - offset[pk.rows]] == 0
        rows = masked if where == "masked" else torch.arange(len(masked)) == int((~masked).nonzero()[0])
        direction = torch.linspace(-1, 1, h.shape[1])
        h = h + bump * rows[:, None] * direction  # (+0 elsewhere: the same bits)
        if h.requires_grad:
            h.register_hook(lambda g: seen.__setitem__("g", g.clone()))
        return h

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lmhead, "hidden", hidden)
        yield seen


def run(mode, batch, keep, sc=None, **bump):
    student, p, old, sc0 = batch
    student.zero_grad(set_to_none=True)
    with hidden_seen(**bump) as seen:
        stats = update.backward_sums(session(mode), student, p, old, dict(sc or sc0),
                                     keep=KEEP if keep else None).read()
    grads = {n: q.grad.clone() for n, q in student.named_parameters() if q.grad is not None}
    return stats, grads, seen


def hand_weights(mode: str) -> torch.Tensor:
    """Each response position's weight in the loss, from the unmasked positions alone: verl's agg_loss
    written out per mode (masked positions 0, a sequence with none unmasked not counted)."""
    m = [np.array(x, dtype=np.float64) for x in MASKS]
    n_seq, R, N = sum(x.sum() > 0 for x in m), max(map(len, RESP)), sum(x.sum() for x in m)
    per_row = {"token-mean": lambda nb: 1 / N, "seq-mean-token-mean": lambda nb: 1 / nb / n_seq,
               "seq-mean-token-sum": lambda nb: 1 / n_seq, "seq-mean-token-sum-norm": lambda nb: 1 / n_seq / R}[mode]
    return torch.tensor(np.concatenate([x * per_row(x.sum()) for x in m]))


@pytest.fixture(scope="module")
def exact(batch):
    """Per position i (all of them): the exact loss_i and d loss_i / dh_i (float64 re-run of the fp32
    ops) and their fp32 error bounds (numerics.fp32_bound), the weight left out."""
    student, p, old, sc = batch
    _, _, seen = run("token-mean", batch, keep=False)
    head, ob, cfg = lmhead.head_weight(student).detach(), objectives.get("forward_kl_topk"), session("token-mean").cfg
    t = {k: torch.as_tensor(v) for k, v in sc.items()}

    def per_position(h):
        ch = objectives.Chunk(student_logits=torch.nn.functional.linear(h, head).float(), sampled_ids=p.targets,
                              old_logprobs=old, teacher_logprobs=t["teacher_logprobs"], topk_ids=t["topk_ids"],
                              topk_logprobs=t["topk_logprobs"])
        loss, _ = ob.per_token(ch, cfg.objective)
        return loss.sum(), loss

    def f(h):
        g, (_, loss) = grad_and_value(per_position, has_aux=True)(h)
        return g, loss

    h0 = seen["h"]
    return h0, numerics.fp32_bound(f, h0, rows=h0.shape[0], batch=16)


@pytest.mark.parametrize("keep", [True, False], ids=["keep", "weights"])
@pytest.mark.parametrize("mode", MODES)
def test_loss_and_gradient_are_those_of_the_unmasked_positions(batch, exact, mode, keep):
    h0, ((g1, loss1), (bound_g1, bound_loss1)) = exact
    c = hand_weights(mode)
    ref_loss, ref_g = (c * loss1).sum(), c[:, None] * g1
    assert ref_loss > 0.01 and (c[~torch.as_tensor(KEEP)] == 0).all()  # a real divergence; masked weigh 0
    # The update's weights w_i = c_i (1 + d_i), |d_i| <= gamma(2): agg_weights divides 0/1 counts (exact
    # integers) once or twice (verl's + 1e-8 to a count >= 1 rounds away in fp32). Each weighted term
    # adds one rounding (u) and their sum, over chunks in any order, gamma(n - 1) of sum|terms|. The
    # backward seeds position i with w_i exactly, so its gradient's bound is c_i times the traced one,
    # plus the weight's own gamma(2).
    n, g2 = len(c), numerics.gamma(2)
    bound_loss = (c * bound_loss1).sum() + (g2 + numerics.U32 + numerics.gamma(n - 1)) * (c * loss1).abs().sum()
    bound_g = c[:, None] * (bound_g1 + g2 * g1.abs())
    stats, grads, seen = run(mode, batch, keep)
    rows = torch.as_tensor(KEEP) if keep else torch.ones(n, dtype=torch.bool)  # what reached the LM head
    assert torch.equal(seen["h"], h0[rows]) and len(grads) > 0
    numerics.check(stats["loss"], ref_loss, bound_loss, f"{mode}: loss")
    numerics.check(seen["g"], ref_g[rows], bound_g[rows], f"{mode}: dloss/dh")
    if not keep:  # a masked position's gradient is exactly zero, not merely small
        assert seen["g"][~torch.as_tensor(KEEP)].abs().sum() == 0


@pytest.mark.parametrize("keep", [True, False], ids=["keep", "weights"])
@pytest.mark.parametrize("mode", MODES)
def test_a_masked_position_changes_neither_loss_nor_gradient(batch, mode, keep):
    masked = ~KEEP
    sc = {k: v.copy() for k, v in batch[3].items()}
    # score records NaN where it did not look (update.run then always passes keep); without keep the
    # objective sees the values, weighted 0: finite nonsense instead (a teacher sure of every id)
    sc["teacher_logprobs"][masked] = np.nan if keep else 0.0
    sc["topk_logprobs"][masked] = np.nan if keep else 0.0
    sc["topk_ids"][masked] = np.arange(K)[::-1]
    base_stats, base_grads, _ = run(mode, batch, keep)
    stats, grads, _ = run(mode, batch, keep, sc=sc, bump=30.0)  # the logits there moved by up to ~30 |head|
    assert stats == base_stats
    assert grads.keys() == base_grads.keys() and all(torch.equal(grads[k], base_grads[k]) for k in grads)
    control, _, _ = run(mode, batch, keep, bump=30.0, where="unmasked")  # the same bump where it counts
    assert control["loss"] != base_stats["loss"]
