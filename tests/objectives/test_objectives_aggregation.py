"""agg_weights against hand-computed verl agg_loss values; chunked == unchunked; all-masked batches."""
import pytest
import torch
from torch.func import grad_and_value

import numerics
from stages import objectives as O
from stages.errors import UserError
from support import seeds

from _objective_batch import CONFIGS, cfg_for, make_batch

MASK = torch.tensor([[1, 1, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]])
LOSS = torch.tensor([[1.0, 2.0, 100.0, 3.0], [50.0, 50.0, 50.0, 50.0], [4.0, 100.0, 100.0, 100.0]])


@pytest.mark.parametrize("mode,expected", [
    ("token-mean", (1 + 2 + 3 + 4) / 4),  # masked token sum / unmasked token count
    ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + 4 / 1) / 2),  # empty row not counted as a sequence
    ("seq-mean-token-sum", ((1 + 2 + 3) + 4) / 2),
    ("seq-mean-token-sum-norm", ((1 + 2 + 3) + 4) / 2 / 4),  # / horizon T = 4
])
def test_agg_weights_hand_computed(mode, expected):
    w = O.agg_weights(MASK, mode)
    assert w.shape == MASK.shape
    # bound: the fp32 weights (a division or two, <= 2u each) times the losses (u) summed over 12
    # terms (gamma(11) sum|w loss|), as numerics.fp32_bound derives it from the traced ops
    _, bound = numerics.fp32_bound(lambda loss: (O.agg_weights(MASK, mode) * loss).sum(), LOSS)
    numerics.check((w * LOSS).sum(), expected, bound, f"{mode}: sum(w * loss) vs hand-computed")


def test_agg_weights_unknown_mode():
    with pytest.raises(UserError, match="objective.loss_agg_mode"):
        O.agg_weights(MASK, "sample-mean")


def _weighted_loss(batch, leaf, cfg, chunk_size):
    """What the update does: per chunk, sum(w * per_token) over the selected positions; summed."""
    w = O.agg_weights(batch.mask, cfg.loss_agg_mode)  # [B, T]
    pos = batch.mask.nonzero()  # [N, 2]
    total = torch.zeros(())
    for part in pos.split(chunk_size):
        loss, diag = O.get(cfg.name).per_token(batch.chunk(leaf, part), cfg)
        assert loss.shape == (len(part),) and all(v.shape == (len(part),) for v in diag.values())
        total = total + (w[part[:, 0], part[:, 1]] * loss).sum()
    return total


@pytest.mark.parametrize("seed", seeds(1))
@pytest.mark.parametrize("mode", O.AGG_MODES)
@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_chunked_equals_unchunked(key, mode, seed):
    batch = make_batch(seed=1 + seed)
    cfg = cfg_for(key, loss_agg_mode=mode, loss_max_clamp=2.0)
    # The exact value and gradient (float64) and the fp32 error bound of the unchunked computation
    # (numerics.fp32_bound over its traced forward + backward ops). The bound covers every chunking:
    # each position goes through the same ops whatever chunk it is in (kernels may take another code
    # path, e.g. a vector lane instead of the scalar tail, each within the same per-op error), the
    # weighted sum's bound gamma(N-1) sum|terms| holds for any grouping of the N terms, and each logit
    # row's gradient comes from one chunk (the others add exact zeros). So each chunking is compared
    # with the exact result, element-wise.
    (ref_grad, ref_value), (b_grad, b_value) = numerics.fp32_bound(
        grad_and_value(lambda leaf: _weighted_loss(batch, leaf, cfg, 10_000)), batch.logits)
    results = []
    for chunk_size in (10_000, 2, 1):
        leaf = batch.logits.clone().requires_grad_(True)
        value = _weighted_loss(batch, leaf, cfg, chunk_size)
        value.backward()
        numerics.check(value.detach(), ref_value, b_value, f"chunk {chunk_size}: value")
        numerics.check(leaf.grad, ref_grad, b_grad, f"chunk {chunk_size}: d value / d logits")
        results.append((value.detach(), leaf.grad))
    # exactly the positions whose exact gradient is 0 (masked out; every loss at the clamp, as some
    # seeds give for k2/mse/abs at clamp 2) get an fp32 gradient of exactly 0, the others move
    for _, g in results:
        assert torch.equal(g.abs().sum(-1) == 0, ref_grad.abs().sum(-1) == 0)
        assert g[1].abs().sum() == 0  # the empty sequence gets no gradient (exactly)
    leaf = batch.logits.clone().requires_grad_(True)  # without the clamp the objective moves the student
    _weighted_loss(batch, leaf, cfg_for(key, loss_agg_mode=mode), 10_000).backward()
    assert leaf.grad.abs().sum() > 0


@pytest.mark.parametrize("mode", O.AGG_MODES)
@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_all_masked_batch_is_zero_without_nan(key, mode):
    mask = torch.zeros(2, 3, dtype=torch.long)
    batch = make_batch(seed=2, B=2, T=3, mask=mask)
    cfg = cfg_for(key, loss_agg_mode=mode)
    w = O.agg_weights(mask, mode)
    assert torch.equal(w, torch.zeros_like(w))
    # the update may still run per_token on such positions (weight 0), or on no position at all
    everything = torch.ones_like(mask).nonzero()
    for pos in (everything, everything[:0]):
        leaf = batch.logits.clone().requires_grad_(True)
        loss, _ = O.get(cfg.name).per_token(batch.chunk(leaf, pos), cfg)
        total = (w[pos[:, 0], pos[:, 1]] * loss).sum()
        total.backward()
        assert total.item() == 0.0
        assert leaf.grad is None or (torch.isfinite(leaf.grad).all() and leaf.grad.abs().sum() == 0)

