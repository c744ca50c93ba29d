"""Security: nothing is pickled (code and outputs), remote model code never runs unless the user
says so, the tool environments cannot execute code or write anything, and no config value can make
a write land outside the artifacts dir."""
from __future__ import annotations

import ast
import copy
import json
import shutil
from pathlib import Path

import pytest
from harness import ROOT, snapshot

STAGES = ROOT / "stages"
PICKLERS = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}


def _modules():
    for f in sorted(STAGES.rglob("*.py")):
        yield f.relative_to(ROOT), ast.parse(f.read_text(), str(f))


def _kw(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def _dotted(node) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def test_no_pickle_anywhere_in_the_code():
    bad = []
    for rel, tree in _modules():
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                bad += [f"{rel}:{n.lineno} import {a.name}" for a in n.names if a.name.split(".")[0] in PICKLERS]
            elif isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] in PICKLERS:
                bad.append(f"{rel}:{n.lineno} from {n.module} import")
            elif isinstance(n, ast.Call):
                f = _dotted(n.func)
                if f.endswith("torch.load"):
                    if not _is_true(_kw(n, "weights_only")):
                        bad.append(f"{rel}:{n.lineno} torch.load without weights_only=True")
                if f.endswith("torch.save"):
                    bad.append(f"{rel}:{n.lineno} torch.save (a pickle)")
                numpy_load = f.split(".")[-1] == "load" and f.split(".")[0] in ("np", "numpy")
                if numpy_load and _is_true(_kw(n, "allow_pickle")):
                    bad.append(f"{rel}:{n.lineno} numpy load with allow_pickle=True")
                if f.split(".")[-1] in ("read_pickle", "to_pickle"):
                    bad.append(f"{rel}:{n.lineno} {f}")
                sf = _kw(n, "safe_serialization")
                if isinstance(sf, ast.Constant) and sf.value is False:
                    bad.append(f"{rel}:{n.lineno} save_pretrained(safe_serialization=False)")
                us = _kw(n, "use_safetensors")
                if isinstance(us, ast.Constant) and us.value is False:
                    bad.append(f"{rel}:{n.lineno} from_pretrained(use_safetensors=False)")
    assert bad == []


def test_no_pickle_anywhere_in_the_outputs(reference):
    """Every file a whole run writes is safetensors, Parquet, JSON/CSV or text: no pickle, no torch.save zip."""
    allowed = {".safetensors", ".parquet", ".json", ".jinja", ".csv", ".txt", ".md", ".yaml", ".html", ".lock"}
    seen = set()
    for f in reference.artifacts.rglob("*"):
        if f.is_file() and not f.is_symlink():
            seen.add(f.suffix)
            head = f.read_bytes()[:4]
            assert not head.startswith(b"\x80") and head != b"PK\x03\x04", f  # pickle protocol 2+ / torch zip
    assert seen <= allowed and ".safetensors" in seen and ".parquet" in seen


def test_trust_remote_code_is_off_unless_set():
    # the default, in the schema and in the shipped config tree
    cfg_src = (STAGES / "run" / "config.py").read_text()
    assert "trust_remote_code: bool = False" in cfg_src
    import yaml

    conf = yaml.safe_load((ROOT / "conf" / "config.yaml").read_text())
    assert conf["student"]["trust_remote_code"] is False and conf["teacher"]["trust_remote_code"] is False
    # every loader passes the user's setting (or nothing: transformers' default is False), never True
    passed = []
    for rel, tree in _modules():
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and (v := _kw(n, "trust_remote_code")) is not None:
                assert not _is_true(v), f"{rel}:{n.lineno} trust_remote_code=True"
                passed.append(ast.unparse(v))
    assert passed and all(p.endswith("trust_remote_code") or p == "False" for p in passed), passed


def test_a_model_with_remote_code_is_refused_and_its_code_never_runs(done):
    """A model dir whose config asks for custom code (auto_map -> evil.py): refused with exit 2,
    and evil.py (which would leave a marker file) is never executed."""
    prep = json.loads((done.artifacts / "runs" / "default" / "prepare.json").read_text())
    evil = done.dir / "in" / "evil"
    shutil.copytree(done.artifacts / "store" / "model" / prep["teacher"], evil, copy_function=shutil.copy)
    marker = done.dir / "remote-code-ran"
    (evil / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                  "from transformers import LlamaConfig, LlamaForCausalLM\n"
                                  "class EvilConfig(LlamaConfig):\n    model_type = 'opd_evil'\n"
                                  "class EvilModel(LlamaForCausalLM):\n    config_class = EvilConfig\n")
    cfg = json.loads((evil / "config.json").read_text())
    cfg.update(model_type="opd_evil", auto_map={"AutoConfig": "evil.EvilConfig",
                                               "AutoModelForCausalLM": "evil.EvilModel"})
    (evil / "config.json").write_text(json.dumps(cfg))
    before = snapshot(done.artifacts)
    r = done.run("teacher.name=in/evil", "teacher.init=pretrained")
    assert r.rc == 2, r
    assert len(r.errors()) == 1 and "in/evil" in r.errors()[0], r
    assert not marker.exists()
    assert snapshot(done.artifacts) == before


@pytest.mark.parametrize("run", ["../../escaped", "/tmp/opd-escaped", "a/../../escaped", ".hidden", ""])
def test_config_cannot_send_writes_outside_the_artifacts_dir(done, run):
    before = snapshot(done.artifacts)
    r = done.run(f"run={run}")
    assert r.rc == 2, r
    assert len(r.errors()) == 1 and "'run'" in r.errors()[0], r
    assert snapshot(done.artifacts) == before
    assert not (done.dir.parent / "escaped").exists() and not Path("/tmp/opd-escaped").exists()


# ---- tool environments: no code execution, no writes, capped arguments and results ---------------

def _task(env):
    return env.generate(env.SPLITS[0], 1, 0, "train")[0]


ATTACKS = {
    "calculator": [("calculator", {"expression": "__import__('os').system('touch {m}')"}),
                   ("calculator", {"expression": "open('{m}', 'w')"}),
                   ("calculator", {"expression": "(1).__class__.__bases__[0].__subclasses__()"}),
                   ("calculator", {"expression": "[x for x in ()]"}),
                   ("calculator", {"expression": "lambda: 0"}),
                   ("calculator", {"expression": "9 ** 9 ** 9"}),
                   ("calculator", {"expression": "1 +" + " 1 +" * 5000 + " 1"}),
                   ("convert", {"value": 1e300, "from_unit": "m", "to_unit": "km"})],
    "sqlite": [("query", {"sql": "DROP TABLE customers"}),
               ("query", {"sql": "DELETE FROM orders"}),
               ("query", {"sql": "INSERT INTO customers VALUES (99, 'x', 'y')"}),
               ("query", {"sql": "UPDATE products SET price = 0"}),
               ("query", {"sql": "ATTACH DATABASE '{m}' AS x"}),
               ("query", {"sql": "PRAGMA query_only = OFF"}),
               ("query", {"sql": "SELECT load_extension('{m}')"}),
               ("query", {"sql": "SELECT 1; DROP TABLE customers"}),
               ("query", {"sql": "CREATE TABLE t (x)"}),
               ("query", {"sql": "VACUUM INTO '{m}'"}),
               # a runaway query: stopped by the VM-step budget
               ("query", {"sql": "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
                                 "SELECT count(*) FROM c"})],
    "jsonnav": [("get", {"path": "../../../etc/passwd"}),
                ("get", {"path": "__class__.__init__.__globals__"}),
                ("keys", {"path": "." * 500}),
                ("find", {"path": "{m}"})],
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_tool_environments_cannot_execute_code_or_write(name, tmp_path):
    from stages import envs

    env = envs.get(name)
    task = _task(env)
    context = copy.deepcopy(task.context)
    marker = tmp_path / "marker"
    for tool, args in ATTACKS[name]:
        args = {k: v.replace("{m}", str(marker)) if isinstance(v, str) else v for k, v in args.items()}
        out = env.call_tool(task, tool, args)  # never raises on model input
        assert isinstance(out, dict) and "error" in out, (tool, args, out)
    assert not marker.exists() and list(tmp_path.iterdir()) == []
    assert task.context == context  # the task's own data is untouched


def test_tool_call_arguments_and_results_are_capped():
    from stages.envs import protocol
    from stages.envs import sqlite as sq

    rows = sq.call_tool(_task(sq), "query", {"sql": "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 "
                                                    "FROM c) SELECT x FROM c"})
    assert len(rows["rows"]) == sq.MAX_ROWS and rows["truncated"]

    huge = protocol.format_call("calculator", {"expression": "1+" * 5000 + "1"})
    act = protocol.parse(huge)
    assert act.kind == "invalid" and "too long" in act.error
    text = protocol.format_result({"rows": ["x" * 100] * 1000})
    assert len(text) < protocol.MAX_RESULT_CHARS + 200
