"""DVC-native metrics and plots, for real: a temporary git repo holding a copy of the project,
`dvc repro` on tiny models (the `repo` fixture, tests/integration/conftest.py), then `dvc plots show`
(JSON and HTML), `dvc exp show`, `dvc metrics diff` and `dvc plots diff` across an experiment run
with `dvc exp run -S`: the tables as a reader sees them at 120 columns."""
from __future__ import annotations

import csv
import json
import re
import shlex

from dvcrepo import dvc
from support import ROOT, TINY, opd

# what the issue asks history.csv to carry, one row per update
HISTORY_COLUMNS = ["step", "kl", "loss", "grad_norm", "rollout_tokens_per_s", "score_tokens_per_s",
                   "update_tokens_per_s", "peak_memory_gib", "teacher_topk_mass", "topk_overlap"]
PLOTS = {"KL and loss per update": {"loss", "kl"},
         "Throughput (tokens/s) per phase": {"rollout_tokens_per_s", "score_tokens_per_s", "update_tokens_per_s"},
         "Peak memory (GiB)": {"peak_memory_gib"},
         "Gradient norm per update": {"grad_norm"},
         "Teacher top-k mass and student overlap": {"teacher_topk_mass", "student_topk_mass", "topk_overlap"}}


def test_history_has_the_columns_the_issue_asks(repo):
    rows = list(csv.DictReader(open(repo / "artifacts/runs/default/history.csv")))
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    for col in HISTORY_COLUMNS:
        assert col in rows[0], col
        assert all(r[col] != "" and float(r[col]) == float(r[col]) for r in rows), col  # present, not NaN
    assert all(float(r["rollout_tokens_per_s"]) > 0 and float(r["peak_memory_gib"]) > 0 for r in rows)
    assert (repo / "artifacts/runs/default/report.html").stat().st_size > 10_000  # the report stage ran


def test_plots_show_renders_the_curves(repo, tmp_path):
    shown = json.loads(dvc("plots", "show", "--json", cwd=repo).stdout)
    assert not shown.get("errors"), shown.get("errors")
    data = shown["data"]
    for title, fields in PLOTS.items():
        values = data[title][0]["content"]["data"]["values"]
        # DVC names the y column in "field" when a plot has several (one y: the plot's own)
        (only,) = fields if len(fields) == 1 else (None,)
        assert {v.get("field", only) for v in values} == fields, title
        assert sorted({int(v["step"]) for v in values}) == [1, 2, 3], title
        ys = [float(v[v.get("field", only)]) for v in values]
        assert all(y == y for y in ys), title  # numbers, not NaN
    out = tmp_path / "plots"
    dvc("plots", "show", "-o", str(out), cwd=repo)
    page = (out / "index.html").read_text()
    assert all(title in page for title in PLOTS) and page.count('"$schema"') >= len(PLOTS)


def test_top_level_plots_follow_run(repo):
    """dvc.yaml's top-level plots interpolate ${run} from params.yaml (keys included)."""
    params = (repo / "params.yaml").read_text()
    try:
        (repo / "params.yaml").write_text(params.replace("run: default", "run: other"))
        shown = json.loads(dvc("plots", "show", "--json", cwd=repo, check=False).stdout)
        sources = {e["source"] for e in shown.get("errors", [])}
        assert sources == {"artifacts/runs/other/history.csv"}, shown
    finally:
        (repo / "params.yaml").write_text(params)


def test_second_repro_runs_no_stage(repo):
    import time

    t = time.perf_counter()
    r = dvc("repro", cwd=repo)
    assert time.perf_counter() - t <= 15
    assert "Running stage" not in r.stdout and "up to date" in r.stdout


def test_exp_show_and_plots_diff_compare_experiments(repo):
    overrides = [*TINY[:-2], "train.updates=4", "objective.topk=8"]
    sets = [a for o in overrides for a in ("-S", o)]
    dvc("exp", "run", *sets, "-n", "four-updates", cwd=repo)
    # `dvc exp run -S` composed conf/ through DVC's Hydra support; `opd params` must write the same file
    opd("params", "--out", "opd-params.yaml", *overrides, cwd=repo)
    assert (repo / "params.yaml").read_text() == (repo / "opd-params.yaml").read_text()
    rows = json.loads(dvc("exp", "show", "--json", cwd=repo).stdout)
    baseline = next(r for r in rows if r["rev"] != "workspace")
    exp = baseline["experiments"][0]["revs"][0]
    assert exp["name"] == "four-updates"
    got = {}
    for name, rev in (("baseline", baseline), ("exp", exp)):
        m = rev["data"]["metrics"]["artifacts/runs/default/metrics.json"]["data"]
        p = rev["data"]["params"]["params.yaml"]["data"]
        assert set(m) == set(METRICS) and all(isinstance(v, (int, float)) for v in m.values()), m  # flat
        got[name] = (p["train"]["updates"], m["updates"], m["kl_after"])
    assert got["baseline"][:2] == (3, 3) and got["exp"][:2] == (4, 4)
    assert_readable_at_120_columns(repo)
    # the README's --only-changed: the varied setting is a column, settings both share are not
    # (DVC applies --only-changed to the table, and so to its CSV form; --json stays complete)
    header = dvc("exp", "show", "--only-changed", "--csv", cwd=repo).stdout.splitlines()[0].split(",")
    assert any(c.endswith("train.updates") for c in header) and not any(c.endswith("lora.r") for c in header), header
    assert len(header) < len(dvc("exp", "show", "--csv", cwd=repo).stdout.splitlines()[0].split(",")) / 2, header
    diff = json.loads(dvc("plots", "diff", baseline["rev"], exp["rev"], "--json", cwd=repo).stdout)
    assert not diff.get("errors"), diff.get("errors")
    values = diff["data"]["KL and loss per update"][0]["content"]["data"]["values"]
    steps = {}
    for v in values:
        steps.setdefault(v["rev"], set()).add(int(v["step"]))
    assert sorted(steps.values(), key=len) == [{1, 2, 3}, {1, 2, 3, 4}]


# metrics.json's keys (stages/run/runview.py `headline`): one narrow column each
METRICS = ["acc_after", "acc_before", "acc_teacher", "agree_after", "agree_before", "kl_after", "kl_before",
           "nonblank_after", "updates", "worse"]  # (acc_*: the generator's arithmetic rows carry a ground truth)


def readme_command(prefix: str) -> list[str]:
    """The README's command starting `prefix`, as argv without `dvc`."""
    (line,) = [c for c in re.findall(r"^dvc .*$", (ROOT / "README.md").read_text(), flags=re.M) if c.startswith(prefix)]
    return shlex.split(line)[1:]


def _width(text: str) -> int:
    return max(len(line.rstrip()) for line in text.splitlines())


def assert_readable_at_120_columns(repo):
    """README's `dvc exp show` and `dvc metrics diff` after the baseline commit and one experiment: at
    COLUMNS=120 no column is cut to `…` (rich cuts where no pager runs: --no-pager), the natural width
    (what `less -S` would scroll past) is at most 120, the figures are under metrics.json's flat names,
    and no row has a `!` (metrics DVC could not read for that revision, e.g. a baseline without them)."""
    show = readme_command("dvc exp show")
    assert show[:3] == ["exp", "show", "--only-changed"], show
    cols = {"COLUMNS": "120"}
    table = dvc(*show, cwd=repo, env=cols).stdout  # not a terminal: the table at its natural width
    cut = dvc(*show, "--no-pager", cwd=repo, env=cols).stdout  # what a 120-column terminal shows
    print(table)
    assert _width(table) <= 120 and "…" not in cut, cut
    header, *rows = [line for line in table.splitlines() if line.strip().strip("─")]  # (rules dropped)
    assert "kl_after" in header.split() and "train.updates" in header.split() and "/" not in header, header
    # workspace, the baseline commit, the experiment
    assert len(rows) == 3 and rows[2].strip().startswith("└──") and not any("!" in r for r in rows), table
    diff = dvc(*readme_command("dvc metrics diff"), cwd=repo, env=cols).stdout
    full = dvc("metrics", "diff", "--all", cwd=repo, env=cols).stdout  # every figure, changed or not
    print(diff, full, sep="\n")
    assert "kl_after" in diff and _width(diff) <= _width(full) <= 120 and "…" not in full, full
    assert {line.split()[1] for line in full.splitlines()[1:] if line.strip()} == set(METRICS), full
