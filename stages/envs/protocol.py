"""The text protocol between a model and a tool environment, and a pure-Python episode driver.

The model writes, in an assistant turn, either one tool call or a final answer:

    <tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>
    <final>5</final>

and the environment replies with a `tool` message `<tool_result>{...json...}</tool_result>`.

Rules (the same for every environment, so one parser serves all):
- The first `<tool_call>` or `<final>` tag in the turn is the action; anything after it is ignored
  (one action per turn keeps the driver simple and the transcript unambiguous).
- A missing closing tag at the very end of the turn is tolerated, because samplers often stop on
  the closing tag as a stop string and drop it.
- A tool call's JSON body is capped (MAX_ARG_CHARS for its arguments) and every result is capped
  at MAX_RESULT_CHARS (cut, with a marker), so a runaway model cannot blow up the context.

`run_episode` drives a multi-turn conversation with a caller-supplied `generate_fn(messages) -> str`
(the real batched LM rollout lives elsewhere; tests pass scripted functions).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

MAX_ARG_CHARS = 2_000  # JSON text of one call's arguments
MAX_CALL_CHARS = MAX_ARG_CHARS + 500  # the whole JSON body between the tool_call tags
MAX_RESULT_CHARS = 4_000  # JSON text of one tool result shown to the model
TRUNCATION_MARKER = "...[truncated {n} chars]"
# The driver has no tokenizer; it budgets ~4 characters per token (the usual BPE rule of thumb) to
# bound a runaway turn. A caller with a real tokenizer enforces the exact budget in generate_fn.
CHARS_PER_TOKEN = 4
TOOL_ROLE = "tool"

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FINAL_OPEN, FINAL_CLOSE = "<final>", "</final>"
RESULT_OPEN, RESULT_CLOSE = "<tool_result>", "</tool_result>"

PROTOCOL_TEXT = f"""\
Protocol: in each reply, either call exactly one tool or give the final answer.
To call a tool, write a JSON object with "name" and "arguments" between tool_call tags:
{CALL_OPEN}{{"name": "TOOL_NAME", "arguments": {{...}}}}{CALL_CLOSE}
The result comes back as {RESULT_OPEN}{{...}}{RESULT_CLOSE}. When you know the answer, write
{FINAL_OPEN}ANSWER{FINAL_CLOSE}
with only the answer between the final tags."""


@dataclass
class Action:
    kind: str  # "tool_call" | "final" | "invalid"
    name: Optional[str] = None
    arguments: Optional[dict] = None
    answer: Optional[str] = None
    error: Optional[str] = None
    attempted_call: bool = False  # an invalid action that started a tool_call (counts as an invalid call)


def _invalid(error: str, attempted_call: bool) -> Action:
    return Action(kind="invalid", error=error, attempted_call=attempted_call)


def parse(text: Any) -> Action:
    """One assistant turn -> the action it takes. Never raises."""
    if not isinstance(text, str):
        return _invalid("the reply is not text", False)
    i_call, i_final = text.find(CALL_OPEN), text.find(FINAL_OPEN)
    if i_call < 0 and i_final < 0:
        return _invalid(f"no {CALL_OPEN} or {FINAL_OPEN} tag found; follow the protocol", False)
    if i_final >= 0 and (i_call < 0 or i_final < i_call):
        start = i_final + len(FINAL_OPEN)
        end = text.find(FINAL_CLOSE, start)
        return Action(kind="final", answer=(text[start:] if end < 0 else text[start:end]).strip())
    start = i_call + len(CALL_OPEN)
    end = text.find(CALL_CLOSE, start)
    body = (text[start:] if end < 0 else text[start:end]).strip()
    if len(body) > MAX_CALL_CHARS:
        return _invalid(f"tool call too long ({len(body)} chars; at most {MAX_CALL_CHARS})", True)
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:  # RecursionError: deeply nested brackets
        return _invalid(f"tool call is not valid JSON: {str(e)[:120]}", True)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return _invalid('tool call must be a JSON object with a string "name"', True)
    arguments = obj.get("arguments", {})
    if not isinstance(arguments, dict):
        return _invalid('"arguments" must be a JSON object', True)
    if len(json.dumps(arguments, ensure_ascii=False)) > MAX_ARG_CHARS:
        return _invalid(f"arguments too long (at most {MAX_ARG_CHARS} chars of JSON)", True)
    return Action(kind="tool_call", name=obj["name"], arguments=arguments)


def format_call(name: str, args: dict) -> str:
    return f"{CALL_OPEN}{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}{CALL_CLOSE}"


def _json_safe(value: Any) -> Any:
    # Tool results are built by our own code, but a float inf/nan (e.g. from SQL) would make the
    # JSON invalid; stringify it instead of emitting `Infinity`.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def format_result(result: dict) -> str:
    text = json.dumps(_json_safe(result), ensure_ascii=False)
    if len(text) > MAX_RESULT_CHARS:
        text = text[:MAX_RESULT_CHARS] + TRUNCATION_MARKER.format(n=len(text) - MAX_RESULT_CHARS)
    return f"{RESULT_OPEN}{text}{RESULT_CLOSE}"


def render_system_prompt(intro: str, tools: dict[str, tuple[str, dict[str, str]]], answer_rule: str) -> str:
    """tools: name -> (description, {argument: type and meaning})."""
    lines = [intro, "", "Tools:"]
    for name, (description, args) in tools.items():
        arg_text = ", ".join(f'"{a}": {t}' for a, t in args.items()) or "no arguments"
        lines.append(f"- {name}({arg_text}): {description}")
    return "\n".join(lines + ["", PROTOCOL_TEXT, "", answer_rule])


def initial_messages(env, task) -> list[dict]:
    return [
        {"role": "system", "content": env.system_prompt(task)},
        {"role": "user", "content": task.question},
    ]


# ---- oracle traces: the environments' own solvers build transcripts with these two helpers ----

def trace_call(trace: list[dict], env_call_tool: Callable, task, name: str, args: dict, thought: str = "") -> dict:
    """Append an assistant tool call and the real tool result to `trace`; return the result dict."""
    trace.append({"role": "assistant", "content": f"{thought}\n{format_call(name, args)}".strip()})
    result = env_call_tool(task, name, args)
    trace.append({"role": TOOL_ROLE, "content": format_result(result)})
    return result


def trace_final(trace: list[dict], answer: str, thought: str = "") -> list[dict]:
    trace.append({"role": "assistant", "content": f"{thought}\n{FINAL_OPEN}{answer}{FINAL_CLOSE}".strip()})
    return trace


# ---- the episode driver ----

@dataclass
class Episode:
    messages: list[dict] = field(default_factory=list)  # system, user, then assistant/tool turns
    answer: Optional[str] = None  # text inside <final>, None when the model never finished
    success: bool = False  # strict: env.verify on the final answer
    success_lenient: bool = False  # diagnostic only, reported beside `success`, never instead
    turns: int = 0  # assistant turns generated
    tool_calls: int = 0  # well-formed tool calls executed by the environment
    invalid_calls: int = 0  # tool calls that failed: malformed/oversized JSON, or an error result
    parse_errors: int = 0  # turns that held no well-formed action (no tag, bad tool-call JSON)
    truncated_turns: int = 0  # turns cut at the per-turn character budget
    finish_reason: str = ""  # "final" | "max_turns"


def run_episode(env, task, generate_fn: Callable[[list[dict]], str], max_turns: int,
                max_tokens_per_turn: int) -> Episode:
    """Alternate generate_fn and the environment until a final answer or max_turns assistant turns.

    Every non-final turn gets a tool message back (a result or an {"error": ...}), so the model can
    recover; runaway models are bounded by max_turns and the per-turn character budget.
    """
    ep = Episode(messages=initial_messages(env, task))
    char_budget = max(1, int(max_tokens_per_turn)) * CHARS_PER_TOKEN
    last_text = ""
    for _ in range(max(0, int(max_turns))):
        text = generate_fn(list(ep.messages))
        text = text if isinstance(text, str) else ""
        if len(text) > char_budget:
            text = text[:char_budget]
            ep.truncated_turns += 1
        ep.turns += 1
        last_text = text
        ep.messages.append({"role": "assistant", "content": text})
        action = parse(text)
        if action.kind == "final":
            ep.answer = action.answer
            ep.finish_reason = "final"
            break
        if action.kind == "invalid":
            ep.parse_errors += 1
            ep.invalid_calls += int(action.attempted_call)
            result = {"error": action.error}
        else:
            result = env.call_tool(task, action.name, action.arguments)
            ep.tool_calls += 1
            ep.invalid_calls += int(isinstance(result, dict) and "error" in result)
        ep.messages.append({"role": TOOL_ROLE, "content": format_result(result)})
    else:
        ep.finish_reason = "max_turns"
    if ep.answer is not None:
        ep.success = bool(env.verify(task, ep.answer))
    # Lenient looks at the final answer, or else the last turn: a model that writes
    # <answer>42</answer> instead of <final> is exactly what the diagnostic should reveal.
    ep.success_lenient = bool(env.verify_lenient(task, ep.answer if ep.answer is not None else last_text))
    return ep
