"""RMSNorm as one fused kernel each way on CUDA (docs/architecture.md, "CUDA graphs of the
teacher-forced forwards").

transformers computes a Llama-family RMSNorm eagerly: the row upcast to fp32, squared, averaged,
rsqrt, multiplied, rounded back, then scaled by the weight: about seven kernels forward, more
backward, each a pass over the activations in fp32. At workload b's update that traffic is 0.88 TB
more than one fused kernel moves (benchmarks/update_bytes.py; docs/performance.md). torch's own
`F.rms_norm` (`aten::_fused_rms_norm`, forward and backward) computes the same row statistics in
fp32 and rounds the normalised row once, as transformers does; the weight's multiply stays the
same bf16 op. Only the order of the fp32 sum of squares differs, so the output can differ from
transformers' by one rounding of the normalised row; the CUDA digests say which ran
(identity.runtime_slice). Installed on CUDA only: CPU bytes stay transformers' own.
"""
from __future__ import annotations

import functools

import torch.nn.functional as F

# the classes whose forward is `weight * norm(x.float()).to(x.dtype)` (transformers' Llama family)
FORMULA = {"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"}


def fused(mod, x):
    """What `mod.forward(x)` computes, the normalisation as one kernel: x [..., E] -> [..., E]."""
    return rms(x, mod.weight, mod.variance_epsilon)


def rms(x, weight, eps: float):
    """weight * the row normalised by one fused kernel (x [..., E]); the warm-up runs it too."""
    return weight * F.rms_norm(x, (x.shape[-1],), None, eps)


def install(model) -> int:
    """Every norm of transformers' formula in `model` computes through `fused` (a forward bound to
    the module, so captured graphs and compiled layers trace it as they trace the module). Returns
    how many."""
    n = 0
    for m in model.modules():
        if type(m).__name__ in FORMULA:
            m.forward = functools.partial(fused, m)
            n += 1
    return n
