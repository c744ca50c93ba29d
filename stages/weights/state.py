"""What this project keeps on a model object, in one typed place: `state(model)`.

The session, the rollout engine and the teacher-forced forwards need a few facts per model that
transformers has no field for (which role's forwards replay CUDA graphs, the graphs themselves, the
flat buffer of merge_in_place, ...). They live in one `ModelState` per model, never as loose
attributes of the transformers model: every reader and writer goes through `state`.

Where it hangs: one attribute (`ATTR`) in the instance dict of the transformers model, the one
under any PEFT wrapper (`base_of`). PEFT wraps the model object as it is (get_peft_model) and hands
it back the same (merge_and_unload), so a state made before the LoRA is added (fuse_projections at
load) is the state after it, and `state(peft_model)` is `state(base)`. Read from the instance dict,
not with getattr: a wrapper that forwards unknown attributes (PEFT's, the shared teacher's view in
memory/placement.py) then gets a state of its own instead of the wrapped model's. Not a
WeakKeyDictionary: the state refers back to the model (params_at's module list holds the model
itself; before_capture is a method of the session that holds it), which a global weak-keyed table
would keep alive forever; as an attribute it is freed with the model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

ATTR = "opd_state"


def base_of(model):
    """The transformers model under a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@dataclass(eq=False)  # (compared and hashed by identity: one per model)
class ModelState:
    # ---- how its teacher-forced forwards run (Session._graph_forwards sets them for the role it hands out;
    # engine/lmhead.py and engine/graphs.py read them); for the model's lifetime
    use_graphs: bool = False  # replay captured CUDA graphs (run/codepaths.py graphed_roles names the roles)
    forward_length: int = 0  # CUDA: the padded length of every such forward (Resident.forward_length; 0: its own bucket)
    # called before each capture: another thread's device work would invalidate it (Resident.before_capture)
    before_capture: Callable[[], None] | None = None
    # decoder layers compiled (models.compile_layers) for "training" (eval-mode forwards then run eager)
    # or "inference"; None: eager. A view of another model's layers takes that model's (Resident.teacher)
    compiled: str | None = None
    # an NF4 model whose ModelCfg.dense_copy is false: sampled through transformers over its 4-bit weights
    # (engine/sampler.py `make` builds no engine for it), never from a dense copy
    quantized_sampling: bool = False

    # ---- engine/graphs.py
    # captured forwards by (mode, train flag, batch, padded length), least recently used first, and
    # "params": the parameter addresses they read (graphs.hidden; graphs.drop empties it)
    graphs: dict = field(default_factory=dict)
    modules: list | None = None  # params_at's module list, taken once (graphs.drop forgets it)

    # ---- memory.merge_in_place (engine/decoder.py fuse_projections; sampler.Engine); None: not fused
    flat: torch.Tensor | None = None  # every decoder layer's projection weights, one buffer the weights view
    pristine: torch.Tensor | None = None  # flat's bytes without any LoRA merged, in host memory
    # per decoder layer: (q|k|v, gate|up), the fused matrices the decode step reads, views of flat
    fused: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # the current policy's LoRA merged into flat ahead of the next rollout (Engine.premerge sets it); the
    # next Engine.generate takes it (samples from that merge), or decoder.base_ready clears it and undoes
    # the merge when something else reads the weights first
    merged: bool = False
    restored: torch.cuda.Event | None = None  # CUDA: recorded after the last copy back of pristine (decoder.restore)


def state(model) -> ModelState:
    """The model's state (made on first use): of the transformers model under a PEFT wrapper."""
    base = base_of(model)
    s = base.__dict__.get(ATTR)
    if s is None:
        s = base.__dict__[ATTR] = ModelState()
    return s


def peek(model) -> ModelState | None:
    """The model's state if it has one (`state` without making one)."""
    return base_of(model).__dict__.get(ATTR)
