"""The dependency direction of `stages` (docs/architecture.md), read from the code with `ast`:
CLI -> driver (train) -> stage modules -> Session -> building blocks. No import cycle, no import
inside a function to dodge one."""
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

PIPELINE = {"stages.prepare", "stages.rollout", "stages.score", "stages.update", "stages.evaluate",
            "stages.export", "stages.sft", "stages.tooleval"}
DRIVER = "stages.train"
SESSION = "stages.session"
CLI = "stages.cli"
# the layout shows the roles: user tools in stages/tools/, building blocks in stages/blocks/ (with
# objectives/, envs/ and verl/ less the three verl modules that run the driver or a tool)
TOOLS = {CLI} | {m for m in dvcyaml.modules() if m.startswith("stages.tools.")}


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


def _pkg_only(deps: set[str]) -> set[str]:
    """Drop the package __init__ modules (importing stages.x runs stages/__init__.py; not a dependency)."""
    return {d for d in deps if d not in ("stages", "stages.blocks", "stages.tools", "stages.verl", "stages.envs",
                                         "stages.objectives")}


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


def test_stage_modules_import_no_other_stage_and_not_the_driver():
    g = dvcyaml.graph()
    # the top of the package is the CLI, the driver, the stages and the Session, nothing else
    top = {m for m in g if m.count(".") == 1 and m not in ("stages.blocks", "stages.tools", "stages.verl",
                                                           "stages.envs", "stages.objectives")}
    assert top == PIPELINE | {DRIVER, SESSION, CLI}
    bad = {m: sorted(_pkg_only(g[m]) & (PIPELINE | {DRIVER} | TOOLS)) for m in PIPELINE}
    assert {m: d for m, d in bad.items() if d} == {}


def test_session_and_building_blocks_never_reach_up():
    g = dvcyaml.graph()
    up = PIPELINE | {DRIVER} | TOOLS | {"stages.verl.cli", "stages.verl.bundle", "stages.verl.planfile"}
    blocks = {m for m in g if m not in up and m != SESSION}
    assert sorted(_pkg_only(g[SESSION]) & up) == []
    assert {m: sorted(_pkg_only(g[m]) & (up | {SESSION})) for m in blocks if _pkg_only(g[m]) & (up | {SESSION})} == {}


def test_the_driver_is_what_the_cli_runs_stages_through():
    g = dvcyaml.graph()
    assert PIPELINE - {"stages.export", "stages.evaluate", "stages.tooleval"} <= g[DRIVER] | {"stages.prepare"}
    assert DRIVER not in g[SESSION] and not any(DRIVER in g[m] for m in PIPELINE)


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
