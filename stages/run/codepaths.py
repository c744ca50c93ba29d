"""Which code computes each part of a run on a device, decided from the config alone: the compiled
decode step, the compiled layers, the CUDA graphs of the teacher-forced forwards and the LoRA kernels.

Each choice changes the bytes a stage publishes, so the digests name it (identity.runtime_slice), and
each changes what the run holds, so the memory plan asks here too (stages/memory/phases.py), as does
the Session that builds the models: one rule per choice for all three (docs/architecture.md).
"""
from __future__ import annotations

from .config import LORA_KERNELS_MAX_RANK

GRAPHED_QUANT = ("none", "nf4")  # weights whose forwards and backwards graphs capture (graphed_roles)


def compiled_decode(cfg, device_type: str) -> bool:
    """The rollout engine's decode step is compiled: CUDA with graphs and runtime.compile."""
    return device_type == "cuda" and cfg.rollout.cuda_graphs and cfg.runtime.compile


def compiled_layers(cfg, mcfg, device_type: str) -> bool:
    """A model's layers run compiled (the student's training, the teacher's scoring): CUDA, unquantized."""
    return device_type == "cuda" and cfg.runtime.compile_layers and mcfg.quant == "none"


def graphed_roles(cfg, device: str) -> set[str]:
    """The roles whose teacher-forced forwards replay CUDA graphs (stages/engine/graphs.py): runtime.cuda_graphs
    on CUDA, single-turn prompts (one padded length for the run: multi-turn episodes vary, and a capture
    mid-run could meet the publish thread's device sync), no compiled layers (their own kernels), dense or
    NF4 weights (bitsandbytes' 4-bit kernels, a dequantize and a matmul or its fused 4-bit GEMM, launch on
    the current stream with no host sync: captured as they are; int8 finds its outlier columns on the host
    each forward); the student also without LoRA dropout (a capture's warm-up passes would draw from the
    generator the update seeds). With activation checkpointing the captured backward recomputes each
    layer (models.enable_activation_checkpointing: no RNG state to stash without dropout). Not the
    placement: it changes nothing computed (swap frees a role's graphs before it moves and captures
    them again)."""
    env = getattr(cfg, "env", None)
    if device != "cuda" or not cfg.runtime.cuda_graphs or cfg.runtime.compile_layers or (env is not None and env.name):
        return set()
    roles = {"teacher"} if cfg.teacher.quant in GRAPHED_QUANT else set()
    if cfg.student.quant in GRAPHED_QUANT and not cfg.lora.dropout:
        roles.add("student")
    return roles


def lora_kernels(cfg, role: str, device_type: str) -> bool:
    """The role's trained LoRA computes through stages/weights/lora_kernels.py: runtime.lora_kernels on CUDA, bf16
    or fp16, unquantized, not compiled, no dropout, rank within the kernels' tiles. The teacher trains only in
    SFT (protocol_sft)."""
    mcfg = getattr(cfg, role)
    return (device_type == "cuda" and cfg.runtime.lora_kernels and cfg.runtime.dtype != "float32"
            and mcfg.quant == "none" and cfg.lora.dropout == 0 and cfg.lora.r <= LORA_KERNELS_MAX_RANK
            and not compiled_layers(cfg, mcfg, device_type))
