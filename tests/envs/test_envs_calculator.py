"""Calculator: the safe evaluator, unit conversion, answer canonicalisation, dependent hard tasks."""
import json
import math
import re

import pytest

from stages.envs import calculator as calc
from stages.envs import protocol
from stages.envs.task import MAX_ARG_CHARS

TASK = calc.generate("easy", 1, 0, "train")[0]


def run(expression):
    return calc.call_tool(TASK, "calculator", {"expression": expression})


@pytest.mark.parametrize("expression,result,rounded", [
    ("2 + 3 * 4", 14, "14"), ("(2 + 3) * 4", 20, "20"), ("7 / 2", 3.5, "3.5"), ("6 / 3", 2, "2"),
    ("347 / 29", 11.965517, "11.97"), ("17 // 5", 3, "3"), ("17 % 5", 2, "2"), ("-2 ** 2", -4, "-4"),
    ("2 ** 10", 1024, "1024"), ("2 ** -2", 0.25, "0.25"), ("-(3 - 5)", 2, "2"), ("1_000 + 1", 1001, "1001"),
    ("0.1 + 0.2", 0.3, "0.3"), ("-0.001", -0.001, "0"), ("1e3 * 2", 2000, "2000"),
])
def test_calculator_values(expression, result, rounded):
    assert run(expression) == {"result": result, "rounded": rounded}


@pytest.mark.parametrize("expression,error_part", [
    ("1 / 0", "division by zero"), ("5 // 0", "division by zero"), ("5 % 0.0", "division by zero"),
    ("0 ** -1", "division by zero"), ("2 ** 10000", "exponent too large"), ("9 ** 9 ** 9", "exponent too large"),
    ("10 ** 20", "magnitude too large"), ("1e300 * 1e300", "magnitude too large"), ("9" * 30, "magnitude too large"),
    ("(-8) ** 0.5", "not a real number"), ("1j", "unsupported syntax"), ("True + 1", "unsupported syntax"),
    ("__import__('os')", "unsupported syntax"), ("(1).__class__", "unsupported syntax"),
    ("().__class__.__bases__[0].__subclasses__()", "unsupported syntax"), ("abs(-1)", "unsupported syntax"),
    ("x + 1", "unsupported syntax"), ("[1, 2]", "unsupported syntax"), ("'a' * 3", "unsupported syntax"),
    ("1 if 1 else 2", "unsupported syntax"), ("lambda: 1", "unsupported syntax"), ("1 < 2", "unsupported syntax"),
    ("f'{1}'", "unsupported syntax"), ("1 +", "not valid"), ("", "not valid"), ("1; 2", "not valid"),
    ("import os", "not valid"), ("-" * 150 + "1", "nested too deeply"), ("1 + " * 60 + "1", "too long"),
    ("(" * 199 + "1", "not valid"),
])
def test_calculator_refuses_bad_expressions(expression, error_part):
    out = run(expression)
    assert set(out) == {"error"} and error_part in out["error"] and "internal" not in out["error"], out


@pytest.mark.parametrize("arguments,error_part", [
    ({}, "missing argument(s) 'expression'"), ({"expression": 5}, "must be a str"),
    ({"expression": "1", "extra": 1}, "unknown argument(s) 'extra'"), ("1 + 1", "JSON object"),
    ({"expression": "1+" * MAX_ARG_CHARS + "1"}, "arguments too long"),
])
def test_calculator_bad_arguments(arguments, error_part):
    out = calc.call_tool(TASK, "calculator", arguments)
    assert error_part in out["error"], out


def test_deep_parentheses_are_fine():
    assert run("(" * 90 + "1" + ")" * 90) == {"result": 1, "rounded": "1"}


def test_unknown_tool():
    assert "unknown tool 'python'" in calc.call_tool(TASK, "python", {"code": "1"})["error"]
    assert "unknown tool" in calc.call_tool(TASK, None, {})["error"]


@pytest.mark.parametrize("value,src,dst,expected", [
    (5, "km", "m", 5000), (3, "ft", "in", 12 * 3), (100, "C", "F", 212), (32, "F", "C", 0),
    (0, "C", "K", 273.15), (2, "h", "min", 120), (1, "lb", "g", 453.59237), (1, "mi", "km", 1.609344),
    (2.5, "kg", "g", 2500), (90, "min", "h", 1.5),
])
def test_convert(value, src, dst, expected):
    out = calc.call_tool(TASK, "convert", {"value": value, "from_unit": src, "to_unit": dst})
    assert out == {"value": expected, "unit": dst}


@pytest.mark.parametrize("arguments,error_part", [
    ({"value": 1, "from_unit": "km", "to_unit": "kg"}, "cannot convert length"),
    ({"value": 1, "from_unit": "parsec", "to_unit": "m"}, "unknown unit 'parsec'"),
    ({"value": "1", "from_unit": "km", "to_unit": "m"}, "must be a number"),
    ({"value": True, "from_unit": "km", "to_unit": "m"}, "must be a number"),
    ({"value": 1e300, "from_unit": "km", "to_unit": "m"}, "magnitude at most"),
    ({"value": 1, "from_unit": "km"}, "missing argument(s) 'to_unit'"),
])
def test_convert_errors(arguments, error_part):
    assert error_part in calc.call_tool(TASK, "convert", arguments)["error"]


def test_canonical_rule():
    assert [calc.canonical(v) for v in (7, 2.0, 2.5, 3.14159, 2.999, -0.004, 1e6 / 3)] == \
        ["7", "2", "2.5", "3.14", "3", "0", "333333.33"]


def test_splits_have_their_shape():
    for task in calc.generate("easy", 30, 1, "train"):
        assert len(re.findall(r"[-+*/%]+", task.context["expression"])) == 1
    for task in calc.generate("medium", 30, 1, "train"):
        assert len(re.findall(r" [-+*/] ", task.context["expression"])) >= 2
        assert sum(m["role"] == "tool" for m in calc.oracle_trace(task)) == 1


def test_hard_tasks_need_two_dependent_calls():
    for task in calc.generate("hard", 40, 2, "train") + calc.generate("hard", 10, 2, "test"):
        calls = [protocol.parse(m["content"]) for m in calc.oracle_trace(task) if m["role"] == "assistant"]
        assert [c.kind for c in calls] == ["tool_call", "tool_call", "final"]
        assert (calls[0].name, calls[1].name) == ("convert", "calculator")
        first = calc.call_tool(task, "convert", calls[0].arguments)["value"]
        # the second call's argument contains the first call's result, which the question lacks
        assert json.dumps(first) in calls[1].arguments["expression"]
        assert str(task.context["value"]) in task.question
        if first != task.context["value"]:
            assert json.dumps(first) not in task.question
        # ground truth matches exact math (no intermediate rounding) within the 2-decimal rule
        ctx = task.context
        exact = calc.safe_eval(ctx["then"].format(x=repr(_exact_convert(ctx))))
        assert math.isclose(float(task.ground_truth), exact, abs_tol=0.0051), (task.question, exact)


def _exact_convert(ctx):
    v, src, dst = ctx["value"], ctx["from_unit"], ctx["to_unit"]
    if src == "F":
        return (v - 32) * 5 / 9
    for table in calc.UNITS.values():
        if src in table:
            return v * table[src] / table[dst]


def test_lenient_scoring():
    tasks = calc.generate("easy", 50, 0, "train")
    task = next(t for t in tasks if t.ground_truth.isdigit() and len(t.ground_truth) > 3)
    gt = task.ground_truth
    with_commas = f"{int(gt):,}"
    assert calc.verify(task, f"  {gt}\n") and not calc.verify(task, with_commas)
    assert calc.verify_lenient(task, with_commas) and calc.verify_lenient(task, f"<answer>{gt}</answer>")
    assert calc.verify_lenient(task, f"\\boxed{{{gt}}}") and calc.verify_lenient(task, f"{gt}.")
    assert calc.verify_lenient(task, f"{int(gt) + 0.004}") and not calc.verify_lenient(task, str(int(gt) + 1))
    assert not calc.verify(task, None) and not calc.verify_lenient(task, None)
