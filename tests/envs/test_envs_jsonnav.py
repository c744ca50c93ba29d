"""JSON navigation: path parsing, the three tools, and oracle answers vs. the document."""
import pytest

from stages.envs import jsonnav as jn
from stages.envs import protocol

TASK = jn.generate("default", 1, 0, "train")[0]
DOC = TASK.context["doc"]


def test_document_shape_and_unique_lookups():
    for task in jn.generate("default", 20, 4, "train"):
        doc = task.context["doc"]
        assert set(doc) == {"company", "users", "orders"}
        ids = [u["id"] for u in doc["users"]]
        assert len(set(ids)) == len(ids) and len({u["name"] for u in doc["users"]}) == len(ids)
        assert len({u["email"] for u in doc["users"]}) == len(ids)
        assert all(o["user_id"] in ids for o in doc["orders"])


def test_get_keys_find():
    u0 = DOC["users"][0]
    assert jn.call_tool(TASK, "get", {"path": "users[0].email"}) == {"path": "users[0].email", "value": u0["email"]}
    assert jn.call_tool(TASK, "get", {"path": "$.users[0].address.city"})["value"] == u0["address"]["city"]
    assert jn.call_tool(TASK, "get", {"path": ""})["value"] == DOC
    assert jn.call_tool(TASK, "keys", {"path": ""}) == {"path": "", "keys": ["company", "users", "orders"]}
    assert jn.call_tool(TASK, "keys", {"path": "users"}) == {"path": "users", "length": len(DOC["users"])}
    found = jn.call_tool(TASK, "find", {"key": "id"})
    assert found["count"] == len(DOC["users"])
    assert found["matches"][0] == {"path": "users[0].id", "value": u0["id"]}
    addr = jn.call_tool(TASK, "find", {"key": "address"})["matches"][0]
    assert addr == {"path": "users[0].address", "value": "<object with 2 keys>"}
    assert jn.call_tool(TASK, "find", {"key": "nope"}) == {"key": "nope", "count": 0, "matches": []}


def test_path_round_trip():
    tokens = jn.parse_path("orders[1].items[0].sku")
    assert tokens == ["orders", 1, "items", 0, "sku"] and jn.render_path(tokens) == "orders[1].items[0].sku"


@pytest.mark.parametrize("tool,arguments,error_part", [
    ("get", {"path": "users[99]"}, "out of range"),
    ("get", {"path": "users.name"}, "not an object"),
    ("get", {"path": "company[0]"}, "not an array"),
    ("get", {"path": "nobody"}, "no key 'nobody'"),
    ("get", {"path": "users..name"}, "bad path"),
    ("get", {"path": "users[-1]"}, "bad path"),
    ("get", {"path": "users[0]name"}, "bad path"),
    ("get", {"path": "__class__"}, "no key '__class__'"),
    ("get", {"path": "a" * 300}, "path too long"),
    ("get", {"path": ["users"]}, "must be a str"),
    ("get", {}, "missing argument(s) 'path'"),
    ("keys", {"path": "users[0].age"}, "is a int, not an object or array"),
    ("find", {"key": ""}, "1 to 100 characters"),
    ("delete", {"path": "users"}, "unknown tool 'delete'"),
])
def test_bad_inputs_return_errors(tool, arguments, error_part):
    out = jn.call_tool(TASK, tool, arguments)
    assert set(out) == {"error"} and error_part in out["error"] and "internal" not in out["error"], out


def test_oracle_uses_lookup_then_read_and_matches_document():
    kinds = set()
    for task in jn.generate("default", 40, 5, "test"):
        kinds.add(task.context["query"]["kind"])
        calls = [protocol.parse(m["content"]) for m in jn.oracle_trace(task) if m["role"] == "assistant"]
        assert calls[0].name == "find" and calls[-1].kind == "final" and len(calls) >= 3
        assert calls[-1].answer == task.ground_truth
    assert kinds == set(jn._QUESTIONS)  # every question kind is exercised


def test_results_do_not_alias_the_document():
    import copy
    task = jn.generate("default", 1, 9, "train")[0]
    before = copy.deepcopy(task.context)
    for name, args in [("get", {"path": ""}), ("get", {"path": "users"}), ("keys", {"path": "users[0]"}),
                       ("find", {"key": "tags"})]:
        out = jn.call_tool(task, name, args)
        for value in out.values():
            if isinstance(value, (list, dict)):
                value.clear()
    assert task.context == before
