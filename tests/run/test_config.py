"""Config validation: unknown/mistyped keys name the key; ranges; `opd params` output."""
from __future__ import annotations

import pytest
import yaml

from stages.run import config
from stages.run.config import ROOT
from stages.errors import UserError


def test_defaults_compose_and_validate():
    cfg = config.compose([])
    assert cfg.student.keep_layers == 24 and cfg.train.updates == 48 and cfg.teacher.name == "embedded"
    assert cfg.objective.name == "forward_kl_topk" and cfg.objective.topk == 32


@pytest.mark.parametrize("override,needle", [
    ("+rollout.max_new_tokenz=3", "rollout.max_new_tokenz"),
    ("rollout.max_new_tokens=abc", "rollout.max_new_tokens"),
    ("train.updates=0", "train.updates"),
    ("rollout.batch_size=-2", "rollout.batch_size"),
    ("objective.topk=0", "objective.topk"),
    ("runtime.device=tpu", "runtime.device"),
    ("objective.name=nope", "objective.name"),
    ("rollout.top_p=1.5", "rollout.top_p"),
])
def test_bad_overrides_name_the_key(override, needle):
    with pytest.raises(UserError) as e:
        config.compose([override])
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_unknown_key_in_params_file(tmp_path):
    data = yaml.safe_load(open(ROOT / "params.yaml"))
    data["train"]["updatez"] = 3
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(UserError, match=r"unknown config key 'train.updatez'"):
        config.load(p)


def test_wrong_type_in_params_file(tmp_path):
    data = yaml.safe_load(open(ROOT / "params.yaml"))
    data["lora"]["r"] = "sixteen"
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(UserError, match=r"lora.r"):
        config.load(p)


def test_params_write_is_atomic_on_error(tmp_path):
    out = tmp_path / "params.yaml"
    config.write_params(["train.updates=5"], out)
    before = out.read_text()
    assert yaml.safe_load(before)["train"]["updates"] == 5
    with pytest.raises(UserError):
        config.write_params(["train.updates=-1"], out)
    assert out.read_text() == before  # nothing already published touched


def test_committed_params_match_the_conf_tree(tmp_path):
    out = tmp_path / "params.yaml"
    config.write_params([], out)
    assert out.read_text() == (ROOT / "params.yaml").read_text()


def test_slice_of_only_the_keys_read():
    cfg = config.compose([])
    s = config.slice_of(cfg, "rollout", "objective.topk")
    assert set(s) == {"rollout", "objective.topk"} and s["objective.topk"] == 32


def test_the_dataclass_defaults_are_conf_s_defaults():
    """conf/ holds the defaults users read and override (and what `dvc exp run -S` composes without our
    code); the structured config's defaults are the same values, for code that builds a config piece
    by piece. Any key whose two defaults differ is named here."""
    import dataclasses

    def leaves(d, p=""):
        for k, v in d.items():
            yield from leaves(v, f"{p}{k}.") if isinstance(v, dict) else [(f"{p}{k}", v)]

    composed = dict(leaves(config.composed([], config.conf_dir())))
    schema = dict(leaves(dataclasses.asdict(config.Config())))
    assert composed.keys() == schema.keys()
    assert {k: (composed[k], schema[k]) for k in composed if composed[k] != schema[k]} == {}


def test_a_null_lr_is_chosen_by_the_student():
    """optim.lr / optim.warmup_updates null: 2e-3 at once for the pruned default (its digests stay what
    they were), 1e-4 with warmup for an intact pretrained student; a value given is kept."""
    d = config.compose([], config.conf_dir())
    assert (d.optim.lr, d.optim.warmup_updates) == (2e-3, 0)
    intact = config.compose(["student.keep_layers=0"], config.conf_dir())
    assert (intact.optim.lr, intact.optim.warmup_updates) == (1e-4, 4)
    rand = config.compose(["student.keep_layers=0", "student.init=random", "student.name=arch:tiny-llama"],
                          config.conf_dir())
    assert (rand.optim.lr, rand.optim.warmup_updates) == (2e-3, 0)
    given = config.compose(["student.keep_layers=0", "optim.lr=3e-4", "optim.warmup_updates=0"], config.conf_dir())
    assert (given.optim.lr, given.optim.warmup_updates) == (3e-4, 0)
