"""Comments and docstrings under stages/ explain the code, they are not a lab diary (issue #43).

A comment says why the code is as it is. Dates, commit hashes and benchmark result files belong in
the history and in docs/performance.md (which cites the result files), not beside the code: they go
stale the moment the code moves. Only comments (`tokenize`) and the docstrings of modules, classes
and functions (`ast`) are read, so hex constants and strings in code are never flagged.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

STAGES = Path(__file__).resolve().parents[1] / "stages"

# a date (2026-12-02) or a month (2026-12)
DATE = re.compile(r"\b20\d\d-\d\d(?:-\d\d)?\b")
# a commit hash, abbreviated or whole: 7-40 lowercase hex with at least one letter a-f and one digit
# (so neither a plain number nor a word like "deadbeef" counts)
HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")
RESULTS = "benchmarks/results/"


def texts(source: str):
    """(line, text) of every comment and of every line of a module's, class's or function's docstring."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                doc = body[0].value
                for i, line in enumerate(doc.value.splitlines()):
                    yield doc.lineno + i, line


def findings(source: str) -> list[tuple[int, str]]:
    """(line, what) for each date, commit hash or results file named in a comment or docstring."""
    out = []
    for line, text in texts(source):
        out += [(line, f"date {m.group()!r}") for m in DATE.finditer(text)]
        out += [(line, f"commit hash {m.group()!r}") for m in HASH.finditer(text)]
        if RESULTS in text:
            out.append((line, f"{RESULTS!r} (cite docs/performance.md)"))
    return sorted(out)


def test_no_dates_hashes_or_result_files_in_comments():
    hits = []
    for path in sorted(STAGES.rglob("*.py")):
        with tokenize.open(path) as f:
            source = f.read()
        rel = path.relative_to(STAGES.parent)
        hits += [f"{rel}:{line}: {what}" for line, what in findings(source)]
    assert not hits, ("comments and docstrings must say why, without dates, commit hashes or result "
                      "files (docs/performance.md holds the evidence):\n" + "\n".join(hits))


PLANTED = '''"""A module, measured on 2026-12-02."""
MASK = 0xdeadbeef12  # a hex constant in code is no hash
LABEL = "c883e7b 2026-12-02"


def f():
    """Sped up by c883e7b."""
    return "see benchmarks/results/x.md"  # benchmarks/results/2026-12-04-h200-df4495c-first-update.md


class C:
    """In 2026-12 the default changed."""

    # fp32, sha256, deadbeef, 1234567 and 4.56-4.57 are none of these
    def g(self):
        return 1
'''


def test_the_check_catches_planted_dates_and_hashes():
    assert findings(PLANTED) == [
        (1, "date '2026-12-02'"),
        (7, "commit hash 'c883e7b'"),
        (8, "'benchmarks/results/' (cite docs/performance.md)"),
        (8, "commit hash 'df4495c'"),
        (8, "date '2026-12-04'"),
        (12, "date '2026-12'"),
    ]


def test_the_check_ignores_code_and_plain_text():
    clean = PLANTED.replace("2026-12-02", "the seed shape").replace("c883e7b", "the graphs") \
        .replace("2026-12-04-h200-df4495c-first-update.md", "docs/performance.md").replace("2026-12", "December") \
        .replace("benchmarks/results/", "docs/")
    assert "0xdeadbeef12" in clean and findings(clean) == []
