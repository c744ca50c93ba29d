"""The Task record and what every environment shares: seeded generation with a train/test
partition by construction, tool dispatch that never raises, argument checks, and scoring.

Train/test disjointness: a task's identity is the SHA-256 of the canonical JSON of
(question, context). One residue class of that digest is the test part, the rest is train; so a
task can belong to one part only, whatever seed or n generated it (no "hold out the last 20%"
bookkeeping that a different seed would break).

Answer scoring: `verify_strict` is an exact string match after trimming surrounding whitespace.
`verify_lenient` is a diagnostic reported beside it: it unwraps <final>/<answer>/\\boxed{},
ignores case, thousands separators, a trailing unit word and a trailing period, and accepts
numbers within LENIENT_ABS_TOL.
"""
from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..errors import UserError
from .protocol import MAX_ARG_CHARS

PARTS = ("train", "test")
TEST_MODULUS = 5  # 1 in 5 task identities is test
LENIENT_ABS_TOL = 0.01  # answers are rounded to 2 decimals, so a differently rounded one is near


@dataclass
class Task:
    uid: str  # "<env>/<split>/<16 hex of the identity digest>": stable across seeds and runs
    env: str
    split: str  # environment split, e.g. "hard"
    part: str  # "train" | "test"
    question: str  # the user message
    context: dict  # JSON-serialisable state the tools need (document, DB rows) + the solution spec
    ground_truth: str
    oracle_hint: str  # short solution text for a privileged teacher


class ToolError(Exception):
    """Bad model-controlled input to a tool; becomes {"error": message}."""


def check_split(split: Any, splits: tuple[str, ...]) -> None:
    if split not in splits:
        raise UserError(f"key 'env.split' = {split!r}; expected one of {', '.join(splits)}")


def identity_digest(question: str, context: dict) -> str:
    blob = json.dumps([question, context], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def part_of(digest: str) -> str:
    return "test" if int(digest[:8], 16) % TEST_MODULUS == 0 else "train"


def generate_tasks(env: str, split: str, n: int, seed: int, part: str,
                   make: Callable[[random.Random], Optional[tuple[str, dict, str, str]]]) -> list[Task]:
    """Draw candidates from one seeded stream, keep the distinct ones that fall in `part`.

    make(rng) -> (question, context, ground_truth, oracle_hint), or None to reject a draw.
    The stream is the same for both parts, so generate(n) is a prefix of generate(n + m).
    """
    if part not in PARTS:
        raise UserError(f"key 'env.part' = {part!r}; expected one of {', '.join(PARTS)}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise UserError(f"key 'env.n' = {n!r}; expected a non-negative integer")
    # A str seed is hashed with SHA-512 by random.Random: stable across processes and platforms.
    rng = random.Random(f"opd-envs/{env}/{split}/{seed}")
    tasks: list[Task] = []
    seen: set[str] = set()
    budget = 50 * n + 1_000  # rejections are rare; this only guards an exhausted task space
    while len(tasks) < n and budget > 0:
        budget -= 1
        made = make(rng)
        if made is None:
            continue
        question, context, ground_truth, hint = made
        digest = identity_digest(question, context)
        if digest in seen or part_of(digest) != part:
            continue
        seen.add(digest)
        tasks.append(Task(uid=f"{env}/{split}/{digest[:16]}", env=env, split=split, part=part,
                          question=question, context=context, ground_truth=ground_truth,
                          oracle_hint=hint))
    if len(tasks) < n:
        raise UserError(f"key 'env.n' = {n}; {env}/{split} yielded only {len(tasks)} distinct {part} tasks")
    return tasks


# ---- tool dispatch and argument checks ----

def dispatch(tools: dict[str, Callable[[Task, dict], dict]], task: Task, name: Any, arguments: Any) -> dict:
    if not isinstance(name, str) or name not in tools:
        return {"error": f"unknown tool {str(name)[:60]!r}; available tools: {', '.join(tools)}"}
    if not isinstance(arguments, dict):
        return {"error": "arguments must be a JSON object"}
    try:
        size = len(json.dumps(arguments, ensure_ascii=False))
    except (TypeError, ValueError, RecursionError):
        return {"error": "arguments are not JSON-serialisable"}
    if size > MAX_ARG_CHARS:
        return {"error": f"arguments too long ({size} chars of JSON; at most {MAX_ARG_CHARS})"}
    try:
        return tools[name](task, arguments)
    except ToolError as e:
        return {"error": str(e)}
    except Exception as e:  # noqa: BLE001 - model text must never crash a rollout; say what broke
        return {"error": f"internal error in tool {name!r}: {type(e).__name__}: {str(e)[:200]}"}


NUMBER = "number"


def check_args(arguments: dict, spec: dict[str, Any]) -> dict:
    """spec: name -> str | NUMBER. Exactly these arguments, with these types (bool is no number)."""
    unknown = sorted(set(arguments) - set(spec))
    missing = [a for a in spec if a not in arguments]
    expected = ", ".join(spec) or "no arguments"
    if unknown or missing:
        what = f"unknown argument(s) {', '.join(map(repr, unknown))}" if unknown else \
            f"missing argument(s) {', '.join(map(repr, missing))}"
        raise ToolError(f"{what}; expected: {expected}")
    for name, kind in spec.items():
        value = arguments[name]
        if kind is NUMBER:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ToolError(f"argument {name!r} must be a number")
        elif not isinstance(value, kind):
            raise ToolError(f"argument {name!r} must be a {kind.__name__}")
    return arguments


# ---- scoring ----

def verify_strict(task: Task, answer: Any) -> bool:
    return isinstance(answer, str) and answer.strip() == task.ground_truth


_NUMBER_RE = re.compile(r"\$?\s*([-+]?(?:\d[\d,]*)?\.?\d+(?:[eE][-+]?\d+)?)\s*(?:°?\s*[A-Za-z%]+\.?)?")


def _unwrap(text: str) -> str:
    for tag in ("final", "answer"):
        m = re.search(rf"<{tag}>(.*?)(?:</{tag}>|$)", text, re.S)
        if m:
            text = m.group(1)
    m = re.search(r"\\boxed\{([^{}]*)\}", text)
    if m:
        text = m.group(1)
    text = text.strip().strip("`").strip()
    text = text[:-1] if text.endswith(".") and not text[:-1].endswith(".") else text
    return text.strip().strip("\"'").strip()


def _as_number(text: str) -> Optional[float]:
    if len(text) > 100:  # no answer is this long; also keeps the regex's backtracking small
        return None
    m = _NUMBER_RE.fullmatch(text)
    if not m:
        return None
    try:
        return float(m.group(1).replace(",", ""))
    except ValueError:
        return None


def verify_lenient(task: Task, text: Any) -> bool:
    if not isinstance(text, str):
        return False
    got, want = _unwrap(text[:10_000]), task.ground_truth
    got_n, want_n = _as_number(got), _as_number(want)
    if got_n is not None and want_n is not None:
        return abs(got_n - want_n) <= LENIENT_ABS_TOL + 1e-9 * abs(want_n)
    return " ".join(got.casefold().split()) == " ".join(want.casefold().split())
