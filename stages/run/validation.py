"""Range, choice and combination checks of a composed config that its types cannot express; each
failure is a UserError naming the key (stages/run/config.py calls `validate` on every config it builds)."""
from __future__ import annotations

import re
from typing import Any

from .. import envs, objectives
from ..envs.task import check_split
from . import selection
from ..errors import UserError

CHOICES = {
    "memory.placement": ("auto", "resident", "swap", "shared_backbone"),
    "student.init": ("pretrained", "random"),
    "teacher.init": ("pretrained", "random"),
    "student.quant": ("none", "nf4", "int8"),
    "teacher.quant": ("none", "nf4", "int8"),
    "objective.loss_agg_mode": ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "objective.advantage": ("raw", "group_centered", "group_standardized", "leave_one_out"),
    "objective.divergence": ("forward", "reverse", "jsd"),
    "objective.cross_tokenizer": ("off", "spans"),
    "rollout.sampler": ("student", "teacher"),
    "export.policy": ("final", "best"),
    "runtime.device": ("auto", "cpu", "cuda"),
    "runtime.dtype": ("auto", "float32", "bfloat16"),
    "teacher_mode": ("raw", "privileged_context", "protocol_sft"),
    "data.truncation": ("error", "left", "right", "middle"),
    "selection.mode": ("all", "uniform_ratio", "uniform_budget", "hybrid"),
}
POSITIVE = (
    "data.num_train", "data.num_eval", "data.max_prompt_tokens", "rollout.batch_size", "rollout.n",
    "rollout.max_new_tokens", "objective.topk", "lora.r", "lora.alpha", "train.updates", "train.chunk",
    "eval.max_new_tokens", "eval.chunk", "rollout.top_p", "optim.lr",
    "objective.full_vocab_limit",
    "env.max_turns", "env.max_tokens_per_turn", "env.num_train", "env.num_test", "sft.batch_size", "sft.lr",
)
NON_NEGATIVE = ("student.keep_layers", "teacher.keep_layers", "rollout.min_new_tokens", "optim.warmup_updates",
                "rollout.temperature",
                "runtime.threads", "optim.weight_decay", "optim.max_grad_norm", "sft.steps", "sft.teacher_steps",
                "eval.every")


# `run` names artifacts/runs/<run> and artifacts/export/<run>: a plain name, so that no config value
# can make a write land outside the artifacts dir (`run=../../etc`, `run=/tmp/x` are refused)
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def get(cfg: Any, dotted: str) -> Any:
    """cfg.a.b for 'a.b'."""
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


# optim.lr, optim.warmup_updates left null: (lr, warmup) by whether the student keeps all of a pretrained
# model. Pruned (the embedded default keeps 24 of 30 layers) or random: it must heal, and the default
# sweep chose 2e-3. Intact: 1e-4 with warmup, as 5e-4 left Qwen2.5-Coder-0.5B worse than it started
# (docs/performance.md#the-learning-rate)
HEALING = (2e-3, 0)
INTACT = (1e-4, 4)


def optim_for(cfg) -> tuple[float, int]:
    """The (lr, warmup_updates) a null optim.lr / optim.warmup_updates stand for."""
    s = cfg.student
    return HEALING if s.keep_layers > 0 or s.init != "pretrained" else INTACT


def validate(cfg, source: str = "config"):
    """Range and choice checks the type system cannot express; raise UserError naming the key. Fills a
    null optim.lr / optim.warmup_updates from the setting (optim_for), so that digests hold numbers."""
    lr, warmup = optim_for(cfg)
    if cfg.optim.lr is None:
        cfg.optim.lr = lr
    if cfg.optim.warmup_updates is None:
        cfg.optim.warmup_updates = warmup
    for key, allowed in CHOICES.items():
        if get(cfg, key) not in allowed:
            raise UserError(f"{source}: key '{key}' = {get(cfg, key)!r}; expected one of {', '.join(allowed)}")
    for key in POSITIVE:
        if not get(cfg, key) > 0:
            raise UserError(f"{source}: key '{key}' = {get(cfg, key)!r}; expected a positive number")
    for key in NON_NEGATIVE:
        if not get(cfg, key) >= 0:  # (NaN too)
            raise UserError(f"{source}: key '{key}' = {get(cfg, key)!r}; expected >= 0")
    if cfg.rollout.top_p > 1:
        raise UserError(f"{source}: key 'rollout.top_p' = {cfg.rollout.top_p}; expected a value in (0, 1]")
    for key in ("optim.beta1", "optim.beta2"):  # else torch refuses them mid-run, after work was done
        if not 0 <= get(cfg, key) < 1:
            raise UserError(f"{source}: key '{key}' = {get(cfg, key)!r}; expected a value in [0, 1)")
    if not cfg.optim.eps > 0:
        raise UserError(f"{source}: key 'optim.eps' = {cfg.optim.eps!r}; expected a positive number")
    if not RUN_NAME.fullmatch(str(cfg.run)):
        raise UserError(f"{source}: key 'run' = {cfg.run!r}; expected a plain name (letters, digits, '.', '_', "
                        "'-'; no '/', no leading '.'): it names dirs inside the artifacts dir")
    if cfg.rollout.min_new_tokens > cfg.rollout.max_new_tokens:
        raise UserError(f"{source}: key 'rollout.min_new_tokens' exceeds 'rollout.max_new_tokens'")
    if cfg.objective.name not in objectives.REGISTRY:
        raise UserError(f"{source}: key 'objective.name' = {cfg.objective.name!r}; expected one of "
                        f"{', '.join(sorted(objectives.REGISTRY))}")
    objectives.check(cfg.objective, source)
    _check_cross_tokenizer(cfg, source)
    _check_sampler(cfg, source)
    _check_tooluse(cfg, source)
    _check_memory(cfg, source)
    selection.check(cfg.selection, source)
    return cfg


def _check_cross_tokenizer(cfg, source: str) -> None:
    """objective.cross_tokenizer=spans: the span-wise objectives, on plain prompts (stages/align.py)."""
    if cfg.objective.cross_tokenizer == "off":
        return
    name = cfg.objective.name
    if name not in objectives.SPAN_WISE:
        raise UserError(f"{source}: key 'objective.cross_tokenizer' = 'spans' with objective {name!r}; expected one "
                        f"of {', '.join(sorted(objectives.SPAN_WISE))} (the others compare whole distributions over "
                        "one vocabulary)")
    for key, bad in (("selection.mode", cfg.selection.mode != "all"), ("env.name", cfg.env.name is not None),
                     ("sft.steps", cfg.sft.steps > 0)):
        if bad:
            raise UserError(f"{source}: key '{key}' = {get(cfg, key)!r} is not supported with "
                            "objective.cross_tokenizer=spans (single-turn prompts, every position scored)")


def _check_sampler(cfg, source: str) -> None:
    """rollout.sampler=teacher, the off-policy control: SFT (objective nll) on single-turn teacher samples.
    Every other objective is an estimator over the student's own samples, wrong on the teacher's."""
    if cfg.rollout.sampler == "student":
        return
    if cfg.objective.name != "nll":
        raise UserError(f"{source}: key 'rollout.sampler' = 'teacher' needs objective.name=nll (it is "
                        f"{cfg.objective.name!r}: the others are on-policy estimators, wrong on teacher samples)")
    if cfg.env.name is not None:
        raise UserError(f"{source}: key 'env.name' = {cfg.env.name!r} is not supported with rollout.sampler=teacher "
                        "(the teacher samples single-turn prompts only; set env.name=null)")


def _check_memory(cfg, source: str) -> None:
    m = cfg.memory
    if m.vram_gib is not None and not m.vram_gib > 0:
        raise UserError(f"{source}: key 'memory.vram_gib' = {m.vram_gib}; expected a positive number of GiB or null")
    if not 0 <= m.margin < 1:
        raise UserError(f"{source}: key 'memory.margin' = {m.margin}; expected a fraction in [0, 1)")
    if not m.chunk_floor > 0:
        raise UserError(f"{source}: key 'memory.chunk_floor' = {m.chunk_floor}; expected a positive number")
    if m.merge_in_place and cfg.student.quant != "none":
        raise UserError(f"{source}: key 'memory.merge_in_place' = true needs student.quant=none (it is "
                        f"{cfg.student.quant!r}: a quantized base is sampled from a dense copy, nothing to merge into)")
    for role in ("student", "teacher"):
        mc = getattr(cfg, role)
        if mc.double_quant and mc.quant != "nf4":
            raise UserError(f"{source}: key '{role}.double_quant' = true needs {role}.quant=nf4 (it is {mc.quant!r})")
        if not mc.dense_copy and mc.quant != "nf4":
            raise UserError(f"{source}: key '{role}.dense_copy' = false needs {role}.quant=nf4 (it is {mc.quant!r}: "
                            "only an NF4 base is sampled from a dense copy)")


def _check_tooluse(cfg, source: str) -> None:
    """env / sft / teacher_mode combinations (the environment registry names the bad key itself)."""
    if cfg.env.name is None:
        for key, bad in (("sft.steps", cfg.sft.steps > 0), ("teacher_mode", cfg.teacher_mode != "raw")):
            if bad:
                raise UserError(f"{source}: key '{key}' = {get(cfg, key)!r} needs a tool environment; set env.name")
        return
    try:
        check_split(cfg.env.split, envs.get(cfg.env.name).SPLITS)
    except UserError as e:
        raise UserError(f"{source}: {e}") from None
    if cfg.teacher_mode == "protocol_sft" and cfg.sft.teacher_steps <= 0:
        raise UserError(f"{source}: key 'sft.teacher_steps' = {cfg.sft.teacher_steps}; teacher_mode=protocol_sft "
                        "needs a teacher adapter trained for > 0 steps")
