"""The student's LoRA as PEFT builds and loads it (docs/architecture.md, "Startup"): `add` wraps a base
model (A drawn from the CPU generator, seeded; B zero, so policy 0 is the base model), with its
adapters moved to the device in one copy (`moved_at_once`); `load` puts a published adapter in."""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from . import imports, lora_kernels
from ..run.config import LoraCfg
from ..errors import UserError


def add(model, lcfg: LoraCfg, seed: int, kernels: bool = False):
    """`model` wrapped in the LoRA of `lcfg`; kernels: its projections compute the LoRA branch through
    stages/weights/lora_kernels.py where they can (codepaths.lora_kernels says when)."""
    imports.bitsandbytes()  # (before peft, which imports it)
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)  # LoRA A init is random; B is zero, so policy 0 == the base model
    cfg = LoraConfig(r=lcfg.r, lora_alpha=lcfg.alpha, lora_dropout=lcfg.dropout,
                     target_modules=list(lcfg.target_modules), bias="none", task_type="CAUSAL_LM")
    try:
        with peft_wrap_quietly(), moved_at_once():
            peft_model = get_peft_model(model, cfg, autocast_adapter_dtype=True)
    except ValueError as e:
        raise UserError(f"key 'lora.target_modules': {str(e).splitlines()[0]}") from None
    if kernels:
        lora_kernels.install(peft_model)
    return peft_model


def load(peft_model, adapter_dir: Path) -> None:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    sd = load_file(adapter_dir / "adapter_model.safetensors")
    res = set_peft_model_state_dict(peft_model, sd)
    bad = [k for k in res.unexpected_keys if "lora_" in k]
    if bad:
        raise UserError(f"{adapter_dir}: adapter keys do not match the model ({bad[0]})")


@contextmanager
def peft_wrap_quietly():
    """PEFT (0.21) wraps a model after reading `model.is_gradient_checkpointing`, an alias that
    transformers 5 deprecates with a FutureWarning on every read; the read is PEFT's, not ours, so
    only that one message is silenced, only around the wrap."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


@contextmanager
def moved_at_once():
    """PEFT (0.21) builds each adapter on the host and moves it to its base layer's device, cast to that
    layer's (compute) dtype, before building the next; `cast_adapter_dtype` then upcasts half precision
    to fp32. For the 360M student: 448 small blocking host-to-device copies, half a second of the first
    update (docs/performance.md; `python benchmarks/first_update.py --under LoraLayer.update_layer
    --explain` of a profile shows them). Here the moves of adapters that
    are modules of floating parameters (a Linear's LoRA) wait until the LoRA is built and go as one copy
    per (device, dtype) of what PEFT's moves and upcast leave, each parameter a view of it: the same
    values, dtypes and devices (tests/weights/test_lora.py, tests/gpu/test_gpu_lora.py). Any other
    adapter (an embedding's LoRA, parameters in ParameterDicts) PEFT moves as it always did."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    real, held = BaseTunerLayer._move_adapter_to_device_of_base_layer, {}

    def hold(layer, name, device=None):
        tensors = _module_tensors(layer, name)
        if tensors is None:
            real(layer, name, device)
        else:
            held[(id(layer), name)] = (layer, device, tensors)

    BaseTunerLayer._move_adapter_to_device_of_base_layer = hold
    try:
        yield
    finally:
        BaseTunerLayer._move_adapter_to_device_of_base_layer = real
    groups: dict[tuple, list[torch.Tensor]] = {}  # (device, dtype moved to, dtype kept) -> tensors
    for layer, device, tensors in held.values():
        base = layer.get_base_layer()
        base = base.out_proj if isinstance(base, torch.nn.MultiheadAttention) else base
        base_device, dtype = layer._get_base_layer_device_and_dtype(base)
        device = device if device is not None else base_device
        for t in tensors if device is not None else ():  # (PEFT leaves an adapter without a device where it is)
            moved = dtype if dtype is not None and dtype.is_floating_point else t.dtype
            kept = torch.float32 if moved.itemsize < 4 else moved  # (cast_adapter_dtype's upcast)
            groups.setdefault((torch.device(device), moved, kept), []).append(t)
    for (device, moved, kept), tensors in groups.items():  # (one torch call per group, not per tensor:
        with torch.no_grad():  # each gives the interpreter lock up, adapters.host_copy says why)
            flat = _flatten_dense_tensors(tensors).to(moved).to(kept).to(device)  # [n]
        for t, piece in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
            t.data = piece


def _module_tensors(layer, name: str) -> list[torch.Tensor] | None:
    """The tensors of adapter `name` in `layer` where every one is a floating parameter of a module in a
    ModuleDict (what `moved_at_once` copies together), else None."""
    dicts = [d for d in (getattr(layer, a, None) for a in layer.adapter_layer_names + layer.other_param_names)
             if isinstance(d, torch.nn.Module) and name in d]  # (r, scaling: plain dicts, not modules)
    if not all(isinstance(d, torch.nn.ModuleDict) for d in dicts):
        return None  # (a ParameterDict, a BufferDict)
    items = [d[name] for d in dicts]
    tensors = [t for m in items for t in m.parameters()]
    if any(list(m.buffers()) for m in items) or not all(t.is_floating_point() for t in tensors):
        return None
    return tensors
