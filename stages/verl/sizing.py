"""Sizing a bundle for a cluster: `--gpus N --nodes M --teacher-gpus T [--teacher-tp K] [--gpu-gib G]`.

The cluster is M nodes of N GPUs. verl 0.8 runs the teacher in a pool of its own, so T of the N*M
GPUs serve the teacher (vLLM replicas of K GPUs each) and the other A = N*M - T run the student
(FSDP actor and the vLLM rollout, colocated). Each pool is a list of placement groups of equal size,
each packed on one node (STRICT_PACK: verl/single_controller/ray/base.py:130); the pools' own
`n_gpus_per_node` x `nnodes` are those groups (verl/trainer/main_ppo.py:163, :185), so they need
not equal the machine's. We pick the largest groups that first-fit onto the M nodes in verl's
creation order (actor groups, then teacher groups).

What must divide (else exit 2, naming the numbers and what would divide):
  rollout.batch_size * rollout.n (sequences per step) by A: the actor's mini-batch is split evenly
      over its data-parallel ranks (verl/workers/engine_workers.py:258; verl/utils/config.py:110)
  T by K, and each teacher group by K (a replica stays on one node: verl/experimental/teacher_loop/
      teacher_model.py:102), K dividing the teacher's attention heads (vLLM tensor parallelism)
Memory, per GPU of G GiB (usable: G x (1 - memory.margin)), from our weight-free planner
(stages/memory/plan.py) on the per-GPU shapes, bf16, CUDA:
  ppo_micro_batch_size_per_gpu = the largest divisor of the per-GPU mini-batch whose update phase
      (student weights, LoRA + grads + AdamW moments, activations, the loss over the micro-batch's
      logits at once, as verl computes it) fits; log-prob micro-batches use the same size
  rollout.gpu_memory_utilization = what is left for vLLM beside the actor's resident state (its
      weights counted whole, not FSDP-sharded: an upper bound), refused below vLLM's weights + one
      sequence's KV cache
  teacher: K is the smallest that fits the teacher's weights / K + one sequence's KV cache;
      gpu_memory_utilization = the usable fraction (the pool holds nothing else)
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from ..memory import plan
from ..errors import UserError
from ..memory.shapes import lora_params, shape_of, weight_bytes

GIB = 1 << 30
BF16 = 2


@dataclass(frozen=True)
class Cluster:
    gpus: int = 2  # per node
    nodes: int = 1
    teacher_gpus: int = 1
    teacher_tp: Optional[int] = None  # None: the smallest that fits
    gpu_gib: float = 80.0


@dataclass(frozen=True)
class Sizing:
    actor_per_group: int
    actor_groups: int
    teacher_per_group: int
    teacher_groups: int
    teacher_tp: int
    micro_batch: int  # sequences per GPU per forward/backward
    rollout_util: float
    teacher_util: float
    plan: dict  # what the numbers came from (compat.json "sizing")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def first_fit(groups: list[int], nodes: int, per_node: int) -> bool:
    free = [per_node] * nodes
    for g in groups:
        i = next((i for i, f in enumerate(free) if f >= g), None)
        if i is None:
            return False
        free[i] -= g
    return True


def layout(c: Cluster, tp: int) -> Optional[tuple[int, int]]:
    """(actor group size, teacher group size): the largest that pack onto the nodes; None if none do."""
    A, T = c.gpus * c.nodes - c.teacher_gpus, c.teacher_gpus
    for a in sorted((d for d in _divisors(A) if d <= c.gpus), reverse=True):
        for t in sorted((d for d in _divisors(T) if d <= c.gpus and d % tp == 0), reverse=True):
            if first_fit([a] * (A // a) + [t] * (T // t), c.nodes, c.gpus):
                return a, t
    return None


def _check_cluster(c: Cluster) -> None:
    for flag, v in (("--gpus", c.gpus), ("--nodes", c.nodes), ("--teacher-gpus", c.teacher_gpus)):
        if not isinstance(v, int) or v < 1:
            raise UserError(f"{flag} {v}: expected a positive integer")
    if c.teacher_tp is not None and c.teacher_tp < 1:
        raise UserError(f"--teacher-tp {c.teacher_tp}: expected a positive integer")
    if not c.gpu_gib > 0:
        raise UserError(f"--gpu-gib {c.gpu_gib}: expected a positive number of GiB")
    if c.teacher_gpus >= c.gpus * c.nodes:
        raise UserError(f"--teacher-gpus {c.teacher_gpus}: the cluster has {c.gpus * c.nodes} GPUs "
                        f"({c.nodes} x {c.gpus}); at least one must remain for the student")


def _per_gpu(cfg, gpu_gib: float):
    """Our config as one cluster GPU runs it: CUDA, bf16, unquantized (verl loads the exported weights as
    they are), memory.vram_gib = the GPU."""
    r = dataclasses.replace
    return r(cfg, runtime=r(cfg.runtime, device="cuda", dtype="bfloat16"), memory=r(cfg.memory, vram_gib=gpu_gib),
             student=r(cfg.student, quant="none"), teacher=r(cfg.teacher, quant="none"))


def _update_gib(cfg, m: int, shapes: dict) -> float:
    """Our planner's update-phase total (GiB) for m sequences on one GPU."""
    r = dataclasses.replace
    tokens = m * (cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens)
    c = r(cfg, rollout=r(cfg.rollout, batch_size=m, n=1), train=r(cfg.train, chunk=tokens),
          memory=r(cfg.memory, placement="swap"))
    return plan.estimate(c, shapes)["phases"]["update"]["total_gib"]


def size(cfg, c: Cluster) -> Sizing:
    """The pools, micro-batches and memory settings for `cfg` on cluster `c`; UserError if they cannot be."""
    _check_cluster(c)
    cfg = _per_gpu(cfg, c.gpu_gib)
    A, T = c.gpus * c.nodes - c.teacher_gpus, c.teacher_gpus
    usable = c.gpu_gib * (1 - cfg.memory.margin) * GIB
    S, Tm = shape_of(cfg.student, "student"), shape_of(cfg.teacher, "teacher")
    seq = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    kv = lambda sh: 2 * sh.layers * sh.kv_heads * sh.head_dim * BF16 * (seq + 1)  # noqa: E731  one sequence

    t_weights = weight_bytes(Tm, "none", False, BF16)
    tps = [k for k in _divisors(T) if Tm.heads % k == 0]
    if c.teacher_tp is not None:
        if c.teacher_tp not in tps:
            raise UserError(f"--teacher-tp {c.teacher_tp}: must divide --teacher-gpus {T} and the teacher's "
                            f"{Tm.heads} attention heads (one of {', '.join(map(str, tps))})")
        tp = c.teacher_tp
    else:
        fit = [k for k in tps if t_weights / k + kv(Tm) <= usable]
        if not fit:
            raise UserError(f"--teacher-gpus {T}: the teacher's weights ({t_weights / GIB:.1f} GiB bf16) do not fit "
                            f"{usable / GIB:.1f} GiB usable per GPU at any tensor-parallel size dividing {T}")
        tp = fit[0]
    if t_weights / tp + kv(Tm) > usable:
        raise UserError(f"--teacher-tp {tp}: the teacher's weights need {t_weights / tp / GIB:.1f} GiB per GPU; "
                        f"{usable / GIB:.1f} GiB usable (--gpu-gib {c.gpu_gib}, memory.margin "
                        f"{cfg.memory.margin}); raise --teacher-tp")
    lay = layout(c, tp)
    if lay is None:
        raise UserError(f"--gpus {c.gpus} --nodes {c.nodes} --teacher-gpus {T} --teacher-tp {tp}: no split into "
                        f"equal placement groups fits the nodes (each teacher group a multiple of {tp})")
    a, t = lay

    seqs = cfg.rollout.batch_size * cfg.rollout.n
    if seqs % A:
        other = [k for k in range(1, c.gpus * c.nodes) if seqs % (c.gpus * c.nodes - k) == 0
                 and k % tp == 0 and layout(dataclasses.replace(c, teacher_gpus=k), tp)]
        step = A // math.gcd(A, cfg.rollout.n)
        hint = f"--teacher-gpus {' or '.join(map(str, other[:3]))}, or " if other else ""
        raise UserError(f"rollout.batch_size x rollout.n = {seqs} sequences per step do not divide over the "
                        f"student's {A} GPUs ({c.nodes} x {c.gpus} - {T} teacher); use {hint}rollout.batch_size "
                        f"a multiple of {step}")
    per_gpu = seqs // A
    shapes: dict = {}
    need = {m: _update_gib(cfg, m, shapes) for m in _divisors(per_gpu)}
    fits = [m for m, g in need.items() if g * GIB <= usable]
    if not fits:
        raise UserError(f"one sequence of {seq} tokens needs {need[1]:.1f} GiB in the student's update (our plan); "
                        f"{usable / GIB:.1f} GiB usable per GPU (--gpu-gib {c.gpu_gib})")
    m = max(fits)

    lora = 4 * lora_params(S, cfg.lora) * 4  # fp32 LoRA, its grads and two AdamW moments
    resident = weight_bytes(S, "none", False, BF16) + lora
    vllm_min = weight_bytes(S, "none", False, BF16) + kv(S)
    util = math.floor((usable - resident) / (c.gpu_gib * GIB) * 100) / 100
    if util * c.gpu_gib * GIB < vllm_min:
        raise UserError(f"--gpu-gib {c.gpu_gib}: the actor's resident state ({resident / GIB:.1f} GiB) leaves vLLM "
                        f"{max(util, 0) * c.gpu_gib:.1f} GiB, below the student's weights + one sequence "
                        f"({vllm_min / GIB:.1f} GiB)")
    teacher_util = math.floor(usable / (c.gpu_gib * GIB) * 100) / 100
    detail = {
        "cluster": {"nodes": c.nodes, "gpus_per_node": c.gpus, "gpu_gib": c.gpu_gib, "margin": cfg.memory.margin},
        "actor_rollout": {"gpus": A, "placement_groups": [a] * (A // a), "data_parallel": A,
                          "sequences_per_step": seqs, "sequences_per_gpu": per_gpu, "micro_batch": m,
                          "update_gib_by_micro_batch": need, "resident_gib": round(resident / GIB, 3),
                          "rollout_gpu_memory_utilization": util},
        "teacher": {"gpus": T, "placement_groups": [t] * (T // t), "tensor_parallel": tp, "replicas": T // tp,
                    "weights_gib_per_gpu": round(t_weights / tp / GIB, 3), "gpu_memory_utilization": teacher_util},
        "source": "stages/memory/plan.py (update phase, swap placement, bf16, CUDA) and stages/memory/shapes.py",
    }
    return Sizing(a, A // a, t, T // t, tp, m, util, teacher_util, detail)
