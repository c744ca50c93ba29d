"""Every registered objective trains on the tiny model through the real stages: two updates, finite
losses, and the adapter actually moves."""
from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file

from stages import objectives, train
from support import session

EXTRA = {  # settings an objective needs to be valid (verl refuses k1 without policy gradient, ...)
    "k1": ["objective.use_policy_gradient=true"],
    "pg_k1_rewarded": ["objective.use_policy_gradient=true", "data.generator=arith", "rollout.n=2"],
}


@pytest.mark.parametrize("name", sorted(objectives.REGISTRY))
def test_objective_trains_through_the_pipeline(work, name):
    sess = session(work, f"objective.name={name}", "train.updates=2", "runtime.threads=1", *EXTRA.get(name, []))
    train.ensure_policy(sess, 2)
    losses = [train.history_row(sess, k)["loss"] for k in (1, 2)]
    assert all(np.isfinite(x) for x in losses), losses
    a0 = load_file(str(sess.policy_dir(0) / "adapter" / "adapter_model.safetensors"))
    a2 = load_file(str(sess.policy_dir(2) / "adapter" / "adapter_model.safetensors"))
    assert set(a0) == set(a2) and any(not np.array_equal(a0[k], a2[k]) for k in a0)
