"""agg_weights against hand-computed verl agg_loss values; chunked == unchunked; all-masked batches."""
import pytest
import torch

from stages import objectives as O
from stages.errors import UserError

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
    assert (w * LOSS).sum().item() == pytest.approx(expected, rel=1e-6)


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


@pytest.mark.parametrize("mode", O.AGG_MODES)
@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_chunked_equals_unchunked(key, mode):
    batch = make_batch(seed=1)
    cfg = cfg_for(key, loss_agg_mode=mode, loss_max_clamp=2.0)
    results = []
    for chunk_size in (10_000, 2, 1):
        leaf = batch.logits.clone().requires_grad_(True)
        value = _weighted_loss(batch, leaf, cfg, chunk_size)
        value.backward()
        results.append((value.detach(), leaf.grad))
    for value, grad in results[1:]:
        torch.testing.assert_close(value, results[0][0], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad, results[0][1], rtol=1e-6, atol=1e-7)
    assert results[0][1].abs().sum() > 0  # the objective does move the student
    assert results[0][1][1].abs().sum() == 0  # the empty sequence gets no gradient


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

