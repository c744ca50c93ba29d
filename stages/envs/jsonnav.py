"""JSON navigation environment: questions about a generated JSON document (company, users,
orders), answered with the tools `get`, `keys` and `find`.

Paths look like `users[2].address.city`; "" (or "$") is the document root. Every question needs a
lookup by value (`find` a key, pick the match whose value is the one asked about) followed by one
or more `get`/`keys` calls on the path it found, so the answer cannot be read off the question.

The task context holds the whole document (`doc`) plus the solution spec (`query`) the oracle
follows; tools read only `doc`.
"""
from __future__ import annotations

import copy
import random
import re
from typing import Any, Optional

from . import protocol
from .task import Task, ToolError, check_args, check_split, dispatch, generate_tasks
from .task import verify_lenient as _verify_lenient
from .task import verify_strict

SPLITS = ("default",)
MAX_PATH_CHARS = 200
MAX_FIND_MATCHES = 50

_FIRST = ["Ada", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kira",
          "Liam", "Maya", "Noor", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tara", "Umar", "Vera"]
_LAST = ["Adler", "Baker", "Costa", "Dubois", "Evans", "Fischer", "Garcia", "Haddad", "Ito", "Jensen",
         "Kowalski", "Lopez", "Moreau", "Novak", "Okafor", "Petrov", "Rossi", "Silva", "Tanaka", "Weber"]
_CITIES = ["Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Tunis", "Quito", "Riga", "Perth", "Osaka"]
_TAGS = ["admin", "beta", "vip", "newsletter", "trial", "support"]
_COMPANIES = ["Acme Corp", "Globex", "Initech", "Umbrella Ltd", "Stark Works", "Wayne Trading"]
_STATUSES = ["pending", "shipped", "delivered", "returned"]

# ---- paths ----

_SEGMENT = re.compile(r"(\.)?([A-Za-z_][A-Za-z0-9_\-]*)|\[(\d{1,6})\]")


def parse_path(path: Any) -> list:
    if not isinstance(path, str):
        raise ToolError("path must be a string")
    if len(path) > MAX_PATH_CHARS:
        raise ToolError(f"path too long (at most {MAX_PATH_CHARS} chars)")
    text = path.strip()
    text = text[1:] if text.startswith("$") else text
    tokens: list = []
    pos = 0
    while pos < len(text):
        m = _SEGMENT.match(text, pos)
        # a key after another segment needs its dot ("a.b", not "ab" glued to "a[0]")
        if not m or (m.group(2) is not None and tokens and not m.group(1)):
            raise ToolError(f"bad path {path[:60]!r} at position {pos}; use keys and [index], e.g. users[0].name")
        tokens.append(m.group(2) if m.group(2) is not None else int(m.group(3)))
        pos = m.end()
    return tokens


def render_path(tokens: list) -> str:
    out = ""
    for t in tokens:
        out += f"[{t}]" if isinstance(t, int) else (f".{t}" if out else t)
    return out


def resolve(doc: Any, path: str) -> Any:
    node = doc
    tokens = parse_path(path)
    for i, token in enumerate(tokens):
        where = render_path(tokens[:i]) or "the root"
        if isinstance(token, int):
            if not isinstance(node, list):
                raise ToolError(f"{where} is not an array; cannot take [{token}]")
            if token >= len(node):
                raise ToolError(f"index [{token}] out of range at {where} (length {len(node)})")
            node = node[token]
        else:
            if not isinstance(node, dict):
                raise ToolError(f"{where} is not an object; cannot take key {token!r}")
            if token not in node:
                raise ToolError(f"no key {token!r} at {where}; keys: {', '.join(node)}")
            node = node[token]
    return node


def _summary(value: Any) -> Any:
    if isinstance(value, dict):
        return f"<object with {len(value)} keys>"
    if isinstance(value, list):
        return f"<array of length {len(value)}>"
    return value


def find_key(doc: Any, key: str) -> list[tuple[str, Any]]:
    """(path, value) of every object member named `key`, in document order."""
    found: list[tuple[str, Any]] = []

    def walk(node: Any, tokens: list) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k == key:
                    found.append((render_path(tokens + [k]), v))
                walk(v, tokens + [k])
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, tokens + [i])

    walk(doc, [])
    return found


# ---- tools ----

TOOLS = {
    "get": ('the value at a path, e.g. "users[2].address.city" ("" is the whole document)', {"path": "string"}),
    "keys": ("the keys of the object at a path, or the length of the array there", {"path": "string"}),
    "find": ("every path whose last key is the given key name, with the value there",
             {"key": "string"}),
}


def _tool_get(task: Task, args: dict) -> dict:
    check_args(args, {"path": str})
    # a copy: a caller that edits a result must never reach into the task's document
    return {"path": args["path"], "value": copy.deepcopy(resolve(task.context["doc"], args["path"]))}


def _tool_keys(task: Task, args: dict) -> dict:
    check_args(args, {"path": str})
    node = resolve(task.context["doc"], args["path"])
    if isinstance(node, dict):
        return {"path": args["path"], "keys": list(node)}
    if isinstance(node, list):
        return {"path": args["path"], "length": len(node)}
    raise ToolError(f"the value at {args['path'][:60]!r} is a {type(node).__name__}, not an object or array")


def _tool_find(task: Task, args: dict) -> dict:
    check_args(args, {"key": str})
    if not args["key"] or len(args["key"]) > 100:
        raise ToolError("key must be 1 to 100 characters")
    matches = find_key(task.context["doc"], args["key"])
    shown = [{"path": p, "value": _summary(v)} for p, v in matches[:MAX_FIND_MATCHES]]
    return {"key": args["key"], "count": len(matches), "matches": shown}


_TOOLS = {"get": _tool_get, "keys": _tool_keys, "find": _tool_find}


def call_tool(task: Task, name: str, arguments: dict) -> dict:
    return dispatch(_TOOLS, task, name, arguments)


def system_prompt(task: Task) -> str:
    return protocol.render_system_prompt(
        "You answer questions about a JSON document that you cannot see directly. Explore it with "
        "the tools.", TOOLS,
        "Answer format: the value only, exactly as it appears in the document (numbers as digits).")


# ---- generation ----

def _make_doc(rng: random.Random) -> dict:
    names = rng.sample([(f, l) for f in _FIRST for l in _LAST], rng.randint(5, 9))
    ids = rng.sample(range(1, 100), len(names))  # shuffled, so "id 7" is not users[6]
    users = []
    for (first, last), uid in zip(names, ids):
        users.append({
            "id": uid,
            "name": f"{first} {last}",
            "email": f"{first.lower()}.{last.lower()}{uid}@example.com",
            "age": rng.randint(18, 80),
            "address": {"city": rng.choice(_CITIES), "zip": str(rng.randint(10000, 99999))},
            "tags": rng.sample(_TAGS, rng.randint(0, 3)),
        })
    orders = []
    for number in rng.sample(range(1000, 10000), rng.randint(3, 7)):
        items = [{"sku": f"SKU-{rng.randint(100, 999)}", "qty": rng.randint(1, 5)} for _ in range(rng.randint(1, 5))]
        orders.append({"order_id": f"A-{number}", "user_id": rng.choice(users)["id"], "items": items,
                       "status": rng.choice(_STATUSES)})
    return {"company": {"name": rng.choice(_COMPANIES), "founded": rng.randint(1950, 2020)},
            "users": users, "orders": orders}


def _answer(doc: dict, query: dict) -> str:
    """Ground truth straight from the Python document (independent of the tools)."""
    users = {u["id"]: u for u in doc["users"]}
    orders = {o["order_id"]: o for o in doc["orders"]}
    kind = query["kind"]
    if kind == "email_by_id":
        return users[query["id"]]["email"]
    if kind == "city_by_name":
        return next(u for u in doc["users"] if u["name"] == query["name"])["address"]["city"]
    if kind == "age_by_email":
        return str(next(u for u in doc["users"] if u["email"] == query["email"])["age"])
    if kind == "items_in_order":
        return str(len(orders[query["order_id"]]["items"]))
    if kind == "buyer_of_order":
        return users[orders[query["order_id"]]["user_id"]]["name"]
    raise ValueError(kind)


_QUESTIONS = {
    "email_by_id": "What is the email address of the user whose id is {id}?",
    "city_by_name": "In which city does {name} live?",
    "age_by_email": "How old is the user with the email address {email}?",
    "items_in_order": "How many line items does order {order_id} have?",
    "buyer_of_order": "What is the name of the user who placed order {order_id}?",
}


def _make(rng: random.Random) -> Optional[tuple]:
    doc = _make_doc(rng)
    kind = rng.choice(sorted(_QUESTIONS))
    user, order = rng.choice(doc["users"]), rng.choice(doc["orders"])
    query = {"kind": kind, **{
        "email_by_id": {"id": user["id"]}, "city_by_name": {"name": user["name"]},
        "age_by_email": {"email": user["email"]}, "items_in_order": {"order_id": order["order_id"]},
        "buyer_of_order": {"order_id": order["order_id"]},
    }[kind]}
    answer = _answer(doc, query)
    u, o = doc["users"].index(user), doc["orders"].index(order)
    buyer = next(i for i, x in enumerate(doc["users"]) if x["id"] == order["user_id"])
    hint = {
        "email_by_id": f"find id -> users[{u}]; get users[{u}].email = {answer}",
        "city_by_name": f"find name -> users[{u}]; get users[{u}].address.city = {answer}",
        "age_by_email": f"find email -> users[{u}]; get users[{u}].age = {answer}",
        "items_in_order": f"find order_id -> orders[{o}]; keys orders[{o}].items has length {answer}",
        "buyer_of_order": f"find order_id -> orders[{o}]; user_id {order['user_id']} is users[{buyer}]; "
                          f"its name is {answer}",
    }[kind]
    return _QUESTIONS[kind].format(**query), {"doc": doc, "query": query}, answer, hint


def generate(split: str, n: int, seed: int, part: str) -> list[Task]:
    check_split(split, SPLITS)
    return generate_tasks("jsonnav", split, n, seed, part, _make)


# ---- the environment's own solver and scoring ----

def _locate(trace: list, task: Task, key: str, value: Any, under: str) -> str:
    """find(key), pick the match under `under` whose value equals `value`; return its parent path."""
    result = protocol.trace_call(trace, call_tool, task, "find", {"key": key},
                                 f"Find where {key} is {value!r}.")
    path = next(m["path"] for m in result["matches"] if m["value"] == value and m["path"].startswith(under))
    return path[: -len(key) - 1]  # drop ".<key>"


def oracle_trace(task: Task) -> list[dict]:
    query, trace = task.context["query"], []
    kind = query["kind"]

    def get(path: str, thought: str) -> Any:
        return protocol.trace_call(trace, call_tool, task, "get", {"path": path}, thought)["value"]

    if kind == "email_by_id":
        answer = get(_locate(trace, task, "id", query["id"], "users") + ".email", "Read that user's email.")
    elif kind == "city_by_name":
        answer = get(_locate(trace, task, "name", query["name"], "users") + ".address.city", "Read the city.")
    elif kind == "age_by_email":
        answer = str(get(_locate(trace, task, "email", query["email"], "users") + ".age", "Read the age."))
    elif kind == "items_in_order":
        base = _locate(trace, task, "order_id", query["order_id"], "orders")
        answer = str(protocol.trace_call(trace, call_tool, task, "keys", {"path": base + ".items"},
                                         "Count the order's items.")["length"])
    else:  # buyer_of_order
        base = _locate(trace, task, "order_id", query["order_id"], "orders")
        user_id = get(base + ".user_id", "Which user placed it?")
        answer = get(_locate(trace, task, "id", user_id, "users") + ".name", "Read that user's name.")
    return protocol.trace_final(trace, answer)


def verify(task: Task, answer: str) -> bool:
    return verify_strict(task, answer)


def verify_lenient(task: Task, text: str) -> bool:
    return _verify_lenient(task, text)
