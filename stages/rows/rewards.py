"""Rule rewards for prompt rows that carry `reward_model.ground_truth` (verl's row schema).

One rule, deliberately simple and strict: the response's answer is the text inside its last
`<final>...</final>` (the tool protocol's answer tag) if there is one, otherwise its last number (or,
for a non-numeric ground truth, its last non-empty line); reward 1.0 when that answer equals the
ground truth (numbers compared as numbers, text case- and space-insensitively), else 0.0. Rows without
a ground truth get no reward (None), never a silent 0.
"""
from __future__ import annotations

import re
from typing import Any, Optional

_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")
_FINAL = re.compile(r"<final>(.*?)(?:</final>|$)", re.DOTALL)


def ground_truth(row: dict) -> Optional[str]:
    """`reward_model.ground_truth` of a prompt row as text, or None when absent or empty."""
    rm = row.get("reward_model")
    gt = rm.get("ground_truth") if isinstance(rm, dict) else None
    if gt is None:
        return None
    gt = str(gt).strip()
    return gt or None


def _as_number(text: str) -> Optional[float]:
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


def answer_of(response: str, numeric: bool) -> Optional[str]:
    finals = _FINAL.findall(response)
    if finals:
        return finals[-1].strip()
    if numeric:
        nums = _NUMBER.findall(response)
        return nums[-1] if nums else None
    lines = [ln.strip() for ln in response.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else None


def rule_reward(response: str, truth: Any) -> Optional[float]:
    """1.0 / 0.0 by the module's rule; None when there is no ground truth to compare with."""
    if truth is None or not str(truth).strip():
        return None
    truth = str(truth).strip()
    t_num = _as_number(truth)
    ans = answer_of(response, numeric=t_num is not None)
    if ans is None:
        return 0.0
    if t_num is not None:
        a_num = _as_number(ans)
        if a_num is None:  # a <final> answer with words around the number: take its last number
            nums = _NUMBER.findall(ans)
            a_num = _as_number(nums[-1]) if nums else None
        return float(a_num is not None and abs(a_num - t_num) <= 1e-9 * max(1.0, abs(t_num)))
    return float(" ".join(ans.lower().split()) == " ".join(truth.lower().split()))
