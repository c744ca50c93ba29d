"""Registry contents and check(): invalid combinations are refused with one-line UserErrors naming the key."""
import pytest

from stages import objectives as O
from stages.run.config import ObjectiveCfg, from_container
from stages.errors import UserError

from _objective_batch import CONFIGS, cfg_for

NAMES = {"forward_kl_topk", "k1", "k2", "mse", "k3", "low_var_kl", "abs", "pg_k1_rewarded",
         "bucketed_topk_tail", "exact_full_vocab", "nll"}


def test_registry_names_and_interface():
    assert set(O.REGISTRY) == NAMES
    for name, mod in O.REGISTRY.items():
        assert callable(mod.check) and callable(mod.per_token) and isinstance(mod.NEEDS, set), name


@pytest.mark.parametrize("name,needs", [
    ("forward_kl_topk", {"topk"}), ("bucketed_topk_tail", {"topk"}), ("exact_full_vocab", {"full"}),
    ("k1", {"teacher_logprobs"}), ("k3", {"teacher_logprobs"}), ("abs", {"teacher_logprobs"}),
    ("pg_k1_rewarded", {"teacher_logprobs", "advantages"}), ("nll", set()),
])
def test_needs(name, needs):
    assert O.needs(ObjectiveCfg(name=name)) == needs


@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_valid_configs_pass(key):
    O.check(cfg_for(key))


@pytest.mark.parametrize("over,key", [
    (dict(name="k1"), "objective.use_policy_gradient"),  # verl refuses k1 without PG
    (dict(name="pg_k1_rewarded"), "objective.use_policy_gradient"),
    (dict(name="bucketed_topk_tail", use_policy_gradient=True), "objective.use_policy_gradient"),
    (dict(name="exact_full_vocab", use_policy_gradient=True), "objective.use_policy_gradient"),
    (dict(name="nll", use_policy_gradient=True), "objective.use_policy_gradient"),
    (dict(name="bucketed_topk_tail", divergence="jsd", jsd_beta=0.0), "objective.jsd_beta"),
    (dict(name="exact_full_vocab", divergence="jsd", jsd_beta=1.0), "objective.jsd_beta"),
    (dict(name="forward_kl_topk", divergence="reverse"), "objective.divergence"),
    (dict(name="k3", divergence="jsd"), "objective.divergence"),
    (dict(name="k2", loss_max_clamp=0.0), "objective.loss_max_clamp"),
    (dict(name="k2", log_prob_min_clamp=0.0), "objective.log_prob_min_clamp"),
    (dict(name="k2", loss_agg_mode="sample-mean"), "objective.loss_agg_mode"),
    (dict(name="k2", use_policy_gradient=True, clip_ratio=0.0), "objective.clip_ratio"),
    (dict(name="k1", use_policy_gradient=True, clip_ratio_low=1.0), "objective.clip_ratio_low"),
    (dict(name="forward_kl_topk", use_policy_gradient=True, clip_ratio_high=-0.1), "objective.clip_ratio_high"),
    (dict(name="pg_k1_rewarded", use_policy_gradient=True, distill_coef=-1.0), "objective.distill_coef"),
    (dict(name="pg_k1_rewarded", use_policy_gradient=True, reward_coef=float("nan")), "objective.reward_coef"),
    (dict(name="kl"), "objective.name"),
])
def test_refused(over, key):
    with pytest.raises(UserError) as e:
        O.check(ObjectiveCfg(**over), "params.yaml")
    msg = str(e.value)
    assert f"'{key}'" in msg and msg.startswith("params.yaml: "), msg
    assert "\n" not in msg


def test_config_validation_runs_objective_check():
    with pytest.raises(UserError, match="'objective.use_policy_gradient'"):
        from_container({"objective": {"name": "k1"}}, "params.yaml")
    cfg = from_container({"objective": {"name": "k1", "use_policy_gradient": True}}, "params.yaml")
    assert cfg.objective.name == "k1"
