"""The layout and the dependency direction of `stages` (docs/architecture.md, "Dependency rule"),
read from the code with `ast`: layers bottom up, each importing only its own layer and those below;
no import cycle; no import inside a function to dodge one."""
from __future__ import annotations

import ast
from pathlib import Path

from stages.tools import dvcyaml

# Function-level imports of modules of `stages` that are allowed, and why. Each keeps a heavy or
# optional third-party dependency (torch, transformers, matplotlib, hydra) off a path that must work
# without it; none of them avoids a cycle (the graph stays acyclic with them counted as imports).
ALLOWED_LATE = {
    "stages.cli": "each command imports its module when it runs: `opd --help` and `opd doctor` stay fast and "
                  "work when torch or transformers is broken (doctor reports it; tests/test_optional_deps.py)",
    "stages.verl.cli": "the verl-facing commands, registered as `opd`'s parser is built: each imports what it "
                       "runs when it runs, as stages.cli's do (`opd --help` imports no torch)",
    "stages.tools.doctor": "doctor checks that torch, transformers and hydra import before importing the "
                           "modules that need them (models, config), so a missing package is a finding, "
                           "not a traceback",
}

# the DVC stages and the in-loop stages, side by side at the top of the package
PIPELINE = {"stages.prepare", "stages.rollout", "stages.align", "stages.score", "stages.update", "stages.evaluate",
            "stages.export", "stages.report", "stages.report_html", "stages.sft", "stages.tooleval"}
# Layers, bottom up (a module may import its own layer and the layers below it, never above)
LAYERS = [{"stages.errors"}, {"stages.objectives", "stages.envs"}, {"stages.run"}, {"stages.rows", "stages.weights"},
          {"stages.engine"}, {"stages.memory"}, {"stages.session"}, PIPELINE, {"stages.train"}, {"stages.tools"},
          {"stages.verl"}, {"stages.cli"}]
PACKAGES = {"stages.objectives", "stages.envs", "stages.run", "stages.rows", "stages.weights", "stages.engine",
            "stages.memory", "stages.tools", "stages.verl"}


def layer(module: str) -> int:
    for i, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return i
    raise AssertionError(f"{module}: in no layer of tests/test_architecture.py (add it where it belongs)")


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_cycle():
    g = dvcyaml.graph()  # every import, function-level ones included
    assert _cycles(g) == []


def test_no_function_level_import_of_our_own_modules_outside_the_allowlist():
    mods = dvcyaml.modules()
    late = {}
    for name, path in mods.items():
        for dep, top in dvcyaml.imports(path, set(mods)):
            if not top and name not in ALLOWED_LATE:
                late.setdefault(name, set()).add(dep)
    assert late == {}


def test_the_top_of_the_package_is_the_stages_the_driver_the_session_and_the_cli():
    g = dvcyaml.graph()
    top = {m for m in g if m.count(".") == 1 and m not in PACKAGES}
    assert top == PIPELINE | {"stages.errors", "stages.session", "stages.train", "stages.cli"}


def test_every_import_points_down_or_across_a_layer():
    g = dvcyaml.graph()
    up = {m: sorted(d for d in deps if d != "stages" and d not in PACKAGES and layer(d) > layer(m))
          for m, deps in g.items() if m != "stages"}
    assert {m: d for m, d in up.items() if d} == {}


def test_stage_modules_import_no_other_stage():
    """Each stage reads like a recipe over the layers below it; only the report's HTML sections are
    a module of their own beside it."""
    g = dvcyaml.graph()
    bad = {m: sorted((g[m] & PIPELINE) - {"stages.report_html"}) for m in PIPELINE}
    assert {m: d for m, d in bad.items() if d} == {}


def test_the_driver_is_what_the_cli_runs_stages_through():
    g = dvcyaml.graph()
    assert {"stages.rollout", "stages.score", "stages.update", "stages.sft"} <= g["stages.train"]
    assert "stages.train" not in g["stages.session"] and not any("stages.train" in g[m] for m in PIPELINE)


def test_late_imports_are_seen():
    """The checker itself: a function-level import is reported as such."""
    src = "from . import a\n\ndef f():\n    from . import b\n"
    tree = ast.parse(src)
    assert [isinstance(n, ast.ImportFrom) for n in tree.body] == [True, False]


def test_test_module_names_are_unique_across_tests():
    """pytest imports test folders' modules by basename (each folder joins sys.path), so two helper
    modules of one name shadow each other depending on collection order (tests/tinymodels.py once hid
    tests/verl/tinymodels.py). conftest.py is pytest's own per-folder file."""
    from collections import Counter

    names = Counter(p.name for p in Path(__file__).parent.rglob("*.py") if p.name != "conftest.py")
    assert [n for n, c in names.items() if c > 1] == []


def test_no_module_of_stages_is_over_400_lines():
    """Short files (docs/architecture.md, "Layout"): a module past 400 lines is doing two jobs."""
    root = Path(__file__).resolve().parents[1] / "stages"
    long = {str(p.relative_to(root)): n for p in root.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


def test_importing_the_package_changes_nothing_in_the_process():
    """Process-wide settings (MKL_CBWR, malloc's) are made by the CLI's entry point, not by `import stages`."""
    import subprocess
    import sys

    code = ("import os, stages, stages.run.config; from stages.memory import hostmem; "
            "print('MKL_CBWR' in os.environ, hostmem._applied is not None)")
    env = {k: v for k, v in __import__("os").environ.items() if k != "MKL_CBWR"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["False", "False"]
