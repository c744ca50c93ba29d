"""benchmarks/first_update.py's summary of py-spy's raw stacks (seconds = samples / rate)."""
from __future__ import annotations

import gzip
import sys

from support import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import first_update  # noqa: E402

RAW = f"""\
process 7:"python -m stages.cli";thread (0x1): MainThread;main ({ROOT}/stages/cli.py:10);load ({ROOT}/stages/weights/models.py:200);<module> (/x/lib/python3.12/site-packages/sklearn/__init__.py:1) 300
process 7:"python -m stages.cli";thread (0x1): MainThread;main ({ROOT}/stages/cli.py:12);load ({ROOT}/stages/weights/models.py:219);from_pretrained (/x/lib/python3.12/site-packages/transformers/modeling_utils.py:3818) 100
process 7:"python -m stages.cli";thread (0x1);<module> (<frozen runpy>:1) 20
process 7:"python -m stages.cli";thread (0x2): opd-verify;_check ({ROOT}/stages/run/store.py:90) 50
"""


def test_summary_charges_each_function_once_per_stack_and_merges_lines(tmp_path):
    raw = tmp_path / "first.pyspy"
    raw.write_text(RAW)
    s = first_update.summarise(raw)
    assert s["threads_s"] == [["thread (0x1): MainThread", 2.1], ["thread (0x2): opd-verify", 0.25]]
    incl = dict(s["main_inclusive_s"])
    # main and load at two lines each: one key per function, paths relative to the repo / site-packages
    assert incl["main (stages/cli.py)"] == 2.0 and incl["load (stages/weights/models.py)"] == 2.0
    assert incl["<module> (sklearn/__init__.py)"] == 1.5
    assert incl["<module> (<frozen runpy>)"] == 0.1  # the main thread's samples before it was named
    assert dict(s["main_own_s"]) == {"<module> (sklearn/__init__.py)": 1.5,
                                     "from_pretrained (transformers/modeling_utils.py)": 0.5,
                                     "<module> (<frozen runpy>)": 0.1}
    md = first_update.markdown({"device": "cpu", "torch": "x", "command": "c", "processes": [
        {"name": "first-1", "sampler": "py-spy --nonblocking", "process_wall_s": 3.0, "first_update_s": 2.0,
         "startup_s": {"update_done": 2.0, "prepared": 0.1}, "profile": s}]})
    assert "| first-1 (py-spy --nonblocking) | 3.0 | 2.0 | prepared 0.1, update_done 2.0 |  |" in md
    assert "| 1.5 | `<module> (sklearn/__init__.py)` |" in md
    assert "idle time included" in md and "Seconds per thread: " in md
    # --sampler py-spy-gil: the samples are the lock holder's, and the headers say so
    held = first_update.markdown({"device": "cpu", "torch": "x", "command": "c", "processes": [
        {"name": "first-1", "sampler": "py-spy --nonblocking --gil", "process_wall_s": 3.0, "first_update_s": 2.0,
         "startup_s": {}, "profile": s}]})
    assert "the interpreter lock holder alone" in held and "idle time included" not in held
    assert "Seconds holding the interpreter lock, per thread: " in held and "Seconds per thread: " not in held
    gz = tmp_path / "first.pyspy.gz"  # as the driver keeps it
    gz.write_bytes(gzip.compress(RAW.encode()))
    assert first_update.summarise(gz) == s
    # inside load: its callees, each sample once (the outermost load frame), main thread only
    assert first_update.under(gz, "load (stages/") == [["<module> (sklearn/__init__.py)", 1.5],
                                                      ["from_pretrained (transformers/modeling_utils.py)", 0.5]]
    assert first_update.under(gz, "main (stages/cli.py)") == [["load (stages/weights/models.py)", 2.0]]
    # --imports: seconds per module imported, inclusive (the nested one counts in its importer too)
    nested = tmp_path / "nested.pyspy"
    nested.write_text(RAW.replace("sklearn/__init__.py:1) 300", "sklearn/__init__.py:1);<module> "
                                  "(/x/lib/python3.12/site-packages/scipy/__init__.py:3) 300"))
    assert first_update.imports(nested) == [["sklearn/__init__.py", 1.5], ["scipy/__init__.py", 1.5],
                                            ["<frozen runpy>", 0.1]]
    assert first_update.imports(nested, "from_pretrained") == []
    assert first_update.imports(nested, "load (stages/") == [["sklearn/__init__.py", 1.5], ["scipy/__init__.py", 1.5]]


def test_cold_sets_compare_every_process_and_show_the_warmup_record():
    """--cold: every process ran on empty compile caches, so none is left out of the comparison
    (without it the first process of all is: its caches were the machine's cold ones); the
    warm-up's and the precompiling children's records are shown beside the construction pieces."""
    procs = [{"name": n, "process_wall_s": 9.0, "first_update_s": t, "startup_s": {"policy0_published": 6.0},
              "warmup": w} for n, t, w in (("against-1", 9.5, {"warmup_s": 7.5}),
                                            ("first-1", 8.5, {"precompile_parts": ["draw", "step"], "warmup_s": 6.4,
                                                              "precompile_s": 6.2}),
                                            ("against-2", 10.4, {"warmup_s": 8.0}),
                                            ("first-2", 9.1, {"precompile_s": 6.9, "warmup_s": 7.0}))]
    assert first_update.compare(procs, cold=True) == {"ours": [8.5, 9.1], "against": [9.5, 10.4]}
    assert first_update.compare(procs) == {"ours": [8.5, 9.1], "against": [10.4]}
    res = {"device": "cpu", "torch": "x", "command": "c", "processes": procs, "against": ["runtime.precompile=false"]}
    md = first_update.markdown({**res, "cold": True})
    # (the warm-up's seconds count from its start, not the session's opening: a column of their own)
    assert "| first-1 (unsampled) | 9.0 | 8.5 | policy0_published 6.0 | precompile_s 6.2, warmup_s 6.4, " \
        "precompile_parts draw+step |" in md  # (seconds in order, then what it names: warmup.report's list)
    procs[0]["warmup"] = {"warmup_s": 7.5, "precompile_error": "TimeoutExpired: still compiling after 300 s"}
    assert "| warmup_s 7.5, precompile_error TimeoutExpired: still compiling after 300 s |" in first_update.markdown(res)
    assert "every process on empty compile caches of its own (--cold)" in md
    assert "- ours: 8.800 s over 2 (8.500, 9.100)" in md and "- against: 9.950 s over 2 (9.500, 10.400)" in md
    assert "- against: 10.400 s over 1 (10.400)" in first_update.markdown(res)


def test_against_tree_imports_that_trees_stages_and_the_summary_names_it(tmp_path):
    """--against-tree: the comparison set imports the other checkout's stages (checked before any
    process runs: a tree without one would silently run this checkout's), and the summary says which."""
    tree = tmp_path / "before"
    (tree / "stages").mkdir(parents=True)
    (tree / "stages" / "__init__.py").write_text("")
    assert first_update.tree_imports(tree) == str(tree / "stages" / "__init__.py")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert first_update.tree_imports(empty) == str(ROOT / "stages" / "__init__.py")  # (what main refuses)
    procs = [{"name": n, "process_wall_s": 9.0, "first_update_s": t, "startup_s": {}}
             for n, t in (("against-1", 9.0), ("first-1", 8.0), ("against-2", 7.5), ("first-2", 6.0))]
    md = first_update.markdown({"device": "cpu", "torch": "x", "command": "c", "processes": procs, "against": [],
                                "against_tree": str(tree), "against_imports": str(tree / "stages/__init__.py")})
    assert f"Against `the stages of {tree} ({tree / 'stages/__init__.py'})`" in md
    assert "- ours: 7.000 s over 2 (8.000, 6.000)" in md and "- against: 7.500 s over 1 (7.500)" in md


def test_workload_b_runs_b_shape_with_its_settings_and_set_wins():
    """--workload b: workload b's models and batch with systems.B_DEFAULT's settings, a --set after them."""
    w, sets = first_update.shape("b", False, ["train.chunk=2048"])
    assert w["student"] == "qwen3-0.6b" and w["prompts"] == 64 and w["response"] == 512
    assert sets == ["train.activation_checkpointing=true", "train.chunk=1024", "train.chunk=2048"]
    from stages.run import config

    cfg = config.compose(sets)  # (the later override of a key wins)
    assert cfg.train.chunk == 2048 and cfg.train.activation_checkpointing is True
    assert first_update.shape("a", False, []) == (first_update.systems.WORKLOAD_A, [])
    assert first_update.shape("b", True, [])[0] == first_update.systems.WORKLOAD_SMOKE
