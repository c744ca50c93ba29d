"""stages/rows/prompts.py: the batch walk over per-epoch permutations."""
import random

from stages.rows import prompts


def test_batch_walk_is_the_per_epoch_shuffle_and_covers_each_epoch_once():
    """Batch k takes positions (k-1)*b .. k*b-1 of the concatenated epochs, each epoch the prompts
    shuffled by Random(f"{key}:{epoch}") (the definition, spelled out here), whatever the batch
    size's relation to the prompt count; every epoch holds each prompt exactly once."""
    for n, b in [(7, 4), (5, 5), (10, 3), (3, 8), (1000, 64)]:
        epochs = []
        for e in range(4):
            perm = list(range(n))
            random.Random(f"key:{e}").shuffle(perm)
            epochs += perm
        walk = [i for k in range(1, 1 + (4 * n) // b) for i in prompts.batch_indices(n, b, k, "key")]
        assert walk == epochs[:len(walk)]
        assert sorted(walk[:n]) == list(range(n))
    assert prompts.batch_indices(1000, 4, 1, "key") != prompts.batch_indices(1000, 4, 1, "other")
