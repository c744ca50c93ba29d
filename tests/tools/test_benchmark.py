"""`opd benchmark tooluse`: config errors and undeclared arm differences are rejected before any model
loads (exit 2, naming the field); a tiny end-to-end run writes the schema'd JSON + Markdown and a
re-run reuses every finished arm; failure attribution classes."""
from __future__ import annotations

import json

import pytest
import yaml

from support import TINY, opd
from stages import tooleval

BASE = [*TINY[:-2], "objective.topk=8", "env.name=calculator", "env.split=easy", "env.num_train=6", "env.num_test=2",
        "env.max_turns=2", "env.max_tokens_per_turn=6", "sft.steps=1", "sft.teacher_steps=1", "runtime.threads=1"]
ARMS = [{"name": "cold-start-only", "method": "none"},
        {"name": "sft-continued", "method": "sft"},
        {"name": "opd-protocol-sft-teacher", "method": "opd", "declare": ["teacher_mode"],
         "overrides": ["teacher_mode=protocol_sft"]}]


def write(path, **changes):
    b = {"schema_version": 1, "name": "tiny", "out_dir": "results", "seeds": [0], "updates": 1, "base": BASE,
         "arms": ARMS, **changes}
    path.write_text(yaml.safe_dump(b))
    return path


@pytest.mark.parametrize("changes,needle", [
    ({"arms": ARMS + [{"name": "sneaky", "method": "opd", "declare": ["teacher_mode"],
                       "overrides": ["teacher_mode=raw", "optim.lr=0.05"]}]}, "optim.lr"),
    ({"arms": [{"name": "x", "method": "opd", "overrides": ["teacher_mode=privileged_context"]}]}, "teacher_mode"),
    ({"arms": [{"name": "x", "method": "opd", "declare": ["train.updates"], "overrides": ["train.updates=5"]}]},
     "train.updates"),
    ({"arms": [{"name": "x", "method": "opd", "declare": ["env"], "overrides": ["env.num_test=1"]}]}, "env"),
    ({"arms": [{"name": "x", "method": "grpo"}]}, "method"),
    ({"arms": [{"name": "x", "method": "none", "overridez": []}]}, "overridez"),
    ({"updatez": 3}, "updatez"),
    ({"base": [b for b in BASE if not b.startswith("env.name")]}, "env.name"),
])
def test_bad_benchmarks_exit_2_before_loading_models(work, changes, needle):
    cfg = write(work / "bench.yaml", **changes)
    r = opd("benchmark", "tooluse", str(cfg), cwd=work, check=False)
    assert r.returncode == 2 and needle in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (work / "artifacts" / "store" / "init").exists()  # nothing was loaded or computed


def test_tiny_benchmark_end_to_end_and_rerun_reuses_arms(work):
    cfg = write(work / "bench.yaml")
    opd("benchmark", "tooluse", str(cfg), cwd=work, timeout=900)
    doc = json.loads((work / "results" / "tiny.json").read_text())
    assert doc["schema"] == "opd-stages/tooluse-benchmark" and doc["schema_version"] == 1
    rs = {r["arm"]: r for r in doc["results"]}
    assert set(rs) == {a["name"] for a in ARMS}
    assert rs["cold-start-only"]["updates"] == 0 and rs["sft-continued"]["updates"] == 1
    assert rs["opd-protocol-sft-teacher"]["updates"] == 1 and rs["opd-protocol-sft-teacher"]["objective"] == "forward_kl_topk"
    for r in doc["results"]:
        for key in ("success", "success_lenient", "avg_turns", "invalid_call_rate", "tokens_per_task",
                    "train_seconds", "peak_memory_gib"):
            assert r[key] is not None, key
        fa = r["failure_attribution"]
        assert fa["failures"] == fa["presentational"] + fa["substantive"] == round((1 - r["success"]) * 2)
    # one cold start per seed, shared: every arm's policy chain starts from the same sft digest
    assert rs["opd-protocol-sft-teacher"]["shared"]["cold_start_seconds"] == rs["cold-start-only"]["shared"][
        "cold_start_seconds"]
    md = (work / "results" / "tiny.md").read_text()
    assert "| arm | seed | objective | updates | strict success | lenient success |" in md
    assert "presentational" in md and "opd benchmark" in md
    opd("benchmark", "tooluse", str(cfg), cwd=work, timeout=900)
    again = json.loads((work / "results" / "tiny.json").read_text())
    assert all(r["new_store_entries"] == 0 for r in again["results"])
    strip = lambda rr: [{k: v for k, v in r.items() if k != "new_store_entries"} for r in rr]  # noqa: E731
    assert strip(again["results"]) == strip(doc["results"])


def _row(success=False, lenient=False, answer=None, turns=()):
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "What is 6 times 7?"}] + list(turns)
    return {"success": success, "success_lenient": lenient, "answer": answer, "messages": json.dumps(msgs)}


def test_failure_attribution_classes():
    call = {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}'
                                            '</tool_call>'}
    got = {"role": "tool", "content": '<tool_result>{"result": 42, "rounded": "42"}</tool_result>'}
    assert tooleval.attribute(_row(success=True, lenient=True, answer="42"), "42") == (None, None)
    assert tooleval.attribute(_row(lenient=True, answer="42.0"), "42") == ("presentational", "lenient-only")
    assert tooleval.attribute(_row(turns=[call, got, {"role": "assistant", "content": "It is forty-two"}]), "42") == \
        ("presentational", "answer-reached-not-delivered")
    assert tooleval.attribute(_row(turns=[{"role": "assistant", "content": "hmm"}]), "42") == \
        ("substantive", "no-valid-action")
    assert tooleval.attribute(_row(answer="41", turns=[{"role": "assistant", "content": "<final>41</final>"}]),
                              "42") == ("substantive", "wrong-final-answer")
    bad = {"role": "tool", "content": '<tool_result>{"error": "division by zero"}</tool_result>'}
    assert tooleval.attribute(_row(turns=[call, bad]), "42") == ("substantive", "out-of-turns")


def test_the_committed_tooluse_result_matches_its_config_and_the_readme():
    """The real experiment (hours on a CPU) is not re-run here: its config must still compose for every
    arm x seed, the committed result must be that config's, and the README's table must quote it."""
    import re

    from stages.tools import benchmark
    from support import ROOT

    b = benchmark.load(ROOT / "conf" / "benchmark" / "tooluse.yaml")
    cfgs = benchmark.configs(b)
    assert {k for k in cfgs if k[0]} == {(a["name"], s) for a in b["arms"] for s in b["seeds"]}  # + a base per seed
    doc = json.loads((ROOT / "benchmarks" / "results" / f"{b['name']}.json").read_text())
    assert doc["schema"] == "opd-stages/tooluse-benchmark" and doc["benchmark"]["arms"] == b["arms"]
    assert {(r["arm"], r["seed"]) for r in doc["results"]} == {(a["name"], s) for a in b["arms"] for s in b["seeds"]}
    assert all(r["updates"] == (0 if r["arm"] == "cold-start-only" else b["updates"]) for r in doc["results"])
    # student and teacher are the same model there, so the protocol-SFT teacher was evaluated too
    teacher = [r["shared"]["teacher_success"] for r in doc["results"] if r["arm"] == "opd-protocol-sft-teacher"]
    assert len(teacher) == 2 and 0 <= teacher[0] <= 1 and doc["machine"]["code"]
    readme = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| [^|]+ \| (\d\.\d{3}), (\d\.\d{3}) \| (\d\.\d{3}) \|", readme, flags=re.M)
    quoted = sorted((float(a), float(b_), float(m)) for a, b_, m in rows)
    committed = sorted((*(round(x, 3) for x in m["per_seed_success"]), round(m["success"], 3)) for m in doc["means"])
    assert quoted == committed
