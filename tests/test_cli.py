"""The command line is a map of the pipeline and the tools: `opd stage NAME` is a DVC stage (or one
step of train), each job has one verb, and an old spelling gets a one-line error naming the new one."""
from __future__ import annotations

import pytest

from stages import cli
from stages.tools import dvcyaml
from stages.run import pipeline


@pytest.mark.parametrize("argv,new", [
    (["export", "--verl", "out"], "opd stage export"),
    (["bench", "systems", "--workload", "all"], "opd benchmark systems"),
    (["stage", "init"], "opd stage train"),
    (["stage", "sft", "env.name=calculator"], "opd tooleval --step 0"),
    (["stage", "tooleval", "--step", "2"], "opd tooleval"),
    (["benchmark", "conf/benchmark/tooluse.yaml"], "opd benchmark tooluse CONFIG"),
])
def test_old_spellings_name_the_new_one(argv, new, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: `opd ") and new in err, err


def test_stage_names_are_the_dvc_stages_and_the_steps_of_train():
    """One declaration (stages/run/pipeline.py) for dvc.yaml's stages and `opd stage`'s names."""
    assert cli.STAGES is pipeline.STAGES and dvcyaml.PIPELINE is pipeline.PIPELINE
    assert cli.STAGES == ("prepare", "train", "evaluate", "export", "report")
    assert cli.STEPS == ("rollout", "align", "score", "update")
    stage = cli.build_parser()._subparsers._group_actions[0].choices["stage"]
    assert set(stage._actions[1].choices) == set(cli.STAGES) | set(cli.STEPS)


def test_every_dvc_command_is_an_opd_stage():
    for name, (cmd, *_rest) in dvcyaml.PIPELINE.items():
        assert cmd == f"opd stage {name} --params params.yaml"


def test_each_verb_once():
    verbs = set(cli.build_parser()._subparsers._group_actions[0].choices)
    assert {"stage", "run", "params", "tooleval", "benchmark", "report", "inspect", "plan", "doctor", "dvc-yaml",
            "profiles", "compat", "data", "store"} == verbs
    for old, _ in cli.MOVED.items():
        assert len(old) > 1 or old[0] not in verbs


@pytest.mark.parametrize("argv,needle", [
    (["stage", "rollout"], "--step N"),
    (["stage", "train", "--step", "2"], "--step is for rollout, align, score, update"),
    (["stage", "train", "--verl", "x"], "--out, --merged and --verl are for export"),
    (["stage", "evaluate", "--merged"], "--out, --merged and --verl are for export"),
])
def test_stage_arguments_are_checked_before_anything_runs(argv, needle, capsys):
    assert cli.main(argv) == 2
    assert needle in capsys.readouterr().err


def test_help_imports_neither_torch_nor_transformers():
    """`opd` and `opd --help` build the whole parser (the verl commands' too) without importing what the
    commands run: a fresh process, so this test process's own imports do not count."""
    import subprocess
    import sys

    code = ("import sys\nfrom stages import cli\ncli.build_parser()\n"
            "print(sorted(m for m in ('torch', 'transformers', 'peft', 'pyarrow') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
