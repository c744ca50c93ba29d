"""Bundle out: `opd stage export --verl OUT` on a tiny trained run. The overrides compose with verl 0.8.0's
own Hydra config into its dataclasses (checked here independently of the export's own check); the
adapter loads on the base; tokenizer, Parquet schema and SHA256SUMS hold; launchable says so."""
from __future__ import annotations

import hashlib
import json
import runpy

import pyarrow.parquet as pq
import pytest

from support import TINY, opd
from stages import config, tables
from stages.verl import bundle


@pytest.fixture(scope="module")
def exported(tmp_path_factory, seeded_store):
    import shutil

    from support import ROOT

    d = tmp_path_factory.mktemp("bundle")
    (d / "conf").symlink_to(ROOT / "conf")
    for part in ("tokenizer", "model"):
        shutil.copytree(seeded_store / part, d / "artifacts" / "store" / part)
    r = opd("stage", "export", "--verl", "out", *TINY, "train.updates=1", "data.generator=arith",
            "objective.name=pg_k1_rewarded", "objective.use_policy_gradient=true", "rollout.n=2", cwd=d)
    return d / "out", r


def test_bundle_files_and_checksums(exported):
    out, r = exported
    assert "export --verl" in r.stdout
    names = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    for f in ("overrides.txt", "launch.sh", "compat.json", "reward.py", "SHA256SUMS", "data/train.parquet",
              "data/test.parquet", "adapter/adapter_model.safetensors", "adapter/adapter_config.json",
              "base/config.json", "base/model.safetensors", "base/tokenizer.json", "teacher/model.safetensors"):
        assert f in names, f
    sums = dict(reversed(line.split("  ", 1)) for line in (out / "SHA256SUMS").read_text().splitlines())
    assert set(sums) == names - {"SHA256SUMS"}
    for rel, h in sums.items():
        assert hashlib.sha256((out / rel).read_bytes()).hexdigest() == h, rel


def test_bundle_is_launchable_and_says_why(exported):
    out, _ = exported
    rep = json.loads((out / "compat.json").read_text())
    try:
        import verl  # noqa: F401
        have_verl = True
    except ImportError:
        have_verl = False
    assert rep["checks"]["forward"]["ok"] and rep["checks"]["tokenizer"]["ok"] and rep["checks"]["parquet"]["ok"]
    assert rep["checks"]["verl_config"]["ok"] is have_verl
    assert rep["launchable"] is have_verl and (rep["reasons"] == []) is have_verl
    assert rep["deviations"] == []


def test_overrides_build_verls_dataclasses(exported):
    """Independent of the export's own check: compose overrides.txt with verl's Hydra config and build
    DistillationConfig, the actor and the rollout dataclasses."""
    pytest.importorskip("verl")
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import ActorConfig, DistillationConfig, RolloutConfig

    import verl

    out, _ = exported
    overrides = (out / "overrides.txt").read_text().splitlines()
    assert "distillation.enabled=true" in overrides
    assert f"actor_rollout_ref.model.lora_adapter_path={out / 'adapter'}" in overrides
    with initialize_config_dir(str(verl.__file__[:-len("__init__.py")]) + "trainer/config", version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)
    OmegaConf.resolve(cfg)
    dist = omega_conf_to_dataclass(cfg.distillation)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    roll = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    assert isinstance(dist, DistillationConfig) and isinstance(actor, ActorConfig) and isinstance(roll, RolloutConfig)
    loss = dist.distillation_loss
    assert dist.enabled and loss.loss_mode == "k1" and loss.use_policy_gradient and loss.use_task_rewards
    assert roll.n == 2 and cfg.algorithm.adv_estimator == "grpo" and cfg.algorithm.norm_adv_by_std_in_grpo is False
    assert cfg.actor_rollout_ref.model.lora_rank == 16 and cfg.data.train_batch_size == 4
    assert list(dist.teacher_models) == ["default"] and dist.teacher_models["default"].world_size == 1


def test_bundle_data_reward_and_adapter(exported):
    out, _ = exported
    for name in ("train.parquet", "test.parquet"):
        t = pq.read_table(out / "data" / name)
        assert t.schema.names == tables.PROMPTS.names and t.num_rows > 0
    ns = runpy.run_path(str(out / "reward.py"))
    assert ns["compute_score"]("opd/arith", "so <final>12</final>", "12") == 1.0
    assert ns["compute_score"]("opd/arith", "13", "12") == 0.0
    acfg = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert acfg["base_model_name_or_path"] == str(out / "base") and acfg["r"] == 16


def test_deviations_make_a_bundle_not_launchable(tmp_path):
    cfg = config.compose(["objective.name=bucketed_topk_tail", "selection.mode=uniform_ratio", "selection.ratio=0.5"])
    _, dev = bundle.verl_overrides(cfg, tmp_path)
    by = {d["key"]: d for d in dev}
    assert by["objective.name"]["blocking"] and not by["selection.mode"]["blocking"]
    cfg = config.compose(["objective.name=pg_k1_rewarded", "objective.use_policy_gradient=true",
                          "objective.advantage=raw"])
    _, dev = bundle.verl_overrides(cfg, tmp_path)
    assert [d["key"] for d in dev if d["blocking"]] == ["objective.advantage"]
