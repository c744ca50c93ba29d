"""A fresh LoRA with PEFT's initial values, built without PEFT's per-module construction.

PEFT builds each adapter as two CPU nn.Linear layers (each drawing its default init from the CPU
generator), draws A again (kaiming uniform) and zeroes B, then moves the pair to the base layer's
device and dtype and back up to fp32: for the 360M student's 224 projections that is ~1,300 small
host operations, 0.9-1.0 s of the first update's main thread on the H200, most of it waiting for
the interpreter lock after each device copy while the read-ahead thread imports
(docs/architecture.md, "Startup"). Policy 0's bytes are those values, so they must not change:
`build` lets PEFT make the structure on the meta device (its `low_cpu_mem_usage`), replays the same
draws from the CPU generator in the same order, applies the same casts, and places each tensor on
its device with one copy from pinned memory. tests/blocks/test_lora_init.py compares the result,
and the generator's state after it, with PEFT's own construction byte for byte.
"""
from __future__ import annotations

import math

import torch
from torch import nn

ADAPTER = "default"
_UPCAST = (torch.float16, torch.bfloat16)  # what PEFT's autocast_adapter_dtype lifts to fp32


def replayable(config) -> bool:
    """The configs whose construction `build` replays: PEFT's default init of plain linear adapters."""
    return (config.init_lora_weights is True and not config.use_dora and not config.lora_bias
            and not config.modules_to_save and not getattr(config, "target_parameters", None))


def _plain_targets(model, config) -> bool:
    """Every module the config targets is a linear layer (bitsandbytes' subclass them), whose adapter
    PEFT builds as two nn.Linear; embeddings and convolutions take PEFT's own path."""
    from peft.tuners.tuners_utils import check_target_module_exists

    hits = [m for name, m in model.named_modules() if name and check_target_module_exists(config, name)]
    return bool(hits) and all(isinstance(m, nn.Linear) for m in hits)


def build(model, config):
    """get_peft_model(model, config) with the values PEFT's own construction gives (the caller seeds
    the CPU generator first, as for PEFT). None when the model has adapters `build` cannot replay;
    the caller then uses get_peft_model (before anything is wrapped)."""
    from peft import get_peft_model
    from peft.tuners.lora import LoraLayer

    if not _plain_targets(model, config):
        return None
    peft_model = get_peft_model(model, config, low_cpu_mem_usage=True)  # adapters on meta: no draws
    layers = [m for m in peft_model.modules() if isinstance(m, LoraLayer)]  # PEFT's construction order
    values = []  # per layer: (A, B) as PEFT leaves them, on the host
    for m in layers:
        r, fan_in, fan_out = m.r[ADAPTER], m.in_features, m.out_features
        a = torch.empty(r, fan_in)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # nn.Linear(in, r)'s own init (thrown away by PEFT)
        nn.init.kaiming_uniform_(torch.empty(fan_out, r), a=math.sqrt(5))  # nn.Linear(r, out)'s
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # reset_lora_parameters: A drawn again, B zero
        device, dtype = m._get_base_layer_device_and_dtype(m.get_base_layer())
        if dtype is not None and dtype.is_floating_point:
            a = a.to(dtype)  # _move_adapter_to_device_of_base_layer casts to the base's dtype
        if a.dtype in _UPCAST:
            a = a.float()  # and autocast_adapter_dtype lifts it back
        values.append((device, a, (fan_out, r)))
    _place(layers, values)
    return peft_model


def _place(layers, values) -> None:
    """Each A onto its layer's device (from one pinned host buffer, one asynchronous copy each: the
    caching host allocator keeps the buffer until the copies are done), each B as zeros there."""
    on_cuda = [i for i, (d, _, _) in enumerate(values) if d is not None and d.type == "cuda"]
    dtypes = {values[i][1].dtype for i in on_cuda}
    staged = {}
    if on_cuda and len(dtypes) == 1:
        flat = torch.empty(sum(values[i][1].numel() for i in on_cuda), dtype=dtypes.pop(), pin_memory=True)
        torch.cat([values[i][1].reshape(-1) for i in on_cuda], out=flat)
        start = 0
        for i in on_cuda:
            n = values[i][1].numel()
            staged[i] = flat[start:start + n].view(values[i][1].shape)
            start += n
    for i, (m, (device, a, b_shape)) in enumerate(zip(layers, values)):
        device = device or torch.device("cpu")
        if device.type != "cpu":
            a = torch.empty(a.shape, dtype=a.dtype, device=device).copy_(staged.get(i, a), non_blocking=i in staged)
        m.lora_A[ADAPTER].weight = nn.Parameter(a)
        m.lora_B[ADAPTER].weight = nn.Parameter(torch.zeros(b_shape, dtype=a.dtype, device=device))
