"""Sizing a bundle for a cluster (stages/verl/sizing.py): pools that pack onto the nodes, sequences that
divide over the student's GPUs, micro-batches and vLLM shares from our weight-free memory plan, and a
one-line exit 2 when the numbers cannot divide. All weight-free: the models are conf/arch shapes."""
from __future__ import annotations

import pytest

from support import TINY, opd
from stages.run import config
from stages.errors import UserError
from stages.verl import sizing
from stages.verl.sizing import Cluster

PAIR_360M = ["student.name=arch:smollm2-360m", "student.init=random", "teacher.name=arch:smollm2-1.7b",
             "teacher.init=random"]


@pytest.mark.parametrize("c,tp,want", [
    (Cluster(8, 2, 4), 1, (6, 2)),  # each node: 6 student + 2 teacher
    (Cluster(8, 2, 4), 4, (4, 4)),  # a teacher replica of 4 stays on one node: 3 student groups of 4
    (Cluster(8, 1, 1), 1, (7, 1)),
    (Cluster(2, 1, 1), 1, (1, 1)),
    (Cluster(4, 3, 4), 2, (4, 4)),
    (Cluster(8, 2, 3), 3, (1, 3)),  # 13 student GPUs (a prime): 13 groups of 1
    (Cluster(4, 2, 6), 3, None),  # two teacher replicas of 3 and 2 student GPUs cannot share 2 nodes of 4
])
def test_layout_packs_the_pools_onto_the_nodes(c, tp, want):
    got = sizing.layout(c, tp)
    assert got == want
    if got:
        a, t = got
        A, T = c.gpus * c.nodes - c.teacher_gpus, c.teacher_gpus
        assert sizing.first_fit([a] * (A // a) + [t] * (T // t), c.nodes, c.gpus) and t % tp == 0


def test_micro_batch_and_memory_come_from_the_plan():
    cfg = config.compose([*PAIR_360M, "rollout.batch_size=32", "rollout.n=4", "data.max_prompt_tokens=512",
                          "rollout.max_new_tokens=1024"])
    s = sizing.size(cfg, Cluster(gpus=8, nodes=2, teacher_gpus=8, gpu_gib=24))
    need = s.plan["actor_rollout"]["update_gib_by_micro_batch"]
    usable = 24 * (1 - cfg.memory.margin)
    assert s.plan["actor_rollout"]["sequences_per_gpu"] == 16 and 16 % s.micro_batch == 0
    assert need[s.micro_batch] <= usable and all(need[m] > usable for m in need if m > s.micro_batch)
    assert 1 <= s.micro_batch < 16  # 16 sequences of 1536 tokens do not fit one 24 GiB GPU's update
    assert (s.actor_per_group, s.actor_groups, s.teacher_per_group, s.teacher_groups) == (8, 1, 8, 1)
    assert s.teacher_tp == 1 and 0 < s.rollout_util <= 0.9 and s.teacher_util == 0.9


def test_teacher_tensor_parallel_is_the_fewest_gpus_that_hold_it():
    cfg = config.compose([*PAIR_360M, "rollout.batch_size=8"])
    s = sizing.size(cfg, Cluster(gpus=8, nodes=1, teacher_gpus=4, gpu_gib=3))  # 1.7B bf16 = 3.4 GiB of weights
    assert s.teacher_tp == 2 and s.plan["teacher"]["weights_gib_per_gpu"] <= 3 * 0.9
    with pytest.raises(UserError, match="--teacher-tp 1: the teacher's weights need"):
        sizing.size(cfg, Cluster(gpus=8, nodes=1, teacher_gpus=4, teacher_tp=1, gpu_gib=3))


def test_numbers_that_cannot_divide_are_one_line_exit_2(work):
    r = opd("stage", "export", "--verl", "out", "--gpus", "8", "--nodes", "2", "--teacher-gpus", "4", *TINY, "train.updates=2",
            cwd=work, check=False)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == ("error: rollout.batch_size x rollout.n = 4 sequences per step do not divide over the "
                                "student's 12 GPUs (2 x 8 - 4 teacher); use --teacher-gpus 12 or 14 or 15, or "
                                "rollout.batch_size a multiple of 12")
    assert not (work / "out").exists() and not (work / "artifacts" / "store" / "update").exists()  # before any work


@pytest.mark.parametrize("c,needle", [
    (Cluster(gpus=4, teacher_gpus=4), "--teacher-gpus 4: the cluster has 4 GPUs (1 x 4)"),
    (Cluster(gpus=8, teacher_gpus=4, teacher_tp=3), "--teacher-tp 3: must divide --teacher-gpus 4"),
    (Cluster(gpus=0), "--gpus 0: expected a positive integer"),
    (Cluster(gpus=3, nodes=2, teacher_gpus=4, teacher_tp=2), "no split into equal placement groups fits the nodes"),
    (Cluster(gpus=7, teacher_gpus=1, gpu_gib=0.005), "do not fit 0.0 GiB usable per GPU"),
])
def test_refusals_name_the_numbers(c, needle):
    cfg = config.compose([*TINY, "rollout.batch_size=2", "rollout.n=3"])
    with pytest.raises(UserError) as e:
        sizing.size(cfg, c)
    assert needle in str(e.value) and "\n" not in str(e.value)
