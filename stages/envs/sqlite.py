"""SQLite environment: questions about a small generated shop database, answered with the tools
`schema` and `query`.

Every call builds a fresh in-memory database from the task context (the DDL and the rows, ~40 of
them: well under a millisecond), then locks it before running any model SQL:
- `PRAGMA query_only = ON`, so the engine itself refuses writes;
- an authorizer that allows only SQLITE_SELECT, SQLITE_READ, SQLITE_RECURSIVE and SQLITE_FUNCTION
  for a whitelist of pure functions: INSERT/UPDATE/DELETE/CREATE/DROP/ALTER/ATTACH (and so
  VACUUM INTO)/PRAGMA/transactions are denied at prepare time;
- a first-keyword gate (SELECT, WITH or VALUES), for statements that never consult the
  authorizer (e.g. a bare REINDEX);
- limits: string/blob length, no attached databases, a progress handler that aborts a query after
  a fixed budget of VM steps (deterministic, unlike a wall-clock timeout), MAX_ROWS rows returned.
A fresh connection per call also means nothing a query did could leak into the next call.

The task context holds `ddl`, `rows` (the DB state) and `query` (the solution spec); the ground
truth is computed in Python from the rows, independently of SQL, and the oracle's SQL is checked
against it in the tests.
"""
from __future__ import annotations

import random
import re
import sqlite3
from typing import Any, Optional

from . import protocol
from .task import Task, ToolError, check_args, check_split, dispatch, generate_tasks
from .task import verify_lenient as _verify_lenient
from .task import verify_strict

SPLITS = ("default",)
MAX_SQL_CHARS = 1_000
MAX_ROWS = 50
PROGRESS_EVERY = 1_000  # VM instructions between progress-handler calls
MAX_PROGRESS_CALLS = 2_000  # -> about 2 million VM instructions per query
MAX_VALUE_BYTES = 100_000

ALLOWED_FUNCTIONS = frozenset({
    "abs", "avg", "coalesce", "count", "date", "glob", "group_concat", "ifnull", "iif", "instr",
    "julianday", "length", "like", "lower", "ltrim", "max", "min", "nullif", "replace", "round",
    "rtrim", "strftime", "substr", "substring", "sum", "time", "total", "trim", "typeof", "upper",
})
_ALLOWED_ACTIONS = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, getattr(sqlite3, "SQLITE_RECURSIVE", 33)}

DDL = [
    "CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL, "
    "signup_year INTEGER NOT NULL)",
    "CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT NOT NULL, category TEXT NOT NULL, "
    "price INTEGER NOT NULL)",
    "CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL REFERENCES customers(id), "
    "product_id INTEGER NOT NULL REFERENCES products(id), quantity INTEGER NOT NULL, order_date TEXT NOT NULL)",
]
TABLES = ("customers", "products", "orders")

_FIRST = ["Alba", "Bruno", "Carmen", "Dario", "Eva", "Felix", "Gia", "Hugo", "Iris", "Jon", "Kai",
          "Lena", "Milo", "Nina", "Otto", "Pia", "Rafa", "Sofia", "Theo", "Uma"]
_LAST = ["Abbott", "Brandt", "Chen", "Diaz", "Engel", "Ferreira", "Gupta", "Hall", "Ivanova", "Kim",
         "Larsen", "Mendes", "Nakamura", "Ortiz", "Park", "Quist", "Reyes", "Sato", "Vogel", "Young"]
_CITIES = ["Porto", "Bergen", "Mombasa", "Cusco", "Hue", "Sfax"]
_CATALOGUE = {
    "books": ["Atlas of Rivers", "Cooking Basics", "Night Sky Guide", "Poems of the Sea", "Tiny Habits Workbook"],
    "garden": ["Watering Can", "Pruning Shears", "Seed Tray", "Garden Gloves", "Compost Bin"],
    "kitchen": ["Chef Knife", "Cast Iron Pan", "Salad Spinner", "Pepper Mill", "Tea Kettle"],
    "toys": ["Puzzle Cube", "Kite", "Wooden Train", "Yo-yo", "Marble Run"],
}

# ---- the locked database ----


def _authorize(action: int, arg1: Any, arg2: Any, dbname: Any, source: Any) -> int:
    if action in _ALLOWED_ACTIONS:
        return sqlite3.SQLITE_OK
    if action == sqlite3.SQLITE_FUNCTION and str(arg2).lower() in ALLOWED_FUNCTIONS:
        return sqlite3.SQLITE_OK
    return sqlite3.SQLITE_DENY


def connect(context: dict) -> sqlite3.Connection:
    """A fresh in-memory database with the task's rows, locked read-only."""
    conn = sqlite3.connect(":memory:")
    for statement in context["ddl"]:
        conn.execute(statement)
    for table, rows in context["rows"].items():
        if rows:  # table names come from our own generator (the context), never from the model
            conn.executemany(f"INSERT INTO {table} VALUES ({', '.join('?' * len(rows[0]))})", rows)
    conn.commit()
    conn.execute("PRAGMA query_only = ON")
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
    conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
    conn.set_authorizer(_authorize)  # last: the setup above needed writes
    return conn


_LEADING_COMMENTS = re.compile(r"\A(?:\s+|--[^\n]*(?:\n|\Z)|/\*.*?\*/)*", re.S)


def _cell(value: Any) -> Any:
    if isinstance(value, bytes):
        return f"<blob of {len(value)} bytes>"
    return value


def run_query(conn: sqlite3.Connection, sql: Any) -> dict:
    """Run one read-only statement on a connection from `connect`; ToolError on refusal."""
    if not isinstance(sql, str) or not sql.strip():
        raise ToolError("sql must be a non-empty string")
    if len(sql) > MAX_SQL_CHARS:
        raise ToolError(f"sql too long (at most {MAX_SQL_CHARS} chars)")
    first = _LEADING_COMMENTS.sub("", sql, count=1).split(None, 1)
    if not first or first[0].split("(")[0].lower() not in ("select", "with", "values"):
        raise ToolError("only read-only SELECT queries are allowed")
    steps = [0]

    def budget() -> int:  # nonzero aborts the running statement
        steps[0] += 1
        return int(steps[0] > MAX_PROGRESS_CALLS)

    conn.set_progress_handler(budget, PROGRESS_EVERY)
    try:
        cursor = conn.execute(sql)
        rows = cursor.fetchmany(MAX_ROWS + 1)
        columns = [d[0] for d in cursor.description or []]
    except (sqlite3.Error, sqlite3.Warning, ValueError, OverflowError, MemoryError) as e:
        message = str(e)
        if "interrupted" in message:
            raise ToolError("query aborted: it exceeded the work budget") from None
        if "not authorized" in message or "authorization denied" in message or "prohibited" in message:
            raise ToolError(f"query refused ({message[:80]}): only read-only SELECT queries using "
                            f"common functions are allowed") from None
        raise ToolError(f"SQL error: {message[:200]}") from None
    finally:
        conn.set_progress_handler(None, 0)
    return {"columns": columns, "rows": [[_cell(v) for v in row] for row in rows[:MAX_ROWS]],
            "truncated": len(rows) > MAX_ROWS}


# ---- tools ----

TOOLS = {
    "schema": ("the tables, their CREATE statements and row counts", {}),
    "query": (f"run one read-only SQLite SELECT; returns columns and up to {MAX_ROWS} rows", {"sql": "string"}),
}


def _tool_schema(task: Task, args: dict) -> dict:
    check_args(args, {})
    rows = task.context["rows"]
    tables = []
    for ddl in task.context["ddl"]:
        name = ddl.split()[2]  # "CREATE TABLE <name> (...)", our own DDL
        tables.append({"name": name, "sql": ddl, "rows": len(rows.get(name, []))})
    return {"tables": tables}


def _tool_query(task: Task, args: dict) -> dict:
    check_args(args, {"sql": str})
    conn = connect(task.context)
    try:
        return run_query(conn, args["sql"])
    finally:
        conn.close()


_TOOLS = {"schema": _tool_schema, "query": _tool_query}


def call_tool(task: Task, name: str, arguments: dict) -> dict:
    return dispatch(_TOOLS, task, name, arguments)


def system_prompt(task: Task) -> str:
    return protocol.render_system_prompt(
        "You answer questions about a shop's SQLite database (customers, products, orders). "
        "Look at the schema, then query it. Prices are whole dollars.", TOOLS,
        "Answer format: the value only (a number as digits, or a name exactly as stored).")


# ---- generation ----

def _make_rows(rng: random.Random) -> dict:
    names = rng.sample([f"{f} {l}" for f in _FIRST for l in _LAST], rng.randint(6, 10))
    customers = [[i + 1, name, rng.choice(_CITIES), rng.randint(2015, 2024)] for i, name in enumerate(names)]
    catalogue = [(cat, item) for cat, items in _CATALOGUE.items() for item in items]
    products = [[i + 1, item, cat, rng.randint(3, 120)]
                for i, (cat, item) in enumerate(rng.sample(catalogue, rng.randint(6, 10)))]
    orders = [[i + 1, rng.randint(1, len(customers)), rng.randint(1, len(products)), rng.randint(1, 5),
               f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"] for i in range(rng.randint(15, 30))]
    return {"customers": customers, "products": products, "orders": orders}


def _unique_max(counts: dict) -> Optional[Any]:
    best = max(counts.values())
    winners = [k for k, v in counts.items() if v == best]
    return winners[0] if len(winners) == 1 else None  # a tie has no single right answer


def _q(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _answer_and_sql(rows: dict, query: dict) -> Optional[tuple[str, str]]:
    """Ground truth from the Python rows (independent of SQL) and the oracle's SQL."""
    customers = {c[0]: c for c in rows["customers"]}
    products = {p[0]: p for p in rows["products"]}
    kind, arg = query["kind"], query.get("arg")
    if kind == "orders_by_customer":
        cid = next(c[0] for c in rows["customers"] if c[1] == arg)
        return (str(sum(o[1] == cid for o in rows["orders"])),
                f"SELECT COUNT(*) FROM orders o JOIN customers c ON c.id = o.customer_id WHERE c.name = {_q(arg)}")
    if kind == "units_of_product":
        pid = next(p[0] for p in rows["products"] if p[1] == arg)
        return (str(sum(o[3] for o in rows["orders"] if o[2] == pid)),
                "SELECT COALESCE(SUM(o.quantity), 0) FROM orders o JOIN products p ON p.id = o.product_id "
                f"WHERE p.name = {_q(arg)}")
    if kind == "buyers_of_product":
        pid = next(p[0] for p in rows["products"] if p[1] == arg)
        return (str(len({o[1] for o in rows["orders"] if o[2] == pid})),
                "SELECT COUNT(DISTINCT o.customer_id) FROM orders o JOIN products p ON p.id = o.product_id "
                f"WHERE p.name = {_q(arg)}")
    if kind == "revenue_by_city":
        total = sum(o[3] * products[o[2]][3] for o in rows["orders"] if customers[o[1]][2] == arg)
        return (str(total), "SELECT COALESCE(SUM(o.quantity * p.price), 0) FROM orders o "
                "JOIN customers c ON c.id = o.customer_id JOIN products p ON p.id = o.product_id "
                f"WHERE c.city = {_q(arg)}")
    if kind == "priciest_in_category":
        prices = {p[1]: p[3] for p in rows["products"] if p[2] == arg}
        best = _unique_max(prices) if prices else None
        return None if best is None else (
            best, f"SELECT name FROM products WHERE category = {_q(arg)} ORDER BY price DESC LIMIT 1")
    if kind == "top_city":
        counts: dict = {}
        for c in rows["customers"]:
            counts[c[2]] = counts.get(c[2], 0) + 1
        best = _unique_max(counts)
        return None if best is None else (
            best, "SELECT city FROM customers GROUP BY city ORDER BY COUNT(*) DESC LIMIT 1")
    raise ValueError(kind)


_QUESTIONS = {
    "orders_by_customer": "How many orders has {arg} placed?",
    "units_of_product": "How many units of \"{arg}\" have been ordered in total?",
    "buyers_of_product": "How many different customers have ordered \"{arg}\"?",
    "revenue_by_city": "What is the total revenue in dollars (quantity times price) from customers in {arg}?",
    "priciest_in_category": "What is the name of the most expensive product in the {arg} category?",
    "top_city": "Which city has the most customers?",
}


def _make(rng: random.Random) -> Optional[tuple]:
    rows = _make_rows(rng)
    kind = rng.choice(sorted(_QUESTIONS))
    arg = {
        "orders_by_customer": lambda: rng.choice(rows["customers"])[1],
        "units_of_product": lambda: rng.choice(rows["products"])[1],
        "buyers_of_product": lambda: rng.choice(rows["products"])[1],
        "revenue_by_city": lambda: rng.choice(rows["customers"])[2],
        "priciest_in_category": lambda: rng.choice(rows["products"])[2],
        "top_city": lambda: None,
    }[kind]()
    query = {"kind": kind, "arg": arg}
    made = _answer_and_sql(rows, query)
    if made is None:
        return None
    answer, sql = made
    context = {"ddl": DDL, "rows": rows, "query": query}
    return _QUESTIONS[kind].format(arg=arg), context, answer, f"Run: {sql}  -> {answer}"


def generate(split: str, n: int, seed: int, part: str) -> list[Task]:
    check_split(split, SPLITS)
    return generate_tasks("sqlite", split, n, seed, part, _make)


# ---- the environment's own solver and scoring ----

def oracle_sql(task: Task) -> str:
    return _answer_and_sql(task.context["rows"], task.context["query"])[1]


def oracle_trace(task: Task) -> list[dict]:
    trace: list[dict] = []
    protocol.trace_call(trace, call_tool, task, "schema", {}, "Look at the tables first.")
    result = protocol.trace_call(trace, call_tool, task, "query", {"sql": oracle_sql(task)}, "Query the answer.")
    return protocol.trace_final(trace, str(result["rows"][0][0]))


def verify(task: Task, answer: str) -> bool:
    return verify_strict(task, answer)


def verify_lenient(task: Task, text: str) -> bool:
    return _verify_lenient(task, text)
