"""The Hydra overrides a bundle writes, and what verl 0.8.0 does with each, read from its source.

Every key the bundle writes has a `Use`: the file and line in verl 0.8.0 where the value is read and
changes what runs (tests/verl/test_compat_docs.py opens each line in the installed verl and checks
the named identifier is there). Keys verl accepts but never reads, or reads only on a path our
settings do not take, are in IGNORED and are never written; a setting of ours that would need one is
a deviation (`opd stage export --verl` warns in one line, or refuses when verl cannot compute the run at
all). docs/compat.md is generated from these tables.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from . import rules

VERL_LOSS = {"forward_kl_topk": "forward_kl_topk", "k1": "k1", "k2": "k2", "mse": "mse", "k3": "k3",
             "low_var_kl": "low_var_kl", "abs": "abs", "pg_k1_rewarded": "k1"}
A, R, D, T = ("actor_rollout_ref.actor", "actor_rollout_ref.rollout", "distillation.distillation_loss",
              "distillation.teacher_models.teacher_model")
PATH_KEYS = ("data.train_files", "data.val_files", "actor_rollout_ref.model.path",
             "actor_rollout_ref.model.lora_adapter_path", f"{T}.model_path", "reward.custom_reward_function.path")


@dataclass(frozen=True)
class Use:
    file: str  # relative to the verl package
    line: int
    needle: str  # an identifier on that line (the test checks it is there)
    why: str

    @property
    def where(self) -> str:
        return f"verl/{self.file}:{self.line}"


U = Use
USES: dict[str, Use] = {
    "data.train_files": U("trainer/main_ppo.py", 281, "train_files", "the training RLHFDataset"),
    "data.val_files": U("trainer/main_ppo.py", 289, "val_files", "the validation RLHFDataset"),
    "data.prompt_key": U("utils/dataset/rl_dataset.py", 371, "prompt_key", "the chat messages of a row"),
    "data.max_prompt_length": U("experimental/agent_loop/agent_loop.py", 356, "prompt_length",
                                "via rollout.prompt_length: longer prompts keep their last tokens"),
    "data.max_response_length": U("workers/rollout/vllm_rollout/vllm_async_server.py", 493, "response_length",
                                  "via rollout.response_length: vLLM's max_tokens"),
    "data.train_batch_size": U("trainer/ppo/ray_trainer.py", 410, "train_batch_size", "prompts per step"),
    "data.filter_overlong_prompts": U("utils/dataset/rl_dataset.py", 196, "filter_overlong_prompts",
                                      "false: no prompt is dropped (over-long ones are left-truncated)"),
    "data.trust_remote_code": U("trainer/main_ppo.py", 270, "trust_remote_code", "the driver's tokenizer"),
    "actor_rollout_ref.model.path": U("workers/config/model.py", 156, "self.path", "the student base"),
    "actor_rollout_ref.model.trust_remote_code": U("workers/config/model.py", 181, "trust_remote_code",
                                                   "the student's config and weights"),
    "actor_rollout_ref.model.lora_rank": U("workers/engine/fsdp/transformer_impl.py", 141, "lora_rank",
                                           "> 0 turns the LoRA path on; vLLM's max LoRA rank"),
    "actor_rollout_ref.model.lora_adapter_path": U("workers/engine/fsdp/transformer_impl.py", 318,
                                                   "local_adapter_path", "the adapter to continue from "
                                                   "(its own r, alpha and target modules)"),
    f"{A}.optim.lr": U("workers/config/optimizer.py", 247, "config.lr", "AdamW learning rate"),
    f"{A}.optim.weight_decay": U("workers/config/optimizer.py", 248, "weight_decay", "AdamW weight decay"),
    f"{A}.optim.betas": U("workers/config/optimizer.py", 253, "betas", "AdamW betas"),
    f"{A}.optim.override_optimizer_config": U("workers/config/optimizer.py", 256, "override_optimizer_config",
                                              "AdamW eps (written only when ours differs from torch's 1e-8)"),
    f"{A}.optim.clip_grad": U("workers/engine/fsdp/transformer_impl.py", 685, "clip_grad", "gradient-norm clip"),
    f"{A}.optim.lr_warmup_steps": U("workers/engine/fsdp/transformer_impl.py", 477, "num_warmup_steps",
                                    "warmup of the constant schedule (0: none)"),
    f"{A}.optim.lr_scheduler_type": U("workers/engine/fsdp/transformer_impl.py", 476, "lr_scheduler_type",
                                      "constant (no decay over the run)"),
    f"{A}.ppo_mini_batch_size": U("trainer/ppo/ray_trainer.py", 1310, "ppo_mini_batch_size",
                                  "= train_batch_size: one optimizer step per rollout batch"),
    f"{A}.ppo_micro_batch_size_per_gpu": U("workers/engine_workers.py", 569, "ppo_micro_batch_size_per_gpu",
                                           "sequences per forward/backward on one GPU (memory only)"),
    f"{A}.ppo_epochs": U("trainer/ppo/ray_trainer.py", 1312, "ppo_epochs", "each rollout is used once"),
    f"{A}.loss_agg_mode": U("trainer/distillation/losses.py", 248, "loss_agg_mode", "loss aggregation"),
    f"{A}.use_kl_loss": U("trainer/ppo/utils.py", 79, "use_kl_loss", "false: no reference model"),
    f"{A}.entropy_coeff": U("workers/utils/losses.py", 127, "entropy_coeff", "task-reward PPO loss only"),
    f"{A}.clip_ratio": U("trainer/ppo/core_algos.py", 1313, "clip_ratio", "task-reward PPO loss only"),
    f"{A}.clip_ratio_low": U("trainer/ppo/core_algos.py", 1314, "clip_ratio_low", "task-reward PPO loss only"),
    f"{A}.clip_ratio_high": U("trainer/ppo/core_algos.py", 1315, "clip_ratio_high", "task-reward PPO loss only"),
    f"{R}.name": U("workers/engine_workers.py", 608, "rollout_config.name", "vLLM serves the rollouts"),
    f"{R}.n": U("trainer/ppo/ray_trainer.py", 1447, "rollout.n", "samples per prompt"),
    f"{R}.temperature": U("experimental/agent_loop/agent_loop.py", 497, "temperature", "sampling temperature"),
    f"{R}.top_p": U("experimental/agent_loop/agent_loop.py", 498, "top_p", "nucleus sampling"),
    f"{R}.tensor_model_parallel_size": U("workers/rollout/vllm_rollout/vllm_async_server.py", 270,
                                         "tensor_model_parallel_size", "vLLM tensor parallelism (memory only)"),
    f"{R}.gpu_memory_utilization": U("workers/rollout/vllm_rollout/vllm_async_server.py", 268,
                                     "gpu_memory_utilization", "vLLM's share of each actor GPU (memory only)"),
    f"{R}.log_prob_micro_batch_size_per_gpu": U("workers/engine_workers.py", 565,
                                                "log_prob_micro_batch_size_per_gpu", "sequences per log-prob "
                                                "forward on one GPU (memory only)"),
    "algorithm.adv_estimator": U("trainer/ppo/utils.py", 100, "adv_estimator", "not gae: no critic is built; "
                                 "with task rewards, the outcome advantage"),
    "algorithm.norm_adv_by_std_in_grpo": U("trainer/ppo/ray_trainer.py", 1631, "norm_adv_by_std_in_grpo",
                                           "task rewards with grpo: divide by the group's std"),
    "algorithm.use_kl_in_reward": U("trainer/ppo/utils.py", 79, "use_kl_in_reward", "false: no reference model"),
    "distillation.enabled": U("trainer/distillation/losses.py", 43, "enabled", "on-policy distillation on"),
    "distillation.n_gpus_per_node": U("trainer/main_ppo.py", 185, "n_gpus_per_node", "teacher pool: GPUs per "
                                      "placement group"),
    "distillation.nnodes": U("trainer/main_ppo.py", 185, "nnodes", "teacher pool: placement groups"),
    f"{T}.model_path": U("experimental/teacher_loop/teacher_model.py", 78, "model_path", "the teacher"),
    f"{T}.inference.tensor_model_parallel_size": U("workers/config/distillation.py", 143,
                                                   "tensor_model_parallel_size", "GPUs per teacher replica"),
    f"{T}.inference.gpu_memory_utilization": U("workers/rollout/vllm_rollout/vllm_async_server.py", 268,
                                               "gpu_memory_utilization", "the teacher vLLM's share of its GPUs"),
    f"{D}.loss_mode": U("trainer/distillation/losses.py", 240, "loss_mode", "the distillation loss"),
    f"{D}.topk": U("experimental/teacher_loop/teacher_manager.py", 38, "topk", "teacher log-probs per position"),
    f"{D}.use_task_rewards": U("trainer/distillation/losses.py", 211, "use_task_rewards", "adds the PPO task loss"),
    f"{D}.distillation_loss_coef": U("trainer/distillation/losses.py", 217, "distillation_loss_coef",
                                     "task rewards only: weight of the distillation loss"),
    f"{D}.loss_max_clamp": U("trainer/distillation/losses.py", 253, "loss_max_clamp", "per-token loss clamp"),
    f"{D}.log_prob_min_clamp": U("trainer/distillation/fsdp/losses.py", 72, "log_prob_min_clamp",
                                 "top-k log-prob floor"),
    f"{D}.use_policy_gradient": U("trainer/distillation/losses.py", 257, "use_policy_gradient",
                                  "distillation loss as a reward through the PPO loss"),
    f"{D}.clip_ratio": U("trainer/ppo/core_algos.py", 1313, "clip_ratio", "policy-gradient distillation only"),
    f"{D}.clip_ratio_low": U("trainer/ppo/core_algos.py", 1314, "clip_ratio_low", "policy-gradient "
                             "distillation only"),
    f"{D}.clip_ratio_high": U("trainer/ppo/core_algos.py", 1315, "clip_ratio_high", "policy-gradient "
                              "distillation only"),
    "reward.custom_reward_function.path": U("experimental/reward_loop/reward_loop.py", 146,
                                            "custom_reward_function", "our rule reward scores every response"),
    "reward.custom_reward_function.name": U("trainer/ppo/reward.py", 70, "custom_reward_function",
                                            "the function in reward.py"),
    "trainer.n_gpus_per_node": U("trainer/main_ppo.py", 163, "n_gpus_per_node", "actor pool: GPUs per "
                                 "placement group"),
    "trainer.nnodes": U("trainer/main_ppo.py", 163, "nnodes", "actor pool: placement groups"),
    "trainer.total_training_steps": U("trainer/ppo/ray_trainer.py", 441, "total_training_steps",
                                      "the remaining updates (warm start)"),
    "trainer.total_epochs": U("trainer/ppo/ray_trainer.py", 1422, "total_epochs", "passes over the prompts; "
                              "enough for total_training_steps"),
    "trainer.logger": U("trainer/ppo/ray_trainer.py", 1379, "logger", "console only"),
    "trainer.project_name": U("trainer/ppo/ray_trainer.py", 1377, "project_name", "log and checkpoint naming"),
    "trainer.experiment_name": U("trainer/ppo/ray_trainer.py", 1378, "experiment_name", "our run name"),
}

# Accepted by verl 0.8.0's config but never read on the bundle's path: never written.
IGNORED: dict[str, tuple[Use, str]] = {
    f"{R}.ignore_eos": (U("workers/config/rollout.py", 193, "ignore_eos", "declared"),
                        "no sampling path reads it: the sampling params are built at "
                        "experimental/agent_loop/agent_loop.py:496 without it"),
    "data.truncation": (U("utils/dataset/rl_dataset.py", 115, "truncation", "assigned"),
                        "never read afterwards; the agent loop always keeps the last max_prompt_length "
                        "tokens (experimental/agent_loop/agent_loop.py:356)"),
    "actor_rollout_ref.model.lora_alpha": (U("workers/engine/fsdp/transformer_impl.py", 330, "lora_alpha",
                                             "read only without lora_adapter_path"),
                                           "the adapter's adapter_config.json sets alpha (it carries ours)"),
    "actor_rollout_ref.model.target_modules": (U("workers/engine/fsdp/transformer_impl.py", 331,
                                                 "target_modules", "read only without lora_adapter_path"),
                                               "the adapter's adapter_config.json sets the targets (ours)"),
    f"{A}.clip_ratio (and _low/_high, entropy_coeff) without task rewards":
        (U("trainer/distillation/losses.py", 212, "policy_loss = 0.0", "the PPO task loss is zeroed"),
         "written only when use_task_rewards is true"),
    f"{D}.clip_ratio (and _low/_high) without use_policy_gradient":
        (U("trainer/distillation/losses.py", 257, "use_policy_gradient", "the supervised branch has no clip"),
         "written only when use_policy_gradient is true"),
    f"{D}.distillation_loss_coef without task rewards":
        (U("trainer/distillation/losses.py", 217, "else 1.0", "the coefficient is 1"),
         "written only when use_task_rewards is true"),
}


def deviations(cfg) -> list[dict]:
    """Our settings verl 0.8.0 computes differently (blocking: it cannot compute the run at all)."""
    ob, ro, dev = cfg.objective, cfg.rollout, []
    task = ob.name == "pg_k1_rewarded"

    def add(key, value, blocking, why):
        dev.append({"key": key, "value": value, "blocking": blocking, "why": why})

    if ob.name not in VERL_LOSS:
        add("objective.name", ob.name, True, "no verl 0.8 distillation loss_mode computes this objective")
    if task and ob.advantage not in ("group_standardized", "group_centered", "leave_one_out"):
        add("objective.advantage", ob.advantage, True, "verl has no outcome estimator that uses raw rewards")
    if task and ob.reward_coef != 1.0:
        add("objective.reward_coef", ob.reward_coef, True, "verl weights the task-reward loss by 1")
    if getattr(cfg.env, "name", None):
        add("env.name", cfg.env.name, True, "the bundle has no verl tool agent for our environments")
    if getattr(ob, "cross_tokenizer", "off") != "off":
        add("objective.cross_tokenizer", ob.cross_tokenizer, True, "verl's teacher scores the student's own token "
            "ids: student and teacher must share one vocabulary")
    if getattr(cfg, "teacher_mode", "raw") != "raw":
        add("teacher_mode", cfg.teacher_mode, True, "verl's teacher reads the response without our teacher context")
    if cfg.selection.mode != "all":
        add("selection.mode", cfg.selection.mode, False, "verl puts every response position through the loss")
    if ro.min_new_tokens:
        add("rollout.min_new_tokens", ro.min_new_tokens, False, "verl 0.8 cannot hold back EOS: "
            "actor_rollout_ref.rollout.ignore_eos is accepted but never used (verl/workers/config/rollout.py:193)")
    if cfg.data.truncation in ("right", "middle"):
        add("data.truncation", cfg.data.truncation, False, "verl 0.8 never reads data.truncation "
            "(verl/utils/dataset/rl_dataset.py:115); its agent loop keeps a long prompt's last tokens")
    for role in ("student", "teacher"):
        if getattr(cfg, role).quant != "none":
            add(f"{role}.quant", getattr(cfg, role).quant, False, "verl loads the exported weights unquantized")
    return dev


def overrides(cfg, size, cont: dict, num_train: int) -> list[tuple[str, object]]:
    """(key, value) pairs, in order, for verl's ppo_trainer config. Paths are relative to the bundle
    (launch.sh makes them absolute). `size`: sizing.Sizing; `cont`: the continuation (warm start)."""
    ob, ro = cfg.objective, cfg.rollout
    task, pg = ob.name == "pg_k1_rewarded", ob.use_policy_gradient
    adv = {"leave_one_out": ("rloo", True), "group_centered": ("grpo", False)}.get(ob.advantage, ("grpo", True))
    floor = None if ob.log_prob_min_clamp <= rules.NO_FLOOR else ob.log_prob_min_clamp
    low = ob.clip_ratio_low if ob.clip_ratio_low is not None else ob.clip_ratio
    high = ob.clip_ratio_high if ob.clip_ratio_high is not None else ob.clip_ratio
    steps = cont["steps"]
    per_epoch = max(1, num_train // ro.batch_size)  # verl's train dataloader drops the last partial batch
    kv: list[tuple[str, object]] = [
        ("data.train_files", "data/train.parquet"),
        ("data.val_files", "data/test.parquet"),
        ("data.prompt_key", cfg.data.prompt_key),
        ("data.max_prompt_length", cfg.data.max_prompt_tokens),
        ("data.max_response_length", ro.max_new_tokens),
        ("data.train_batch_size", ro.batch_size),
        ("data.filter_overlong_prompts", False),
        ("data.trust_remote_code", cfg.student.trust_remote_code),
        ("actor_rollout_ref.model.path", "base"),
        ("actor_rollout_ref.model.trust_remote_code", cfg.student.trust_remote_code),
        ("actor_rollout_ref.model.lora_rank", cfg.lora.r),
        ("actor_rollout_ref.model.lora_adapter_path", "adapter"),
        (f"{A}.optim.lr", cfg.optim.lr),
        (f"{A}.optim.weight_decay", cfg.optim.weight_decay),
        (f"{A}.optim.betas", [cfg.optim.beta1, cfg.optim.beta2]),
    ]
    if cfg.optim.eps != 1e-8:  # torch's AdamW default, which verl's build_optimizer leaves in place
        kv.append((f"{A}.optim.override_optimizer_config", {"eps": cfg.optim.eps}))
    kv += [
        (f"{A}.optim.clip_grad", cfg.optim.max_grad_norm),
        (f"{A}.optim.lr_warmup_steps", cont["warmup_steps"]),
        (f"{A}.optim.lr_scheduler_type", "constant"),
        (f"{A}.ppo_mini_batch_size", ro.batch_size),
        (f"{A}.ppo_micro_batch_size_per_gpu", size.micro_batch),
        (f"{A}.ppo_epochs", 1),
        (f"{A}.loss_agg_mode", ob.loss_agg_mode),
        (f"{A}.use_kl_loss", False),
    ]
    if task:
        kv += [(f"{A}.entropy_coeff", 0), (f"{A}.clip_ratio", ob.clip_ratio), (f"{A}.clip_ratio_low", low),
               (f"{A}.clip_ratio_high", high)]
    kv += [
        (f"{R}.name", "vllm"),
        (f"{R}.n", ro.n),
        (f"{R}.temperature", ro.temperature),
        (f"{R}.top_p", ro.top_p),
        (f"{R}.tensor_model_parallel_size", 1),
        (f"{R}.gpu_memory_utilization", size.rollout_util),
        (f"{R}.log_prob_micro_batch_size_per_gpu", size.micro_batch),
        ("algorithm.adv_estimator", adv[0]),
    ]
    if task and adv[0] == "grpo":
        kv.append(("algorithm.norm_adv_by_std_in_grpo", adv[1]))
    kv += [
        ("algorithm.use_kl_in_reward", False),
        ("distillation.enabled", True),
        ("distillation.n_gpus_per_node", size.teacher_per_group),
        ("distillation.nnodes", size.teacher_groups),
        (f"{T}.model_path", "teacher"),
        (f"{T}.inference.tensor_model_parallel_size", size.teacher_tp),
        (f"{T}.inference.gpu_memory_utilization", size.teacher_util),
        (f"{D}.loss_mode", VERL_LOSS.get(ob.name, ob.name)),
        (f"{D}.topk", ob.topk),
        (f"{D}.use_task_rewards", task),
    ]
    if task:
        kv.append((f"{D}.distillation_loss_coef", ob.distill_coef))
    kv += [(f"{D}.loss_max_clamp", ob.loss_max_clamp), (f"{D}.log_prob_min_clamp", floor),
           (f"{D}.use_policy_gradient", pg)]
    if pg:
        kv += [(f"{D}.clip_ratio", ob.clip_ratio), (f"{D}.clip_ratio_low", low), (f"{D}.clip_ratio_high", high)]
    kv += [
        ("reward.custom_reward_function.path", "reward.py"),
        ("reward.custom_reward_function.name", "compute_score"),
        ("trainer.n_gpus_per_node", size.actor_per_group),
        ("trainer.nnodes", size.actor_groups),
        ("trainer.total_training_steps", steps),
        ("trainer.total_epochs", math.ceil(steps / per_epoch)),
        ("trainer.logger", ["console"]),
        ("trainer.project_name", "opd-stages"),
        ("trainer.experiment_name", cfg.run),
    ]
    missing = [k for k, _ in kv if k not in USES]
    assert not missing, missing  # every written key has a documented use
    return kv
