"""A rollout table as the packed tensors score and update feed the models (lmhead.Packed)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import torch

from . import lmhead
from ..rows import tables


# the rollout columns score and update read
ROLLOUT_NEEDS = {c: tables.ROLLOUT.field(c).type for c in
                 ("uid", "prompt_ids", "response_ids", "response_mask", "sample_logprobs")}


def packed(t: pa.Table, device) -> lmhead.Packed:
    return lmhead.pack(tables.lists(t, "prompt_ids", np.int64), tables.lists(t, "response_ids", np.int64),
                       tables.lists(t, "response_mask", np.int8), pad=0, device=device)


def subset(p: lmhead.Packed, keep: torch.Tensor) -> lmhead.Packed:
    """The packed batch restricted to the kept positions (same sequences, fewer head positions)."""
    return dataclasses.replace(p, rows=p.rows[keep], cols=p.cols[keep], targets=p.targets[keep])
