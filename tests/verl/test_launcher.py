"""verl's real launcher on the bundle, as far as a machine without GPUs and vLLM goes: the bundle is
copied elsewhere (it must not depend on where it was written), its checksums verified there, and its
launch.sh run from a third directory with `--cfg job`, so `python -m verl.trainer.main_ppo` imports
everything it imports at startup (tests/side.py: the verl-runtime pins), composes verl's Hydra
config with the overrides and prints the job config instead of starting Ray. That config must be the
one the export validated, with every path inside the moved bundle."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import yaml

from side import env_with
from stages.verl import bundle, keys


@pytest.fixture(scope="module")
def launched(bundle_run, tmp_path_factory):
    pytest.importorskip("verl")
    moved = tmp_path_factory.mktemp("shared storage") / "bundle"  # a space in the path, on purpose
    shutil.copytree(bundle_run.out, moved)
    sums = subprocess.run(["sha256sum", "--quiet", "-c", "SHA256SUMS"], cwd=moved, capture_output=True, text=True)
    assert sums.returncode == 0, sums.stdout + sums.stderr
    cwd = tmp_path_factory.mktemp("cluster-job")
    r = subprocess.run(["bash", str(moved / "launch.sh"), "--cfg", "job"], cwd=cwd, capture_output=True, text=True,
                       env=env_with("verl-runtime", PYTHON=sys.executable), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return moved, yaml.safe_load(r.stdout), r


def test_main_ppo_composes_the_bundle(launched):
    moved, job, _ = launched
    assert job["distillation"]["enabled"] is True and job["trainer"]["total_training_steps"] == 2
    assert job["actor_rollout_ref"]["model"]["path"] == str(moved / "base")
    assert job["actor_rollout_ref"]["model"]["lora_adapter_path"] == str(moved / "adapter")
    assert job["data"]["train_files"] == str(moved / "data" / "train.parquet")
    assert job["distillation"]["teacher_models"]["teacher_model"]["model_path"] == str(moved / "teacher")
    assert job["reward"]["custom_reward_function"]["path"] == str(moved / "reward.py")
    assert (job["trainer"]["n_gpus_per_node"], job["trainer"]["nnodes"]) == (6, 2)
    assert (job["distillation"]["n_gpus_per_node"], job["distillation"]["nnodes"]) == (2, 2)


def test_the_launcher_composes_what_the_export_validated(launched):
    """Hydra in main_ppo and our compose (stages/verl/checks.py) give the same tree for the same overrides."""
    from omegaconf import OmegaConf

    from stages.verl import checks

    moved, job, _ = launched
    ours = checks.compose_verl(bundle.absolute((moved / "overrides.txt").read_text().splitlines(), moved))
    assert OmegaConf.to_container(ours) == job


def test_every_path_key_is_made_absolute(launched):
    moved, job, _ = launched
    for key in keys.PATH_KEYS:
        node = job
        for part in key.split("."):
            node = node[part]
        assert node.startswith(str(moved) + "/"), (key, node)


def test_side_pins_are_the_ones_install_sh_names():
    from side import SIDE

    from support import ROOT

    install = (ROOT / "install.sh").read_text()
    for pins in SIDE.values():
        for pin in pins:
            assert f" {pin}" in install, f"install.sh's side-install block does not name {pin}"
    assert "python tests/side.py" in install
