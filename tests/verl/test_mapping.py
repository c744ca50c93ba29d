"""Profiles in: every profile maps with every builtin pair; bad verl input fails closed with one line
naming the field; reinterpretations from external files need --accept; pins hold."""
from __future__ import annotations

import re

import pytest
import yaml

from stages.run import config
from stages.errors import UserError
from stages.verl import fields, mapping, rules

PROFILES = mapping.profile_names()
EMBEDDED = "builtin:smollm2-135m-embedded-opd"
OBJECTIVE = {"verl-opd-v0.8-single-gpu-v1": "forward_kl_topk", "verl-opd-v0.8-single-gpu-grouped-v1": "forward_kl_topk",
             "verl-opd-v0.8-single-gpu-pg-k1-v1": "k1", "verl-opd-v0.8-single-gpu-pg-k1-grouped-v1": "k1",
             "verl-opd-v0.8-single-gpu-pg-k1-rewarded-v1": "pg_k1_rewarded"}


def ov_dict(overrides):
    return dict(o.split("=", 1) for o in overrides)


def test_the_five_profiles_exist():
    assert PROFILES == sorted(OBJECTIVE)


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("pair", mapping.pair_names())
def test_every_profile_maps_every_pair_to_a_valid_config(profile, pair):
    overrides, report = mapping.map_profile(profile, f"builtin:{pair}")
    cfg = config.compose(overrides)  # our schema validates the result
    assert cfg.objective.name == OBJECTIVE[profile]
    assert (cfg.rollout.n > 1) == ("grouped" in profile or "rewarded" in profile)
    p = mapping.load_pair(pair)
    assert cfg.student.name == p["student"]["name"] and cfg.teacher.revision == p["teacher"]["revision"]
    assert report["counts"]["unsupported"] == 0
    assert {e["class"] for e in report["fields"]} <= set(rules.KINDS)


def test_rewarded_profile_maps_grpo_to_group_standardized_and_uses_ground_truths():
    ov, _ = mapping.map_profile("verl-opd-v0.8-single-gpu-pg-k1-rewarded-v1", EMBEDDED)
    d = ov_dict(ov)
    assert d["objective.name"] == "pg_k1_rewarded" and d["objective.advantage"] == "group_standardized"
    assert d["data.generator"] == "arith"
    ov, _ = mapping.map_profile("verl-opd-v0.8-single-gpu-pg-k1-rewarded-v1", EMBEDDED,
                                ["algorithm.norm_adv_by_std_in_grpo=false"])
    assert ov_dict(ov)["objective.advantage"] == "group_centered"
    ov, _ = mapping.map_profile("verl-opd-v0.8-single-gpu-pg-k1-rewarded-v1", EMBEDDED, ["algorithm.adv_estimator=rloo"])
    assert ov_dict(ov)["objective.advantage"] == "leave_one_out"


def test_set_values_map_exactly():
    ov, rep = mapping.map_profile("verl-opd-v0.8-single-gpu-v1", EMBEDDED, [
        "data.train_batch_size=8", "distillation.distillation_loss.topk=16", "actor_rollout_ref.actor.optim.lr=1e-4",
        "actor_rollout_ref.actor.optim.betas=[0.8,0.95]", "data.max_response_length=48"])
    d = ov_dict(ov)
    assert d["rollout.batch_size"] == "8" and d["objective.topk"] == "16" and d["optim.lr"] == "0.0001"
    assert d["optim.beta1"] == "0.8" and d["optim.beta2"] == "0.95"
    assert d["rollout.max_new_tokens"] == d["eval.max_new_tokens"] == "48"
    # ppo_mini_batch_size follows train_batch_size through the profile's interpolation
    assert any(e["field"] == "actor_rollout_ref.actor.ppo_mini_batch_size" and e["value"] == 8 for e in rep["fields"])
    assert all(e["source"] in mapping.SOURCES for e in rep["fields"])


def _fails(profile, config, sets=(), accept=(), match=None):
    with pytest.raises(UserError) as e:
        mapping.map_profile(profile, config, list(sets), list(accept))
    msg = str(e.value)
    assert "\n" not in msg
    if match:
        assert re.search(match, msg), msg
    return msg


@pytest.mark.parametrize("sets,field", [
    (["trainer.n_gpus_per_node=2"], "trainer.n_gpus_per_node"),
    (["trainer.nnodes=2"], "trainer.nnodes"),
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=2"], "actor_rollout_ref.rollout.tensor_model_parallel_size"),
    (["distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=4"],
     "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size"),
    (["actor_rollout_ref.actor.fsdp_config.param_offload=true"], "actor_rollout_ref.actor.fsdp_config.param_offload"),
    (["distillation.teacher_models.teacher2.model_path=x/y"], "distillation.teacher_models.teacher2.model_path"),
    (["actor_rollout_ref.actor.ppo_epochs=2"], "actor_rollout_ref.actor.ppo_epochs"),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=2"], "actor_rollout_ref.actor.ppo_mini_batch_size"),
    (["actor_rollout_ref.model.lora_rank=0"], "actor_rollout_ref.model.lora_rank"),
    (["actor_rollout_ref.actor.use_kl_loss=true"], "actor_rollout_ref.actor.use_kl_loss"),
    (["actor_rollout_ref.actor.optim.lr_scheduler_type=cosine"], "actor_rollout_ref.actor.optim.lr_scheduler_type"),
    (["data.train_files=[a.parquet,b.parquet]"], "data.train_files"),
    (["actor_rollout_ref.rollout.multi_turn.enable=true"], "actor_rollout_ref.rollout.multi_turn.enable"),
    (["distillation.teacher_models.teacher_model.inference.temperature=0.7"],
     "distillation.teacher_models.teacher_model.inference.temperature"),
])
def test_unsupported_values_fail_closed_naming_the_field(sets, field):
    msg = _fails("verl-opd-v0.8-single-gpu-v1", EMBEDDED, sets, ["all"])
    assert f"'{field}'" in msg and "unsupported" in msg


def test_unknown_verl_field_and_unknown_profile():
    _fails("verl-opd-v0.8-single-gpu-v1", EMBEDDED, ["data.max_prompt_lenght=64"],
           match=r"unknown verl field 'data.max_prompt_lenght'")
    _fails("verl-opd-v0.8-single-gpu-v1", EMBEDDED, ["distillation.teacher_models.teacher_model.model_pth=x"],
           match=r"unknown verl field 'distillation.teacher_models.teacher_model.model_pth'")
    _fails("verl-opd-v9", EMBEDDED, match=r"unknown profile 'verl-opd-v9'")
    _fails("verl-opd-v0.8-single-gpu-v1", "builtin:nope", match=r"builtin:nope")


def test_k1_without_policy_gradient_is_refused_as_verl_refuses_it(tmp_path):
    f = tmp_path / "verl.yaml"
    f.write_text(yaml.safe_dump({"actor_rollout_ref": {"model": {"path": "s"}}, "distillation": {
        "teacher_models": {"teacher_model": {"model_path": "t"}},
        "distillation_loss": {"use_policy_gradient": False}}}))
    _fails("verl-opd-v0.8-single-gpu-pg-k1-v1", str(f), accept=["all"],
           match=r"'distillation.distillation_loss.loss_mode' = 'k1' is unsupported.*use_policy_gradient")


def test_pins_and_group_bounds():
    _fails("verl-opd-v0.8-single-gpu-v1", EMBEDDED, ["distillation.distillation_loss.loss_mode=k3"],
           match=r"'distillation.distillation_loss.loss_mode' = 'k3' conflicts with profile")
    _fails("verl-opd-v0.8-single-gpu-v1", EMBEDDED, ["actor_rollout_ref.rollout.n=4"],
           match=r"actor_rollout_ref.rollout.n.*grouped variant")
    _fails("verl-opd-v0.8-single-gpu-grouped-v1", EMBEDDED, ["actor_rollout_ref.rollout.n=1"],
           match=r"needs >= 2")


def test_reinterpretations_from_a_config_file_must_be_accepted(tmp_path):
    f = tmp_path / "verl.yaml"
    f.write_text(yaml.safe_dump({"actor_rollout_ref": {"model": {"path": "Qwen/Qwen3-0.6B"},
                                                       "rollout": {"name": "sglang"}},
                                 "distillation": {"teacher_models": {"teacher_model": {"model_path": "Qwen/Qwen3-1.7B"}}}}))
    msg = _fails("verl-opd-v0.8-single-gpu-v1", str(f))
    assert "'actor_rollout_ref.rollout.name' is reinterpreted" in msg and "--accept" in msg
    ov, rep = mapping.map_profile("verl-opd-v0.8-single-gpu-v1", str(f), [], ["actor_rollout_ref.rollout.name"])
    assert ov_dict(ov)["student.name"] == "Qwen/Qwen3-0.6B"
    assert {e["field"]: e["source"] for e in rep["fields"]}["actor_rollout_ref.rollout.name"] == "config"
    # the profile's own reinterpretations (its base) and builtin configs need no acceptance
    mapping.map_profile("verl-opd-v0.8-single-gpu-v1", EMBEDDED)


def test_a_config_file_without_a_student_is_an_error(tmp_path):
    f = tmp_path / "verl.yaml"
    f.write_text(yaml.safe_dump({"data": {"train_batch_size": 4}}))
    _fails("verl-opd-v0.8-single-gpu-v1", str(f), match=r"'actor_rollout_ref.model.path'.*expected a model set by the config")


def test_fields_snapshot_classifies_every_leaf_and_every_rule_is_used():
    leaves = fields.defaults()
    assert len(leaves) > 600
    used = {rules.rule_for(k).pattern for k in leaves}
    unused = {r.pattern for r in rules.RULES} - used
    assert unused == {"distillation.teacher_models.*.**"}  # only matches user-added teacher entries


def test_builtin_pairs_pin_40_hex_revisions():
    names = mapping.pair_names()
    assert {"qwen3-0.6b-1.7b-opd", "smollm2-360m-1.7b-opd", "smollm2-135m-embedded-opd"} <= set(names)
    for n in names:
        p = mapping.load_pair(n)
        for role in ("student", "teacher"):
            m = p[role]
            assert m["name"] == "embedded" or re.fullmatch(r"[0-9a-f]{40}", m["revision"]), (n, role)


def test_builtin_pair_is_also_a_hydra_group_of_ours():
    cfg = config.compose(["+pair=qwen3-0.6b-1.7b-opd"])
    assert cfg.student.name == "Qwen/Qwen3-0.6B" and cfg.student.revision == "c1899de289a04d12100db370d81485cdf75e47ca"
