"""Calculator environment: arithmetic and unit conversion through two tools.

Splits:
- easy:   one operation ("What is 347 times 29?"), one `calculator` call.
- medium: a multi-operation expression, one `calculator` call.
- hard:   a word problem needing two DEPENDENT calls: `convert` a quantity, then `calculator` on
          an expression that contains the converted value (so the second call's argument can only
          be written after the first result is known).

Answer rule (canonical strings, `canonical()`): the value rounded to 2 decimals and written
without trailing zeros or a trailing dot: 1024 -> "1024", 6/3 -> "2", 347/29 -> "11.97",
2.5 -> "2.5", -0.001 -> "0". The calculator tool returns this string as "rounded" next to the
full-precision "result", so the final answer is the last call's "rounded" field.
Tool values are rounded to 6 decimals (`tool_number()`); a hard task's ground truth is computed
from exactly the value the convert tool returns, so the oracle and the ground truth agree.

The evaluator is built on `ast.parse(mode="eval")` and walks a whitelist of node types (number
literals, + - * / // % **, unary +/-); there is no eval/exec/compile of code and no names, calls,
attributes or subscripts. Exponents and magnitudes are capped BEFORE computing, so `9**9**9`
cannot hang the process.
"""
from __future__ import annotations

import ast
import math
import operator
import random
from typing import Any, Optional, Union

from . import protocol
from .task import NUMBER, Task, ToolError, check_args, check_split, dispatch, generate_tasks
from .task import verify_lenient as _verify_lenient
from .task import verify_strict

SPLITS = ("easy", "medium", "hard")
MAX_EXPR_CHARS = 200
MAX_MAGNITUDE = 1e15  # every literal and intermediate value; beyond it floats lose integer precision
MAX_EXPONENT = 64
MAX_DEPTH = 40  # AST nesting; the parser already refuses ~200 nested parentheses
MAX_CONVERT_VALUE = 1e12

Number = Union[int, float]

# ---- the safe evaluator ----

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}


def _checked(value: Any) -> Number:
    if isinstance(value, complex):  # e.g. (-8) ** 0.5
        raise ToolError("result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("result is not a finite number")
    if abs(value) > MAX_MAGNITUDE:
        raise ToolError(f"magnitude too large (limit {MAX_MAGNITUDE:g})")
    return value


def _check_pow(base: Number, exponent: Number) -> None:
    if abs(exponent) > MAX_EXPONENT:
        raise ToolError(f"exponent too large (limit {MAX_EXPONENT})")
    if base == 0 and exponent < 0:
        raise ToolError("division by zero")
    # log10 of the result's magnitude, known before computing it
    if base != 0 and exponent * math.log10(abs(base)) > math.log10(MAX_MAGNITUDE) + 1:
        raise ToolError(f"magnitude too large (limit {MAX_MAGNITUDE:g})")


def _eval(node: ast.AST, depth: int) -> Number:
    if depth > MAX_DEPTH:
        raise ToolError("expression nested too deeply")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool/complex/str
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand, depth + 1)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left, depth + 1), _eval(node.right, depth + 1)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ToolError("division by zero")
        if isinstance(node.op, ast.Pow):
            _check_pow(left, right)
        try:
            return _checked(_BINOPS[type(node.op)](left, right))
        except (OverflowError, ZeroDivisionError, ValueError) as e:
            raise ToolError(f"arithmetic error: {e}") from None
    raise ToolError(f"unsupported syntax {type(node).__name__}: only numbers, + - * / // % ** and parentheses")


def safe_eval(expression: Any) -> Number:
    """Evaluate an arithmetic expression or raise ToolError."""
    if not isinstance(expression, str):
        raise ToolError("expression must be a string")
    if len(expression) > MAX_EXPR_CHARS:
        raise ToolError(f"expression too long (at most {MAX_EXPR_CHARS} chars)")
    try:
        tree = ast.parse(expression.strip(), mode="eval")  # builds an AST only; nothing runs
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ToolError("expression is not valid arithmetic syntax") from None
    return _eval(tree.body, 0)


def canonical(value: Number) -> str:
    if isinstance(value, int):
        return str(value)
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def tool_number(value: Number) -> Number:
    """How tools report a number: exact ints stay ints, floats rounded to 6 decimals."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value if isinstance(value, int) else round(value, 6)


# ---- unit conversion ----

# factor to the dimension's base unit (metre, gram, second); temperatures are affine (below)
UNITS = {
    "length": {"m": 1.0, "km": 1000.0, "cm": 0.01, "mm": 0.001, "mi": 1609.344, "yd": 0.9144,
               "ft": 0.3048, "in": 0.0254},
    "mass": {"g": 1.0, "kg": 1000.0, "mg": 0.001, "lb": 453.59237, "oz": 28.349523125},
    "time": {"s": 1.0, "min": 60.0, "h": 3600.0, "day": 86400.0},
    "temperature": {"C": None, "F": None, "K": None},
}
_DIMENSION = {u: dim for dim, table in UNITS.items() for u in table}
UNIT_NAMES = ("m metre, km kilometre, cm, mm, mi mile, yd yard, ft foot, in inch; g gram, kg, mg, "
              "lb pound, oz ounce; s second, min minute, h hour, day; C Celsius, F Fahrenheit, K Kelvin")


def _to_celsius(v: float, unit: str) -> float:
    return v if unit == "C" else (v - 32.0) * 5.0 / 9.0 if unit == "F" else v - 273.15


def _from_celsius(c: float, unit: str) -> float:
    return c if unit == "C" else c * 9.0 / 5.0 + 32.0 if unit == "F" else c + 273.15


def convert_value(value: Number, from_unit: str, to_unit: str) -> Number:
    for unit in (from_unit, to_unit):
        if unit not in _DIMENSION:
            raise ToolError(f"unknown unit {unit[:20]!r}; known units: {', '.join(_DIMENSION)}")
    dim = _DIMENSION[from_unit]
    if dim != _DIMENSION[to_unit]:
        raise ToolError(f"cannot convert {dim} ({from_unit}) to {_DIMENSION[to_unit]} ({to_unit})")
    if not math.isfinite(value) or abs(value) > MAX_CONVERT_VALUE:
        raise ToolError(f"value must be finite with magnitude at most {MAX_CONVERT_VALUE:g}")
    if dim == "temperature":
        out = _from_celsius(_to_celsius(float(value), from_unit), to_unit)
    else:
        out = value * UNITS[dim][from_unit] / UNITS[dim][to_unit]
    return tool_number(out)


# ---- tools ----

TOOLS = {
    "calculator": ("evaluate an arithmetic expression with numbers, + - * / // % ** and parentheses; "
                   'returns {"result": full precision, "rounded": the answer format}',
                   {"expression": "string"}),
    "convert": (f"convert a quantity between units ({UNIT_NAMES}); returns {{\"value\": ..., \"unit\": ...}}",
                {"value": "number", "from_unit": "string", "to_unit": "string"}),
}


def _tool_calculator(task: Task, args: dict) -> dict:
    check_args(args, {"expression": str})
    value = safe_eval(args["expression"])
    return {"result": tool_number(value), "rounded": canonical(value)}


def _tool_convert(task: Task, args: dict) -> dict:
    check_args(args, {"value": NUMBER, "from_unit": str, "to_unit": str})
    return {"value": convert_value(args["value"], args["from_unit"], args["to_unit"]), "unit": args["to_unit"]}


_TOOLS = {"calculator": _tool_calculator, "convert": _tool_convert}


def call_tool(task: Task, name: str, arguments: dict) -> dict:
    return dispatch(_TOOLS, task, name, arguments)


def system_prompt(task: Task) -> str:
    return protocol.render_system_prompt(
        "You solve arithmetic and unit-conversion problems with tools. Do not compute by hand; "
        "use the tools.", TOOLS,
        "Answer format: the number only, as the calculator's \"rounded\" field gives it (integers "
        "exact, otherwise rounded to 2 decimals, no trailing zeros, no units).")


# ---- task generation ----

_EASY = [  # (symbol, question template, operand ranges)
    ("+", "What is {a} plus {b}?", (10, 9999), (10, 9999)),
    ("-", "What is {a} minus {b}?", (10, 9999), (10, 9999)),
    ("*", "What is {a} times {b}?", (2, 999), (2, 999)),
    ("/", "What is {a} divided by {b}?", (10, 9999), (2, 99)),
    ("//", "What is the whole-number quotient of {a} divided by {b}?", (10, 9999), (2, 99)),
    ("%", "What is the remainder when {a} is divided by {b}?", (10, 9999), (2, 99)),
    ("**", "What is {a} to the power of {b}?", (2, 30), (2, 5)),
]
_MEDIUM_PATTERNS = ["{0} {o0} {1} {o1} {2}", "({0} {o0} {1}) {o1} {2}", "{0} {o0} ({1} {o1} {2})",
                    "({0} {o0} {1}) {o1} ({2} {o2} {3})", "{0} {o0} {1} {o1} {2} {o2} {3}",
                    "({0} {o0} {1} {o1} {2}) {o2} {3}"]
_HARD = [  # (from, to, expression over the converted value x and the number b, question)
    ("lb", "g", "{x} + {b}", "A parcel weighs {a} pounds and its packing adds {b} grams. "
                             "What is the total weight in grams?"),
    ("mi", "km", "{x} + {b}", "A hiker walks {a} miles in the morning and {b} kilometres in the "
                              "afternoon. How many kilometres does she walk in total?"),
    ("ft", "m", "{x} - {b}", "A rope is {a} feet long and {b} metres are cut off. "
                             "How many metres of rope remain?"),
    ("h", "min", "{x} + {b}", "A festival shows {a} hours of films plus {b} minutes of trailers. "
                              "How many minutes is that in total?"),
    ("F", "C", "{x} + {b}", "The water is at {a} degrees Fahrenheit and then warms by {b} degrees "
                            "Celsius. What is its temperature in degrees Celsius now?"),
    ("km", "mi", "{x} * {b}", "A car travels {a} kilometres every day for {b} days. "
                              "How many miles is that in total?"),
    ("kg", "lb", "{x} * {b}", "Each of {b} boxes weighs {a} kilograms. "
                              "What is their total weight in pounds?"),
    ("in", "cm", "{x} / {b}", "A ribbon {a} inches long is cut into {b} equal pieces. "
                              "How long is each piece in centimetres?"),
    ("oz", "g", "{x} * {b}", "A recipe needs {a} ounces of flour for each of {b} loaves. "
                             "How many grams of flour is that?"),
    ("day", "h", "{x} + {b}", "A project took {a} days plus {b} hours of overtime. "
                              "How many hours is that in total?"),
]


def _make_easy(rng: random.Random) -> Optional[tuple]:
    symbol, template, (a_lo, a_hi), (b_lo, b_hi) = rng.choice(_EASY)
    a, b = rng.randint(a_lo, a_hi), rng.randint(b_lo, b_hi)
    expression = f"{a} {symbol} {b}"
    answer = canonical(safe_eval(expression))
    hint = f"Compute {expression} with the calculator: {answer}."
    return template.format(a=a, b=b), {"expression": expression}, answer, hint


def _make_medium(rng: random.Random) -> Optional[tuple]:
    pattern = rng.choice(_MEDIUM_PATTERNS)
    expression = pattern.format(*(rng.randint(2, 60) for _ in range(4)),
                                **{f"o{i}": rng.choice("+-*/") for i in range(3)})
    try:
        value = safe_eval(expression)
    except ToolError:  # e.g. a division by zero inside parentheses: draw again
        return None
    if abs(value) > 1e7:
        return None
    question = rng.choice(["What is {e}?", "Evaluate the expression {e}.", "Compute {e}."]).format(e=expression)
    answer = canonical(value)
    return question, {"expression": expression}, answer, f"One call: calculator({expression}) = {answer}."


def _hard_plan(context: dict) -> tuple[Number, str]:
    """The converted value x and the second expression, exactly as the oracle produces them."""
    x = convert_value(context["value"], context["from_unit"], context["to_unit"])
    return x, context["then"].format(x=x)


def _make_hard(rng: random.Random) -> Optional[tuple]:
    from_unit, to_unit, then, template = rng.choice(_HARD)
    a = rng.randint(2, 250)
    if then.startswith("{x} -"):  # leave some rope: b below the converted length
        b = rng.randint(1, max(1, int(a * 0.3048 * 0.8)))
    elif then.startswith("{x} *") or then.startswith("{x} /"):
        b = rng.randint(2, 12)
    else:
        b = rng.randint(1, 500)
    context = {"value": a, "from_unit": from_unit, "to_unit": to_unit, "then": then.replace("{b}", str(b))}
    x, expression = _hard_plan(context)
    answer = canonical(safe_eval(expression))
    hint = (f"Step 1: convert({a}, {from_unit} -> {to_unit}) = {x}. "
            f"Step 2: calculator({expression}) = {answer}.")
    return template.format(a=a, b=b), context, answer, hint


_MAKERS = {"easy": _make_easy, "medium": _make_medium, "hard": _make_hard}


def generate(split: str, n: int, seed: int, part: str) -> list[Task]:
    check_split(split, SPLITS)
    return generate_tasks("calculator", split, n, seed, part, _MAKERS[split])


# ---- the environment's own solver and scoring ----

def oracle_trace(task: Task) -> list[dict]:
    trace: list[dict] = []
    if task.split == "hard":
        ctx = task.context
        first = protocol.trace_call(trace, call_tool, task, "convert",
                                    {"value": ctx["value"], "from_unit": ctx["from_unit"], "to_unit": ctx["to_unit"]},
                                    f"First convert {ctx['value']} {ctx['from_unit']} to {ctx['to_unit']}.")
        # the second call is written from the first call's actual result, not from the context
        expression = ctx["then"].format(x=first["value"])
        thought = f"That is {first['value']} {ctx['to_unit']}; now compute the rest."
    else:
        expression, thought = task.context["expression"], ""
    result = protocol.trace_call(trace, call_tool, task, "calculator", {"expression": expression}, thought)
    return protocol.trace_final(trace, result["rounded"])


def verify(task: Task, answer: str) -> bool:
    return verify_strict(task, answer)


def verify_lenient(task: Task, text: str) -> bool:
    return _verify_lenient(task, text)
