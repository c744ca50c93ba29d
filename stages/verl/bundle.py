"""Bundle out: `opd stage export --verl OUT` writes what `python -m verl.trainer.main_ppo` needs to continue
this run on a verl cluster, and checks that it would start.

    OUT/base/               the student base (safetensors + tokenizer; pruned students as trained)
    OUT/adapter/            the trained PEFT adapter (actor_rollout_ref.model.lora_adapter_path)
    OUT/teacher/            the teacher
    OUT/data/{train,test}.parquet   the run's prompt rows, verl schema
    OUT/reward.py           our rule reward as verl's custom_reward_function (compute_score)
    OUT/overrides.txt       one Hydra override per line: distillation.enabled=true and our settings
    OUT/launch.sh           python -m verl.trainer.main_ppo "$(overrides)"
    OUT/compat.json         launchable (true only when every check passed), reasons, checks, deviations
    OUT/SHA256SUMS          sha256sum -c format, every other file

Model dirs are hard links into the store where the filesystem allows (no bytes copied). Paths in the
overrides are absolute: re-export after moving the bundle. verl 0.8 runs the teacher in its own GPU
pool, so the bundle asks for two GPUs (one actor/rollout, one teacher); it cannot run on one.
"""
from __future__ import annotations

import inspect
import json
import os
import shutil
from pathlib import Path

import pyarrow.parquet as pq

from .. import files, rewards, tables
from ..errors import UserError
from ..store import write_json
from . import checks, rules
from .mapping import _fmt

VERL_LOSS = {"forward_kl_topk": "forward_kl_topk", "k1": "k1", "k2": "k2", "mse": "mse", "k3": "k3",
             "low_var_kl": "low_var_kl", "abs": "abs", "pg_k1_rewarded": "k1"}


def verl_overrides(cfg, root: Path) -> tuple[list[str], list[dict]]:
    """(Hydra overrides for verl's ppo_trainer config, deviations: what verl would do differently).

    A deviation with "blocking": true means verl cannot express the setting at all."""
    ob, ro, dev = cfg.objective, cfg.rollout, []
    task = ob.name == "pg_k1_rewarded"
    if ob.name not in VERL_LOSS:
        dev.append({"key": "objective.name", "value": ob.name, "blocking": True,
                    "why": "no verl 0.8 distillation loss_mode computes this objective"})
    if task and ob.advantage not in ("group_standardized", "group_centered", "leave_one_out"):
        dev.append({"key": "objective.advantage", "value": ob.advantage, "blocking": True,
                    "why": "verl has no outcome estimator that uses raw rewards"})
    if task and ob.reward_coef != 1.0:
        dev.append({"key": "objective.reward_coef", "value": ob.reward_coef, "blocking": True,
                    "why": "verl weights the task-reward loss by 1"})
    if cfg.selection.mode != "all":
        dev.append({"key": "selection.mode", "value": cfg.selection.mode, "blocking": False,
                    "why": "verl puts every response position through the LM head and the loss"})
    if ro.min_new_tokens and ro.min_new_tokens != ro.max_new_tokens:
        dev.append({"key": "rollout.min_new_tokens", "value": ro.min_new_tokens, "blocking": False,
                    "why": "verl can only ignore EOS entirely (ignore_eos) or not at all"})
    for role in ("student", "teacher"):
        if getattr(cfg, role).quant != "none":
            dev.append({"key": f"{role}.quant", "value": getattr(cfg, role).quant, "blocking": False,
                        "why": "verl loads the exported weights unquantized"})
    adv = {"leave_one_out": ("rloo", True), "group_centered": ("grpo", False)}.get(ob.advantage, ("grpo", True))
    floor = None if ob.log_prob_min_clamp <= rules.NO_FLOOR else ob.log_prob_min_clamp
    low = ob.clip_ratio_low if ob.clip_ratio_low is not None else ob.clip_ratio
    high = ob.clip_ratio_high if ob.clip_ratio_high is not None else ob.clip_ratio
    A, R, D, T = ("actor_rollout_ref.actor", "actor_rollout_ref.rollout", "distillation.distillation_loss",
                  "distillation.teacher_models.teacher_model")
    kv = [
        ("data.train_files", str(root / "data" / "train.parquet")),
        ("data.val_files", str(root / "data" / "test.parquet")),
        ("data.prompt_key", cfg.data.prompt_key),
        ("data.max_prompt_length", cfg.data.max_prompt_tokens),
        ("data.max_response_length", ro.max_new_tokens),
        ("data.train_batch_size", ro.batch_size),
        ("data.truncation", cfg.data.truncation),
        ("data.filter_overlong_prompts", False),
        ("actor_rollout_ref.model.path", str(root / "base")),
        ("actor_rollout_ref.model.trust_remote_code", cfg.student.trust_remote_code),
        ("actor_rollout_ref.model.lora_rank", cfg.lora.r),
        ("actor_rollout_ref.model.lora_alpha", cfg.lora.alpha),
        ("actor_rollout_ref.model.target_modules", list(cfg.lora.target_modules)),
        ("actor_rollout_ref.model.lora_adapter_path", str(root / "adapter")),
        (f"{A}.optim.lr", cfg.optim.lr),
        (f"{A}.optim.weight_decay", cfg.optim.weight_decay),
        (f"{A}.optim.betas", [cfg.optim.beta1, cfg.optim.beta2]),
        (f"{A}.optim.clip_grad", cfg.optim.max_grad_norm),
        (f"{A}.optim.lr_warmup_steps", cfg.optim.warmup_updates),
        (f"{A}.optim.lr_scheduler_type", "constant"),
        (f"{A}.ppo_mini_batch_size", ro.batch_size),
        (f"{A}.ppo_micro_batch_size_per_gpu", ro.batch_size),
        (f"{A}.ppo_epochs", 1),
        (f"{A}.loss_agg_mode", ob.loss_agg_mode),
        (f"{A}.use_kl_loss", False),
        (f"{A}.entropy_coeff", 0),
        (f"{A}.clip_ratio", ob.clip_ratio),
        (f"{A}.clip_ratio_low", low),
        (f"{A}.clip_ratio_high", high),
        (f"{R}.name", "vllm"),
        (f"{R}.n", ro.n),
        (f"{R}.temperature", ro.temperature),
        (f"{R}.top_p", ro.top_p),
        (f"{R}.ignore_eos", bool(ro.min_new_tokens) and ro.min_new_tokens == ro.max_new_tokens),
        (f"{R}.tensor_model_parallel_size", 1),
        (f"{R}.log_prob_micro_batch_size_per_gpu", ro.batch_size),
        ("algorithm.adv_estimator", adv[0]),
        ("algorithm.norm_adv_by_std_in_grpo", adv[1]),
        ("algorithm.use_kl_in_reward", False),
        ("distillation.enabled", True),
        ("distillation.n_gpus_per_node", 1),
        ("distillation.nnodes", 1),
        (f"{T}.model_path", str(root / "teacher")),
        (f"{T}.inference.tensor_model_parallel_size", 1),
        (f"{D}.loss_mode", VERL_LOSS.get(ob.name, ob.name)),
        (f"{D}.topk", ob.topk),
        (f"{D}.use_task_rewards", task),
        (f"{D}.distillation_loss_coef", ob.distill_coef if task else 1.0),
        (f"{D}.loss_max_clamp", ob.loss_max_clamp),
        (f"{D}.log_prob_min_clamp", floor),
        (f"{D}.use_policy_gradient", ob.use_policy_gradient),
        (f"{D}.clip_ratio", ob.clip_ratio),
        (f"{D}.clip_ratio_low", low),
        (f"{D}.clip_ratio_high", high),
        ("reward.custom_reward_function.path", str(root / "reward.py")),
        ("reward.custom_reward_function.name", "compute_score"),
        ("trainer.n_gpus_per_node", 1),
        ("trainer.nnodes", 1),
        ("trainer.total_training_steps", cfg.train.updates),
        ("trainer.logger", ["console"]),
        ("trainer.project_name", "opd-stages"),
        ("trainer.experiment_name", cfg.run),
    ]
    return [f"{k}={_fmt(v)}" for k, v in kv], dev


def reward_source() -> str:
    """reward.py for verl: our rule reward module, self-contained, plus verl's compute_score signature."""
    return (f"# Generated by `opd stage export --verl` from stages/rewards.py: the rule reward the run trained with,\n"
            f"# as verl's reward.custom_reward_function (name: compute_score).\n"
            + inspect.getsource(rewards) +
            "\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n"
            "    r = rule_reward(solution_str, ground_truth)\n"
            "    return 0.0 if r is None else r\n")


def export(sess, out: Path) -> Path:
    """Write the bundle atomically (temp dir, then rename); returns OUT. The final policy is published
    first (the driver: stages/train.py ensure_policy)."""
    cfg = sess.cfg
    out = Path(out).resolve()
    final = sess.policy_digest(cfg.train.updates)
    pol = sess.store.get(sess.chain.policy_stage(cfg.train.updates), final)
    if pol is None:
        raise UserError(f"export --verl: the final policy {final[:12]} is not in the store; run train first")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        files.link_tree(sess.store.path("model", sess.prepared["student"]), tmp / "base")
        files.link_tree(sess.store.path("model", sess.prepared["teacher"]), tmp / "teacher")
        files.link_tree(pol / "adapter", tmp / "adapter")
        files.rebase_adapter(tmp / "adapter", str(out / "base"))
        (tmp / "data").mkdir()
        prompts = sess.store.path("prompts", sess.prepared["prompts"])
        for src, name in (("train.parquet", "train.parquet"), ("eval.parquet", "test.parquet")):
            t = tables.read(prompts / src)
            pq.write_table(t.replace_schema_metadata(None), tmp / "data" / name, compression="zstd")
        (tmp / "reward.py").write_text(reward_source())
        overrides, deviations = verl_overrides(cfg, out)
        (tmp / "overrides.txt").write_text("\n".join(overrides) + "\n")
        (tmp / "launch.sh").write_text(
            "#!/usr/bin/env bash\n# Continue this run with verl 0.8 (2 GPUs: actor/rollout + teacher pool).\n"
            "set -euo pipefail\ncd \"$(dirname \"$0\")\"\nmapfile -t OVERRIDES < overrides.txt\n"
            "exec python -m verl.trainer.main_ppo \"${OVERRIDES[@]}\" \"$@\"\n")
        (tmp / "launch.sh").chmod(0o755)
        report = checks.run_all(tmp, out, overrides, cfg, sess.prepared)
        blocking = [d for d in deviations if d["blocking"]]
        reasons = [f"{d['key']} = {d['value']!r}: {d['why']}" for d in blocking] + \
                  [f"{name}: {c['detail']}" for name, c in report.items() if not c["ok"]]
        write_json(tmp / "compat.json", {
            "launchable": not reasons, "reasons": reasons, "checks": report, "deviations": deviations,
            "verl_version": "0.8.0", "entrypoint": "python -m verl.trainer.main_ppo",
            "gpus": {"actor_rollout": 1, "teacher": 1}, "run": cfg.run, "final_policy": final,
            "prepared": sess.prepared})
        listed = sorted(p for p in tmp.rglob("*") if p.is_file())
        (tmp / "SHA256SUMS").write_text("".join(f"{files.sha256(p)}  {p.relative_to(tmp)}\n" for p in listed))
        files.swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(sess, out: Path) -> Path:
    if out is None:
        raise UserError("opd stage export --verl OUT: an output directory is required")
    d = export(sess, out)
    rep = json.loads((d / "compat.json").read_text())
    state = "launchable" if rep["launchable"] else "NOT launchable: " + "; ".join(rep["reasons"])
    print(f"export --verl: {d} ({state})")
    return d
