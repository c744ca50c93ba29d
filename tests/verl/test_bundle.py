"""Bundle out: `opd stage export --verl` after one trained update (tests/verl/conftest.py). The overrides compose
with verl 0.8.0's own Hydra config into its dataclasses and pass validate_config, sized for 2 nodes x 8
GPUs with 4 for the teacher (checked here independently of the export's own check); the bundle is a
warm start of the remaining updates, relocatable, checksummed, and writes no key verl ignores."""
from __future__ import annotations

import hashlib
import json
import runpy

import pyarrow.parquet as pq
import pytest

from support import opd
from stages.run import config
from stages.rows import tables
from stages.verl import bundle, keys


def test_bundle_files_and_checksums(bundle_run):
    out = bundle_run.out
    assert "warm start from update 1, 2 verl steps" in bundle_run.result.stdout
    names = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    for f in ("overrides.txt", "launch.sh", "compat.json", "reward.py", "SHA256SUMS", "data/train.parquet",
              "data/test.parquet", "adapter/adapter_model.safetensors", "adapter/adapter_config.json",
              "base/config.json", "base/model.safetensors", "base/tokenizer.json", "teacher/model.safetensors",
              "teacher/tokenizer_config.json"):
        assert f in names, f
    assert not any(n.endswith(("manifest.json", "state.json")) for n in names)  # store bookkeeping stays out
    sums = dict(reversed(line.split("  ", 1)) for line in (out / "SHA256SUMS").read_text().splitlines())
    assert set(sums) == names - {"SHA256SUMS"}
    for rel, h in sums.items():
        assert hashlib.sha256((out / rel).read_bytes()).hexdigest() == h, rel
        assert (out / rel).stat().st_nlink == 1, f"{rel} is a hard link (into the store?)"


def test_bundle_is_relocatable(bundle_run):
    """No text file names where the bundle or the store were written; paths in overrides are relative."""
    out = bundle_run.out
    for p in out.rglob("*"):
        if p.is_file() and p.suffix not in (".safetensors", ".parquet"):
            text = p.read_text()
            assert str(bundle_run.dir) not in text, p
    ov = dict(o.split("=", 1) for o in (out / "overrides.txt").read_text().splitlines())
    assert [ov[k] for k in keys.PATH_KEYS] == ["data/train.parquet", "data/test.parquet", "base", "adapter", "teacher",
                                               "reward.py"]
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == "../base"


def test_bundle_is_launchable_and_a_warm_start_of_the_remainder(bundle_run):
    rep = json.loads((bundle_run.out / "compat.json").read_text())
    try:
        import verl  # noqa: F401
        have_verl = True
    except ImportError:
        have_verl = False
    assert rep["checks"]["forward"]["ok"] and rep["checks"]["tokenizer"]["ok"] and rep["checks"]["parquet"]["ok"]
    assert rep["checks"]["verl_config"]["ok"] is have_verl
    assert rep["launchable"] is have_verl and rep["deviations"] == []
    c = rep["continuation"]
    assert (c["kind"], c["from_update"], c["train_updates"], c["steps"], c["warmup_steps"]) == ("warm start", 1, 3, 2, 0)
    assert any("AdamW moments" in x for x in c["not_carried"])
    ov = dict(o.split("=", 1) for o in (bundle_run.out / "overrides.txt").read_text().splitlines())
    assert ov["trainer.total_training_steps"] == "2" and ov["actor_rollout_ref.actor.optim.lr_warmup_steps"] == "0"
    assert ov["trainer.total_epochs"] == "1"  # 12 prompts / 6 per step = 2 steps per pass


def test_no_key_verl_ignores_is_written(bundle_run):
    written = [o.split("=", 1)[0] for o in (bundle_run.out / "overrides.txt").read_text().splitlines()]
    assert set(written) <= set(keys.USES)
    for ignored in ("actor_rollout_ref.rollout.ignore_eos", "data.truncation", "actor_rollout_ref.model.lora_alpha",
                    "actor_rollout_ref.model.target_modules"):
        assert ignored not in written and ignored in keys.IGNORED
    rep = json.loads((bundle_run.out / "compat.json").read_text())
    assert rep["keys"] == {k: keys.USES[k].where for k in written}


def test_overrides_build_verls_dataclasses_sized_for_two_nodes(bundle_run):
    """Compose overrides.txt (paths made absolute, as launch.sh does) with verl's Hydra config; build
    DistillationConfig, the actor, rollout and model dataclasses; run verl's validate_config."""
    pytest.importorskip("verl")
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.workers.config import DistillationConfig, FSDPActorConfig, HFModelConfig, RolloutConfig

    from stages.verl import checks

    out = bundle_run.out
    overrides = bundle.absolute((out / "overrides.txt").read_text().splitlines(), out)
    cfg = checks.compose_verl(overrides)
    OmegaConf.resolve(cfg)
    dist = omega_conf_to_dataclass(cfg.distillation)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    roll = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    model = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
    assert isinstance(dist, DistillationConfig) and isinstance(actor, FSDPActorConfig)
    assert isinstance(roll, RolloutConfig) and isinstance(model, HFModelConfig)
    try:
        validate_config(cfg, use_reference_policy=False, use_critic=False)
    except ValueError as e:  # its last check asks vLLM for the LoRA rank limit (vLLM is not installed here)
        assert "vllm version" in str(e)
    # pools: the student on 12 GPUs (2 groups of 6), the teacher on 4 (2 groups of 2, one replica per GPU)
    assert (cfg.trainer.n_gpus_per_node, cfg.trainer.nnodes) == (6, 2)
    assert (cfg.distillation.n_gpus_per_node, cfg.distillation.nnodes) == (2, 2)
    teacher = dist.teacher_models["default"]
    assert teacher.world_size == 4 and teacher.num_replicas == 4 and teacher.inference.tensor_model_parallel_size == 1
    # 6 prompts x 2 samples = 12 sequences: one per actor GPU, micro-batch 1
    assert cfg.data.train_batch_size * roll.n % 12 == 0 and actor.ppo_micro_batch_size_per_gpu == 1
    loss = dist.distillation_loss
    assert dist.enabled and loss.loss_mode == "k1" and loss.use_policy_gradient and loss.use_task_rewards
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.algorithm.norm_adv_by_std_in_grpo is False
    assert model.lora_rank == 16 and model.lora_adapter_path == str(out / "adapter")
    assert 0 < roll.gpu_memory_utilization <= 0.9 and teacher.inference.gpu_memory_utilization == 0.9


def test_bundle_data_reward_and_adapter(bundle_run):
    out = bundle_run.out
    for name in ("train.parquet", "test.parquet"):
        t = pq.read_table(out / "data" / name)
        assert t.schema.names == tables.PROMPTS.names and t.num_rows > 0
    ns = runpy.run_path(str(out / "reward.py"))
    assert ns["compute_score"]("opd/arith", "so <final>12</final>", "12") == 1.0
    assert ns["compute_score"]("opd/arith", "13", "12") == 0.0
    acfg = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert acfg["r"] == 16 and acfg["lora_alpha"] == 32


def test_nothing_left_to_continue_is_one_line_exit_2(bundle_run):
    r = opd("stage", "export", "--verl", "again", "--gpus", "8", "--nodes", "2", "--teacher-gpus", "4", *bundle_run.args,
            "train.updates=1", cwd=bundle_run.dir, check=False)
    assert r.returncode == 2 and "all 1 updates are published" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (bundle_run.dir / "again").exists()


def test_deviations(tmp_path):
    cfg = config.compose(["objective.name=bucketed_topk_tail", "selection.mode=uniform_ratio", "selection.ratio=0.5"])
    by = {d["key"]: d for d in keys.deviations(cfg)}
    assert by["objective.name"]["blocking"] and not by["selection.mode"]["blocking"]
    cfg = config.compose(["objective.name=pg_k1_rewarded", "objective.use_policy_gradient=true",
                          "objective.advantage=raw"])
    assert [d["key"] for d in keys.deviations(cfg) if d["blocking"]] == ["objective.advantage"]
    # settings that would need a key verl ignores: warned, naming the key verl does not read
    cfg = config.compose(["rollout.min_new_tokens=32", "rollout.max_new_tokens=32", "data.truncation=right"])
    by = {d["key"]: d for d in keys.deviations(cfg)}
    assert not by["rollout.min_new_tokens"]["blocking"] and "ignore_eos" in by["rollout.min_new_tokens"]["why"]
    assert "rl_dataset.py:115" in by["data.truncation"]["why"]
    assert "data.truncation" not in {d["key"] for d in keys.deviations(config.compose(["data.truncation=left"]))}


def test_warm_start_inside_warmup_says_so():
    cfg = config.compose(["optim.warmup_updates=4", "train.updates=10"])
    cont, dev = bundle.continuation(cfg, 1)
    assert (cont["steps"], cont["warmup_steps"]) == (9, 3)
    assert [d["key"] for d in dev] == ["optim.warmup_updates"] and not dev[0]["blocking"]
    cont, dev = bundle.continuation(cfg, 4)
    assert (cont["steps"], cont["warmup_steps"], dev) == (6, 0, [])
