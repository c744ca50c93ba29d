"""How every field of verl 0.8's PPO trainer config maps onto ours: one rule per field or subtree.

Each rule classifies a verl leaf as
    exact                   same meaning here, value copied to our key(s)
    reinterpreted           honoured with a different mechanism (e.g. our sampler instead of vLLM);
                            from an external config file it must be accepted explicitly (--accept)
    ignored-informational   no effect on what is computed here (logging, kernels, micro-batching)
    unsupported             cannot be honoured; planning fails closed, naming the field
and `allowed` narrows a rule to the values we can honour (anything else is unsupported). The
compatibility table in docs/compat.md, `opd compat explain` and `opd profiles show` are generated
from this table, so the documentation cannot drift from the code.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

EXACT, REINTERP, INFO, UNSUP = "exact", "reinterpreted", "ignored-informational", "unsupported"
KINDS = (EXACT, REINTERP, INFO, UNSUP)
OUR_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NO_FLOOR = -1.0e30  # verl's log_prob_min_clamp = null: no floor (identical for finite log-probs)


@dataclass(frozen=True)
class Allow:
    """The values a rule can honour: a description for docs and errors, and the test."""
    desc: str
    test: Callable[[Any, dict], bool]


def only(*values) -> Allow:
    return Allow(" or ".join(json.dumps(v) for v in values), lambda v, ctx: v in values)


def same_as(other: str) -> Allow:
    return Allow(f"equal to {other}", lambda v, ctx: v == ctx.get(other))


AT_MOST_ONE = Allow("0 or 1 (one GPU)", lambda v, ctx: v in (0, 1))
ONE = only(1)
NULL = only(None)
FALSE = only(False)
POS_INT = Allow("a positive integer", lambda v, ctx: isinstance(v, int) and not isinstance(v, bool) and v > 0)
PLACEHOLDERS = (None, "???", "~/models/deepseek-llm-7b-chat")  # verl's defaults name no real model
SET = Allow("a model set by the config (not null, not verl's placeholder)", lambda v, ctx: v not in PLACEHOLDERS)


@dataclass(frozen=True)
class Rule:
    pattern: str  # dotted; `*` = one segment, a trailing `**` = any subtree
    kind: str
    ours: tuple[str, ...] = ()
    note: str = ""
    allowed: Optional[Allow] = None
    # (value, ctx) -> {our key: value}; default: every key in `ours` takes the value
    convert: Optional[Callable[[Any, dict], dict]] = None

    def specificity(self) -> tuple:
        parts = self.pattern.split(".")
        return (sum(p not in ("*", "**") for p in parts), "**" not in parts, len(parts))


def _task(ctx: dict) -> bool:
    return bool(ctx.get("distillation.distillation_loss.use_task_rewards"))


def _objective(v: Any, ctx: dict) -> dict:
    """verl's (loss_mode, use_task_rewards) pair -> our objective.name."""
    mode = "k1" if v == "kl" else v  # verl registers "kl" as an alias of k1
    if _task(ctx):
        return {"objective.name": "pg_k1_rewarded"}
    return {"objective.name": mode}


def _objective_ok(v: Any, ctx: dict) -> bool:
    if v in ("k1", "kl") and not ctx.get("distillation.distillation_loss.use_policy_gradient"):
        return False  # verl refuses k1 as a supervised loss: its gradient ignores the teacher
    if _task(ctx):
        return v in ("k1", "kl")
    return v in ("forward_kl_topk", "k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs")


def _advantage(v: Any, ctx: dict) -> dict:
    if not _task(ctx):
        return {}
    if v == "rloo":
        return {"objective.advantage": "leave_one_out"}
    norm = ctx.get("algorithm.norm_adv_by_std_in_grpo", True)
    return {"objective.advantage": "group_standardized" if norm else "group_centered"}


def _train_files(v: Any, ctx: dict) -> dict:
    if v is None:
        return {}
    return {"data.path": os.path.expanduser(v[0] if isinstance(v, (list, tuple)) else v)}


def _val_files(v: Any, ctx: dict) -> dict:
    first = v[0] if isinstance(v, (list, tuple)) and len(v) == 1 else v
    train = ctx.get("data.train_files")
    train = train[0] if isinstance(train, (list, tuple)) and len(train) == 1 else train
    return {} if first is None or first == train else {"data.eval_path": os.path.expanduser(first)}


def _one_file(v: Any, ctx: dict) -> bool:
    return v is None or isinstance(v, str) or (isinstance(v, (list, tuple)) and len(v) == 1)


def _warmup(v: Any, ctx: dict) -> dict:
    steps = ctx.get("actor_rollout_ref.actor.optim.lr_warmup_steps", -1)
    if steps is not None and steps >= 0:
        return {"optim.warmup_updates": int(steps)}
    ratio = ctx.get("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio") or 0.0
    total = ctx.get("trainer.total_training_steps") or 0
    return {"optim.warmup_updates": int(math.floor(ratio * total))}


def _lora_targets(v: Any, ctx: dict) -> dict:
    return {"lora.target_modules": OUR_PROJECTIONS if v == "all-linear" else list(v)}


def _floor(v: Any, ctx: dict) -> dict:
    return {"objective.log_prob_min_clamp": NO_FLOOR if v is None else v}


def _betas(v: Any, ctx: dict) -> dict:
    return {"optim.beta1": float(v[0]), "optim.beta2": float(v[1])}


def _device(v: Any, ctx: dict) -> dict:
    return {"runtime.device": "auto" if v == "cuda" else v}


def _pg_clip(our: str) -> Callable[[Any, dict], dict]:
    return lambda v, ctx: {our: float(v)}


def _task_clip(name: str) -> Allow:
    other = f"distillation.distillation_loss.{name}"
    return Allow(f"equal to {other} when use_task_rewards (one clip band for both PPO losses)",
                 lambda v, ctx: not _task(ctx) or v == ctx.get(other))


A, R, D, M = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "distillation.distillation_loss", \
    "actor_rollout_ref.model"
T = "distillation.teacher_models.teacher_model"
KERNEL = "kernels, memory layout or micro-batching only: the same math"
PG_ONLY = ("read only with use_policy_gradient, here and in verl (verl/trainer/distillation/losses.py:257); "
           "ignored otherwise")

RULES: list[Rule] = [
    # ---- data ----
    Rule("data.train_files", EXACT, ("data.path",), "one verl-schema Parquet; null keeps our shipped prompt "
         "generator (data.generator)", Allow("null, a path or a one-element list", lambda v, c: _one_file(v, c)),
         _train_files),
    Rule("data.val_files", EXACT, ("data.eval_path",), "evaluation rows; null or the train file: its "
         "extra_info.split == 'test' rows", Allow("null, a path or a one-element list", lambda v, c: _one_file(v, c)),
         _val_files),
    Rule("data.train_max_samples", REINTERP, ("data.num_train",), "-1 keeps data.num_train; N > 0 takes the "
         "first N rows (verl samples N at random)", convert=lambda v, c: {"data.num_train": v} if v and v > 0 else {}),
    Rule("data.val_max_samples", REINTERP, ("data.num_eval",), "-1 keeps data.num_eval; N > 0 takes the first "
         "N evaluation rows", convert=lambda v, c: {"data.num_eval": v} if v and v > 0 else {}),
    Rule("data.prompt_key", EXACT, ("data.prompt_key",), "the chat-messages column"),
    Rule("data.max_prompt_length", EXACT, ("data.max_prompt_tokens",), "chat-templated prompt tokens", POS_INT),
    Rule("data.max_response_length", EXACT, ("rollout.max_new_tokens", "eval.max_new_tokens"),
         "sampled and evaluated response length", POS_INT),
    Rule("data.train_batch_size", EXACT, ("rollout.batch_size",), "prompts per update (each sampled rollout.n "
         "times)", POS_INT),
    Rule("data.truncation", REINTERP, ("data.truncation",), "verl 0.8 assigns it and never reads it "
         "(verl/utils/dataset/rl_dataset.py:115); its agent loop keeps a long prompt's last max_prompt_length "
         "tokens (verl/experimental/agent_loop/agent_loop.py:356). left is that; error stops instead (no completed "
         "run differs); right and middle would compute what verl does not", only("error", "left")),
    Rule("data.filter_overlong_prompts", INFO, (), "over-long prompts are an error or truncated "
         "(data.truncation), never dropped", FALSE),
    Rule("data.shuffle", INFO, (), "each epoch is a seeded permutation of the prompts", only(True)),
    Rule("data.seed", INFO, (), "batch order is seeded from the prompt set's digest"),
    Rule("data.tokenizer", INFO, (), "the student's own tokenizer is used (the teacher must share it)", NULL),
    Rule("data.custom_cls.*", INFO, (), "custom dataset classes are not loaded", NULL),
    Rule("data.apply_chat_template_kwargs", INFO, (), "the chat template is applied with its defaults",
         only({})),
    Rule("data.tool_config_path", INFO, (), "verl tool agents are not mapped (use our envs)", NULL),
    Rule("data.function_tool_path", INFO, (), "verl tool agents are not mapped (use our envs)", NULL),
    Rule("data.**", INFO, (), "data loading mechanics (workers, shared memory, multimodal keys)"),
    # ---- student model ----
    Rule(f"{M}.path", EXACT, ("student.name",), "the student: a Hugging Face id or a local dir", SET),
    Rule(f"{M}.trust_remote_code", EXACT, ("student.trust_remote_code",)),
    Rule(f"{M}.lora_rank", EXACT, ("lora.r",), "full fine-tuning (0) is not supported: the student trains a LoRA",
         POS_INT),
    Rule(f"{M}.lora_alpha", EXACT, ("lora.alpha",), allowed=POS_INT),
    Rule(f"{M}.target_modules", EXACT, ("lora.target_modules",), "'all-linear' means the 7 attention and MLP "
         "projections", convert=_lora_targets),
    Rule(f"{M}.exclude_modules", INFO, (), "", NULL),
    Rule(f"{M}.lora_adapter_path", INFO, (), "training starts from a fresh LoRA (B = 0)", NULL),
    Rule(f"{M}.hf_config_path", INFO, (), "the model dir's own config is used", NULL),
    Rule(f"{M}.tokenizer_path", INFO, (), "the model dir's own tokenizer is used", NULL),
    Rule(f"{M}.custom_chat_template", INFO, (), "the tokenizer's own chat template is used", NULL),
    Rule(f"{M}.external_lib", INFO, (), "no external model code is imported", NULL),
    Rule(f"{M}.override_config", INFO, (), "the model config is used as shipped", only({})),
    Rule(f"{M}.lora.rank", INFO, (), "megatron-style LoRA block: use lora_rank", only(0)),
    Rule(f"{M}.mtp.enable", INFO, (), "multi-token prediction is not used", FALSE),
    Rule(f"{M}.**", INFO, (), KERNEL),
    # ---- actor (the update) ----
    Rule(f"{A}.optim.optimizer", INFO, (), "AdamW over the LoRA parameters", only("AdamW")),
    Rule(f"{A}.optim.optimizer_impl", INFO, (), "", only("torch.optim")),
    Rule(f"{A}.optim.lr", EXACT, ("optim.lr",)),
    Rule(f"{A}.optim.weight_decay", EXACT, ("optim.weight_decay",)),
    Rule(f"{A}.optim.betas", EXACT, ("optim.beta1", "optim.beta2"), convert=_betas),
    Rule(f"{A}.optim.clip_grad", EXACT, ("optim.max_grad_norm",)),
    Rule(f"{A}.optim.lr_warmup_steps", REINTERP, ("optim.warmup_updates",), "linear warmup W (-1: the ratio); "
         "verl's update k runs at (k-1)/W of the LR, the first at 0 (verl/utils/torch_functional.py:780), ours at "
         "k/W: the same from update W on", convert=_warmup),
    Rule(f"{A}.optim.lr_warmup_steps_ratio", REINTERP, ("optim.warmup_updates",), "ratio x "
         "trainer.total_training_steps, rounded down (used when lr_warmup_steps = -1)", convert=_warmup),
    Rule(f"{A}.optim.lr_scheduler_type", INFO, (), "no decay: a step's result must not depend on the run's "
         "total length (steps are reused across runs)", only("constant")),
    Rule(f"{A}.optim.warmup_style", INFO, (), "", only(None, "constant")),
    Rule(f"{A}.optim.override_optimizer_config", INFO, (), "", NULL),
    Rule(f"{A}.optim.**", INFO, (), "scheduler details unused with a constant schedule"),
    Rule(f"{A}.ppo_mini_batch_size", INFO, (), "one optimizer step per rollout (strictly on-policy)",
         same_as("data.train_batch_size")),
    Rule(f"{A}.ppo_epochs", INFO, (), "each rollout is consumed exactly once", ONE),
    Rule(f"{A}.loss_agg_mode", EXACT, ("objective.loss_agg_mode",)),
    Rule(f"{A}.clip_ratio", INFO, (), "task-reward PPO loss", _task_clip("clip_ratio")),
    Rule(f"{A}.clip_ratio_low", INFO, (), "task-reward PPO loss", _task_clip("clip_ratio_low")),
    Rule(f"{A}.clip_ratio_high", INFO, (), "task-reward PPO loss", _task_clip("clip_ratio_high")),
    Rule(f"{A}.clip_ratio_c", INFO, (), "dual-clip bound of the PPO loss", only(3.0, 3)),
    Rule(f"{A}.policy_loss.loss_mode", INFO, (), "vanilla PPO", only("vanilla")),
    Rule(f"{A}.loss_scale_factor", INFO, (), "", NULL),
    Rule(f"{A}.entropy_coeff", INFO, (), "no entropy bonus", only(0, 0.0)),
    Rule(f"{A}.use_kl_loss", INFO, (), "no reference-model KL loss", FALSE),
    Rule(f"{A}.ulysses_sequence_parallel_size", INFO, (), "sequence parallelism needs several GPUs", ONE),
    Rule(f"{A}.fsdp_config.param_offload", INFO, (), "FSDP offload", FALSE),
    Rule(f"{A}.fsdp_config.optimizer_offload", INFO, (), "FSDP offload", FALSE),
    Rule(f"{A}.fsdp_config.offload_policy", INFO, (), "FSDP offload", FALSE),
    Rule(f"{A}.fsdp_config.ulysses_sequence_parallel_size", INFO, (), "sequence parallelism", ONE),
    Rule(f"{A}.fsdp_config.fsdp_size", INFO, (), "sharding needs several GPUs", only(-1, 1)),
    Rule(f"{A}.*.qat.enable", INFO, (), "quantization-aware training", FALSE),
    Rule(f"{A}.qat.enable", INFO, (), "quantization-aware training", FALSE),
    Rule(f"{A}.grad_clip", INFO, (), "unused by verl 0.8's FSDP engine (it clips with optim.clip_grad)"),
    Rule(f"{A}.**", INFO, (), KERNEL),
    # ---- rollout (sampling) ----
    Rule(f"{R}.name", REINTERP, (), "our sampler (static KV cache, CUDA-graph decode) replaces the inference "
         "server; same sampling distribution", Allow("an engine name", lambda v, c: v not in (None, "???"))),
    Rule(f"{R}.n", EXACT, ("rollout.n",), "samples per prompt (grouped)", POS_INT),
    Rule(f"{R}.temperature", EXACT, ("rollout.temperature",), "sampling and loss temperature (one for both)"),
    Rule(f"{R}.top_p", EXACT, ("rollout.top_p",)),
    Rule(f"{R}.top_k", INFO, (), "no top-k truncation of sampling", only(-1, 0)),
    Rule(f"{R}.do_sample", INFO, (), "on-policy sampling", only(True)),
    Rule(f"{R}.ignore_eos", INFO, (), "verl 0.8 declares it (verl/workers/config/rollout.py:193) and never "
         "passes it to sampling (verl/experimental/agent_loop/agent_loop.py:496): true would mean EOS suppressed "
         "here and sampled in verl", FALSE),
    Rule(f"{R}.prompt_length", INFO, (), "", same_as("data.max_prompt_length")),
    Rule(f"{R}.response_length", INFO, (), "", same_as("data.max_response_length")),
    Rule(f"{R}.tensor_model_parallel_size", INFO, (), "tensor parallelism needs several GPUs", ONE),
    Rule(f"{R}.data_parallel_size", INFO, (), "", ONE),
    Rule(f"{R}.expert_parallel_size", INFO, (), "", ONE),
    Rule(f"{R}.pipeline_model_parallel_size", INFO, (), "pipeline parallelism needs several GPUs", ONE),
    Rule(f"{R}.nnodes", INFO, (), "", only(0, 1)),
    Rule(f"{R}.over_sample_rate", INFO, (), "", only(0, 0.0)),
    Rule(f"{R}.multi_turn.enable", INFO, (), "verl multi-turn agent loops are not mapped (use our envs)", FALSE),
    Rule(f"{R}.val_kwargs.do_sample", INFO, (), "evaluation decodes greedily", FALSE),
    Rule(f"{R}.val_kwargs.n", INFO, (), "", ONE),
    Rule(f"{R}.quantization", INFO, (), "", NULL),
    Rule(f"{R}.disaggregation.enabled", INFO, (), "", FALSE),
    Rule(f"{R}.enable_rollout_routing_replay", INFO, (), "", FALSE),
    Rule(f"{R}.**", INFO, (), "inference-server settings (memory, batching, kernels, logging)"),
    Rule("actor_rollout_ref.ref.**", INFO, (), "no reference model (use_kl_loss and use_kl_in_reward are false)"),
    Rule("actor_rollout_ref.*", INFO, (), "process topology"),
    # ---- distillation ----
    Rule("distillation.enabled", INFO, (), "this is an on-policy distillation tool", only(True)),
    Rule(f"{D}.loss_mode", EXACT, ("objective.name",), "k1 with use_task_rewards is pg_k1_rewarded; 'kl' is k1",
         Allow("forward_kl_topk, k1/kl (with use_policy_gradient), k2/mse, k3/low_var_kl or abs; k1 when "
               "use_task_rewards", _objective_ok),
         _objective),
    Rule(f"{D}.topk", EXACT, ("objective.topk",), allowed=POS_INT),
    Rule(f"{D}.use_task_rewards", REINTERP, (), "true: the task reward is our rule reward (stages/rows/rewards.py) "
         "instead of verl's reward function", convert=lambda v, c: {}),
    Rule(f"{D}.distillation_loss_coef", EXACT, ("objective.distill_coef",), "used only with use_task_rewards",
         convert=lambda v, c: {"objective.distill_coef": v} if _task(c) else {}),
    Rule(f"{D}.loss_max_clamp", EXACT, ("objective.loss_max_clamp",)),
    Rule(f"{D}.log_prob_min_clamp", EXACT, ("objective.log_prob_min_clamp",), f"null: no floor ({NO_FLOOR:g})",
         convert=_floor),
    Rule(f"{D}.use_policy_gradient", EXACT, ("objective.use_policy_gradient",)),
    Rule(f"{D}.policy_loss_mode", INFO, (), "vanilla PPO", only("vanilla")),
    Rule(f"{D}.clip_ratio", EXACT, ("objective.clip_ratio",), PG_ONLY, convert=_pg_clip("objective.clip_ratio")),
    Rule(f"{D}.clip_ratio_low", EXACT, ("objective.clip_ratio_low",), PG_ONLY,
         convert=_pg_clip("objective.clip_ratio_low")),
    Rule(f"{D}.clip_ratio_high", EXACT, ("objective.clip_ratio_high",), PG_ONLY,
         convert=_pg_clip("objective.clip_ratio_high")),
    Rule("distillation.n_gpus_per_node", REINTERP, (), "the teacher shares the student's device (verl needs a "
         "separate teacher pool)", AT_MOST_ONE),
    Rule("distillation.nnodes", REINTERP, (), "the teacher shares the student's device", AT_MOST_ONE),
    Rule(f"{T}.model_path", EXACT, ("teacher.name",), "the teacher: a Hugging Face id or a local dir", SET),
    Rule(f"{T}.num_replicas", INFO, (), "one resident teacher", AT_MOST_ONE),
    Rule(f"{T}.inference.tensor_model_parallel_size", INFO, (), "tensor parallelism needs several GPUs", ONE),
    Rule(f"{T}.inference.data_parallel_size", INFO, (), "", ONE),
    Rule(f"{T}.inference.expert_parallel_size", INFO, (), "", ONE),
    Rule(f"{T}.inference.temperature", INFO, (), "one temperature for sampling and both log-prob sets",
         same_as(f"{R}.temperature")),
    Rule(f"{T}.inference.name", REINTERP, (), "the teacher scores in-process (score stage), no inference server"),
    Rule(f"{T}.**", INFO, (), "teacher inference-server settings"),
    Rule("distillation.teacher_models.*.**", UNSUP, (), "several teachers (or a renamed teacher entry): one "
         "teacher, in teacher_models.teacher_model"),
    Rule("distillation.teacher_key", INFO, (), "one teacher: no routing"),
    # ---- algorithm ----
    Rule("algorithm.adv_estimator", EXACT, ("objective.advantage",), "with use_task_rewards: grpo -> "
         "group_standardized (group_centered without std), rloo -> leave_one_out; unused otherwise",
         Allow("grpo or rloo when use_task_rewards", lambda v, c: not _task(c) or v in ("grpo", "rloo")),
         _advantage),
    Rule("algorithm.norm_adv_by_std_in_grpo", EXACT, ("objective.advantage",), "see adv_estimator",
         convert=lambda v, c: _advantage(c.get("algorithm.adv_estimator"), c)
         if c.get("algorithm.adv_estimator") == "grpo" else {}),
    Rule("algorithm.use_kl_in_reward", INFO, (), "no reference-model KL reward", FALSE),
    Rule("algorithm.use_pf_ppo", INFO, (), "", FALSE),
    Rule("algorithm.rollout_correction.rollout_is", INFO, (), "strictly on-policy: no importance correction",
         NULL),
    Rule("algorithm.rollout_correction.rollout_rs", INFO, (), "strictly on-policy: no rejection sampling", NULL),
    Rule("algorithm.rollout_correction.bypass_mode", INFO, (), "", FALSE),
    Rule("algorithm.**", INFO, (), "outcome rewards: discounting and KL control are unused"),
    # ---- trainer ----
    Rule("trainer.total_training_steps", EXACT, ("train.updates",), "number of updates", POS_INT),
    Rule("trainer.n_gpus_per_node", INFO, (), "one device", ONE),
    Rule("trainer.nnodes", INFO, (), "one machine", ONE),
    Rule("trainer.device", REINTERP, ("runtime.device",), "cuda: runtime.device=auto (CUDA when present, else "
         "the CPU)", only("cuda", "cpu"), _device),
    Rule("trainer.val_only", INFO, (), "use `opd stage evaluate`", FALSE),
    Rule("trainer.resume_mode", INFO, (), "resumption is automatic: published stages are never recomputed"),
    Rule("trainer.**", INFO, (), "logging, checkpoint cadence and naming"),
    # ---- reward and the rest ----
    Rule("custom_reward_function.path", INFO, (), "task rewards use our rule reward", NULL),
    Rule("reward.custom_reward_function.path", INFO, (), "task rewards use our rule reward", NULL),
    Rule("reward.reward_model.enable", INFO, (), "no reward model", FALSE),
    Rule("reward_model.enable", INFO, (), "no reward model", only(None, False)),
    Rule("reward.**", INFO, (), "reward-manager mechanics"),
    Rule("reward_model.**", INFO, (), "legacy reward-model section"),
    Rule("critic.**", INFO, (), "no critic: the advantage estimators here are critic-free"),
    Rule("transfer_queue.enable", INFO, (), "", FALSE),
    Rule("**", INFO, (), "process, profiling and cluster plumbing"),
]


def _regex(pattern: str) -> re.Pattern:
    parts = []
    for p in pattern.split("."):
        parts.append(r"[^.]+" if p == "*" else r".+" if p == "**" else re.escape(p))
    return re.compile(r"\.".join(parts) + r"\Z")


_COMPILED = sorted(((r.specificity(), i, _regex(r.pattern), r) for i, r in enumerate(RULES)),
                   key=lambda t: (t[0], -t[1]), reverse=True)


def rule_for(key: str) -> Rule:
    """The most specific rule matching a dotted verl key (`**` alone matches everything)."""
    for _, _, rx, rule in _COMPILED:
        if rule.pattern == "**" or rx.match(key):
            return rule
    raise AssertionError(key)  # unreachable: the catch-all rule matches every key
