"""Task checkers: whether a response answers a prompt row right, chosen by the row's `data_source`.

Rows whose data_source is `reasoning_gym/<dataset>` are scored by the reasoning-gym library's own
checker for that dataset (the extra `tasks`: `pip install 'opd-stages[tasks]'`), so an accuracy here
means what it means in that library. Every other row keeps rewards.rule_reward, under the name
"rule": for those rows nothing changes, and the rollout's reward and the verl bundle's reward.py (the
source of rewards.py) stay what they were. Each score names the checker that gave it, so a reader of
an accuracy knows what "right" meant. A row without a ground truth has no score (None), never a
silent 0.

reasoning-gym's checkers give partial credit (an answer that contains the reference gets its share of
the answer's length, among others); `correct` is full credit only, so an accuracy counts answers that
are right, not close.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Callable, Optional

from ..errors import UserError
from . import rewards

RULE = "rule"
REASONING_GYM = "reasoning_gym/"
TASKS_EXTRA = "pip install 'opd-stages[tasks]'"
Z95 = 1.959963984540054  # the standard normal's 97.5% quantile: a two-sided 95% interval


@dataclass(frozen=True)
class Score:
    value: float  # the checker's credit, in [0, 1]
    checker: str  # "rule" or "reasoning_gym/<dataset>"

    @property
    def correct(self) -> bool:
        return self.value >= 1.0


def _reasoning_gym(dataset: str, response: str, truth: str, row: dict) -> float:
    """The library's score_answer for `dataset` on the response's answer: the text of its last
    <answer>...</answer> (the tag the library's own prompts ask for, and `opd data reasoning-gym`'s
    instruction), else what the rule would take as the answer (last <final>, number or line)."""
    utils = _library()
    fn = _score_fn(dataset)
    answer = utils.extract_answer(response, tag_name="answer")
    if answer is None:
        answer = rewards.answer_of(response, numeric=rewards._as_number(truth) is not None)
    try:
        value = float(fn(answer, _entry(row, truth)))
    except Exception:  # the checker parses free text a model wrote: text it cannot parse is a wrong answer
        value = 0.0
    return min(max(value, 0.0), 1.0) if math.isfinite(value) else 0.0


# data_source prefix -> checker(dataset, response, truth, row) -> credit in [0, 1]; anything else: RULE
REGISTRY: dict[str, Callable[[str, str, str, dict], float]] = {REASONING_GYM: _reasoning_gym}


def checker_of(data_source) -> str:
    """The name of the checker that scores rows of `data_source`."""
    if isinstance(data_source, str):
        for prefix in REGISTRY:
            if data_source.startswith(prefix):
                return data_source
    return RULE


def score(response: str, row: dict) -> Optional[Score]:
    """The row's checker on `response` (the decoded answer text); None when the row has no ground truth."""
    truth = rewards.ground_truth(row)
    if truth is None:
        return None
    name = checker_of(row.get("data_source"))
    if name == RULE:
        return Score(rewards.rule_reward(response, truth), RULE)
    prefix = next(p for p in REGISTRY if name.startswith(p))
    return Score(REGISTRY[prefix](name[len(prefix):], response, truth, row), name)


def require(rows: list[dict]) -> None:
    """Raise the UserError a row's checker would raise (library missing, unknown dataset) now, before
    the answers it would score are generated."""
    for name in sorted({checker_of(r.get("data_source")) for r in rows if rewards.ground_truth(r) is not None}):
        prefix = next((p for p in REGISTRY if name.startswith(p)), None)
        if prefix == REASONING_GYM:
            _score_fn(name[len(prefix):])


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of k successes in n trials (it stays inside [0, 1] and is sensible
    at k = 0 or k = n and for small n, where the normal approximation is not); n = 0: [0, 1]."""
    if n == 0:
        return 0.0, 1.0
    p, z2 = k / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def accuracy(scores: list[Score]) -> dict:
    """{"correct", "n", "accuracy", "ci95" (Wilson), "checker"}: the share of full-credit answers;
    `checker` joins the names with "+" when the rows had several."""
    k, n = sum(s.correct for s in scores), len(scores)
    lo, hi = wilson(k, n)
    return {"correct": k, "n": n, "accuracy": round(k / n, 6) if n else 0.0, "ci95": [round(lo, 6), round(hi, 6)],
            "checker": "+".join(sorted({s.checker for s in scores}))}


# ---- reasoning-gym, imported only when a row needs it ----

def _library():
    try:
        import reasoning_gym.utils as utils
    except ImportError as e:
        raise UserError(f"rows with data_source '{REASONING_GYM}...' are scored by the reasoning-gym library, which "
                        f"is not installed: {TASKS_EXTRA}") from e
    return utils


@functools.lru_cache(maxsize=None)
def _score_fn(dataset: str):
    """The dataset's score_answer (building the dataset object once per process, not once per answer)."""
    _library()
    import reasoning_gym

    try:
        return reasoning_gym.get_score_answer_fn(dataset)
    except ValueError as e:
        raise UserError(f"data_source '{REASONING_GYM}{dataset}': reasoning-gym has no dataset {dataset!r}") from e


def _entry(row: dict, truth: str) -> dict:
    """The dataset entry the checker reads (its metadata included): extra_info.entry as written by
    `opd data reasoning-gym`; a row without one gets {question, answer: the ground truth, metadata: {}}."""
    info = row.get("extra_info")
    raw = info.get("entry") if isinstance(info, dict) else None
    if raw:
        try:
            entry = json.loads(raw)
        except json.JSONDecodeError as e:
            raise UserError(f"data_source {row.get('data_source')!r}: extra_info.entry is not JSON ({e})") from e
        if isinstance(entry, dict):
            return entry
    question = next((m.get("content") for m in reversed(row.get("prompt") or []) if m.get("role") == "user"), "")
    return {"question": question, "answer": truth, "metadata": {}}

