"""SQLite: read-only enforcement for every kind of write, runaway-query and row caps, answers."""
import time

import pytest

from stages.envs import protocol
from stages.envs import sqlite as sq
from stages.envs.task import ToolError

TASK = sq.generate("default", 1, 0, "train")[0]
ROWS = TASK.context["rows"]


def snapshot(conn):
    # read through the same locked connection: SELECT * is allowed by the authorizer
    return {t: [list(r) for r in conn.execute(f"SELECT * FROM {t} ORDER BY id").fetchall()] for t in sq.TABLES}


def test_schema_tool():
    out = sq.call_tool(TASK, "schema", {})
    assert [t["name"] for t in out["tables"]] == ["customers", "products", "orders"]
    assert [t["rows"] for t in out["tables"]] == [len(ROWS[t]) for t in sq.TABLES]
    assert out["tables"][2]["sql"].startswith("CREATE TABLE orders (")
    assert "unknown argument(s) 'table'" in sq.call_tool(TASK, "schema", {"table": "orders"})["error"]


def test_query_returns_rows_and_caps_them():
    out = sq.call_tool(TASK, "query", {"sql": "SELECT id, name FROM customers ORDER BY id LIMIT 2"})
    assert out == {"columns": ["id", "name"], "rows": [r[:2] for r in ROWS["customers"][:2]], "truncated": False}
    big = sq.call_tool(TASK, "query", {"sql": "SELECT o.id, c.id FROM orders o, customers c"})
    assert len(big["rows"]) == sq.MAX_ROWS and big["truncated"] is True
    sql = "-- comment\n/* c */ WITH x AS (SELECT COUNT(*) AS n FROM orders) SELECT n FROM x"
    assert sq.call_tool(TASK, "query", {"sql": sql})["rows"] == [[len(ROWS["orders"])]]
    out = sq.call_tool(TASK, "query", {"sql": "SELECT upper(name), round(price / 4.0, 1) FROM products WHERE id = 1"})
    assert out["rows"] == [[ROWS["products"][0][1].upper(), round(ROWS["products"][0][3] / 4.0, 1)]]


WRITES = [
    "INSERT INTO customers VALUES (999, 'Eve', 'Nowhere', 2020)",
    "UPDATE products SET price = 0",
    "DELETE FROM orders",
    "DROP TABLE orders",
    "CREATE TABLE evil (x)",
    "CREATE TEMP TABLE evil (x)",
    "CREATE INDEX i ON orders(quantity)",
    "ALTER TABLE orders ADD COLUMN y",
    "ATTACH DATABASE ':memory:' AS other",
    "PRAGMA writable_schema=1",
    "PRAGMA query_only=OFF",
    "WITH x AS (SELECT 1) DELETE FROM orders",
    "REPLACE INTO customers VALUES (1, 'Eve', 'Nowhere', 2020)",
    "BEGIN",
    "REINDEX",
    "ANALYZE",
    "SELECT 1; DELETE FROM orders",
    "SELECT load_extension('evil')",
    "SELECT randomblob(100000000)",
    "SELECT zeroblob(100000000)",
]


@pytest.mark.parametrize("sql", WRITES)
def test_writes_are_refused_and_change_nothing(sql):
    conn = sq.connect(TASK.context)
    try:
        before, changes = snapshot(conn), conn.total_changes
        assert before == {t: ROWS[t] for t in sq.TABLES}
        with pytest.raises(ToolError):
            sq.run_query(conn, sql)
        assert snapshot(conn) == before and conn.total_changes == changes
        tables = conn.execute("SELECT name FROM sqlite_master ORDER BY name").fetchall()
        assert tables == [("customers",), ("orders",), ("products",)]
    finally:
        conn.close()
    out = sq.call_tool(TASK, "query", {"sql": sql})
    assert set(out) == {"error"} and "internal" not in out["error"], out


@pytest.mark.parametrize("sql", [w for w in WRITES if not w.startswith(("SELECT", "BEGIN", "REINDEX"))])
def test_locked_connection_refuses_writes_without_the_keyword_gate(sql):
    # the authorizer and query_only stand on their own: bypass run_query's first-keyword check
    import sqlite3
    conn = sq.connect(TASK.context)
    try:
        before, changes = snapshot(conn), conn.total_changes  # the setup's inserts count too
        with pytest.raises(sqlite3.DatabaseError, match="not authorized|authorization denied"):
            conn.execute(sql)
        assert snapshot(conn) == before and conn.total_changes == changes
    finally:
        conn.close()


def test_vacuum_into_writes_no_file(tmp_path):
    target = tmp_path / "copy.db"
    out = sq.call_tool(TASK, "query", {"sql": f"VACUUM INTO '{target}'"})
    assert "error" in out and not target.exists()
    out = sq.call_tool(TASK, "query", {"sql": f"SELECT 1 FROM (SELECT 1) WHERE 0; VACUUM INTO '{target}'"})
    assert "error" in out and not target.exists()


@pytest.mark.parametrize("sql", [
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c",
    "SELECT COUNT(*) FROM orders a, orders b, orders c, orders d, orders e",
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x FROM c ORDER BY x DESC",
])
def test_runaway_queries_are_aborted(sql):
    start = time.perf_counter()
    out = sq.call_tool(TASK, "query", {"sql": sql})
    assert out == {"error": "query aborted: it exceeded the work budget"}
    assert time.perf_counter() - start < 3.0


def test_long_string_building_is_capped():
    sql = "WITH RECURSIVE s(x) AS (SELECT 'ab' UNION ALL SELECT x || x FROM s) SELECT length(x) FROM s"
    out = sq.call_tool(TASK, "query", {"sql": sql})
    assert "error" in out  # SQLITE_LIMIT_LENGTH (or the work budget) stops the doubling


@pytest.mark.parametrize("arguments,error_part", [
    ({"sql": ""}, "non-empty"), ({"sql": 5}, "must be a str"), ({}, "missing argument(s) 'sql'"),
    ({"sql": "SELECT " + "1, " * 600 + "1"}, "sql too long"), ({"sql": "SELEC 1"}, "only read-only SELECT"),
    ({"sql": "SELECT * FROM nowhere"}, "SQL error: no such table"),
])
def test_bad_query_arguments(arguments, error_part):
    assert error_part in sq.call_tool(TASK, "query", arguments)["error"]


def test_ground_truth_is_independent_of_sql_and_matches_it():
    kinds = set()
    for task in sq.generate("default", 40, 6, "train"):
        kinds.add(task.context["query"]["kind"])
        conn = sq.connect(task.context)
        try:
            rows = sq.run_query(conn, sq.oracle_sql(task))["rows"]
        finally:
            conn.close()
        assert str(rows[0][0]) == task.ground_truth
        calls = [protocol.parse(m["content"]) for m in sq.oracle_trace(task) if m["role"] == "assistant"]
        assert [c.name for c in calls[:2]] == ["schema", "query"] and calls[2].answer == task.ground_truth
    assert kinds == set(sq._QUESTIONS)
