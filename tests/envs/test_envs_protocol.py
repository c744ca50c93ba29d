"""The text protocol parser/formatter and the multi-turn episode driver."""
import json

import pytest

from stages import envs
from stages.envs import protocol
from stages.envs.protocol import MAX_ARG_CHARS, MAX_RESULT_CHARS, format_call, format_result, parse, run_episode


def test_parse_tool_call_and_final():
    a = parse('Let me add.\n<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>')
    assert (a.kind, a.name, a.arguments) == ("tool_call", "calculator", {"expression": "2+3"})
    assert parse(format_call("keys", {"path": ""})).arguments == {"path": ""}
    f = parse("thinking...\n<final> 42 </final> trailing")
    assert (f.kind, f.answer) == ("final", "42")
    # a sampler that stops on the closing tag drops it: tolerated at the end of the turn
    assert parse("<final>17").answer == "17"
    assert parse('<tool_call>{"name": "schema", "arguments": {}}').kind == "tool_call"
    # missing "arguments" means none
    assert parse('<tool_call>{"name": "schema"}</tool_call>').arguments == {}


def test_first_action_wins():
    assert parse("<final>1</final><tool_call>{\"name\": \"x\"}</tool_call>").kind == "final"
    a = parse('<tool_call>{"name": "a", "arguments": {}}</tool_call><final>2</final>')
    assert (a.kind, a.name) == ("tool_call", "a")


@pytest.mark.parametrize("text,error_part,attempted", [
    ("just prose, no tags", "no <tool_call> or <final>", False),
    ("<answer>5</answer>", "no <tool_call> or <final>", False),
    ("<tool_call>{name: calculator}</tool_call>", "not valid JSON", True),
    ("<tool_call>[1, 2]</tool_call>", 'string "name"', True),
    ('<tool_call>{"name": 3}</tool_call>', 'string "name"', True),
    ('<tool_call>{"name": "get", "arguments": "users"}</tool_call>', '"arguments" must be', True),
    ("<tool_call>" + "[" * 2000 + "]" * 2000 + "</tool_call>", "too long", True),
    ("<tool_call>" + "[" * 1200 + "]" * 1200 + "</tool_call>", "", True),  # deep nesting: no crash
])
def test_parse_invalid(text, error_part, attempted):
    a = parse(text)
    assert a.kind == "invalid" and error_part in a.error and a.attempted_call is attempted


def test_parse_oversized_arguments_and_non_text():
    big = format_call("calculator", {"expression": "1+" * (MAX_ARG_CHARS // 2)})
    a = parse(big)
    assert a.kind == "invalid" and "too long" in a.error
    assert parse(None).kind == "invalid"


def test_format_result_caps_size_with_marker():
    small = format_result({"a": 1})
    assert small == '<tool_result>{"a": 1}</tool_result>'
    text = format_result({"rows": ["x" * 100] * 100})
    body = text[len("<tool_result>"):-len("</tool_result>")]
    assert body.startswith('{"rows": ["xxx') and "...[truncated " in body
    assert len(body) < MAX_RESULT_CHARS + 40
    assert json.loads(format_result({"v": float("inf")})[13:-14]) == {"v": "inf"}


def _scripted(replies):
    it = iter(replies)
    return lambda messages: next(it)


def test_oracle_replay_episode_succeeds():
    env = envs.calculator
    task = env.generate("hard", 1, 0, "train")[0]
    trace = env.oracle_trace(task)
    ep = run_episode(env, task, _scripted([m["content"] for m in trace if m["role"] == "assistant"]), 8, 256)
    assert ep.finish_reason == "final" and ep.success and ep.success_lenient
    assert ep.answer == task.ground_truth
    assert ep.messages[:2] == protocol.initial_messages(env, task)
    assert ep.messages[2:] == trace  # the driver's tool turns are exactly the oracle's
    assert (ep.turns, ep.tool_calls, ep.invalid_calls, ep.parse_errors) == (3, 2, 0, 0)


def test_runaway_model_stops_at_max_turns():
    env = envs.jsonnav
    task = env.generate("default", 1, 0, "train")[0]
    calls = []

    def loop_forever(messages):
        calls.append(len(messages))
        return format_call("keys", {"path": ""})

    ep = run_episode(env, task, loop_forever, 5, 64)
    assert ep.finish_reason == "max_turns" and ep.turns == 5 and len(calls) == 5
    assert ep.answer is None and not ep.success and not ep.success_lenient
    assert (ep.tool_calls, ep.invalid_calls, ep.parse_errors) == (5, 0, 0)
    assert len(ep.messages) == 2 + 2 * 5


def test_garbage_model_gets_errors_and_is_counted():
    env = envs.sqlite
    task = env.generate("default", 1, 0, "train")[0]
    replies = ["blah blah", '<tool_call>{"name": query}</tool_call>', format_call("drop_all", {}),
               format_call("query", {"sql": "DELETE FROM orders"}), 12345]
    ep = run_episode(env, task, _scripted(replies), 5, 64)
    tool_msgs = [m["content"] for m in ep.messages if m["role"] == "tool"]
    assert len(tool_msgs) == 5 and all(m.startswith('<tool_result>{"error": ') for m in tool_msgs)
    assert "unknown tool 'drop_all'" in tool_msgs[2]
    # parse errors: prose, bad JSON, non-text; invalid calls: bad JSON, unknown tool, refused SQL
    assert (ep.parse_errors, ep.invalid_calls, ep.tool_calls) == (3, 3, 2)
    assert ep.finish_reason == "max_turns"


def test_overlong_turn_is_truncated_to_budget():
    env = envs.calculator
    task = env.generate("easy", 1, 0, "train")[0]
    ep = run_episode(env, task, lambda m: "z" * 100_000, 2, 10)
    assert ep.truncated_turns == 2 and len(ep.messages[2]["content"]) == 10 * protocol.CHARS_PER_TOKEN


def test_zero_turns():
    env = envs.calculator
    task = env.generate("easy", 1, 0, "train")[0]
    ep = run_episode(env, task, lambda m: pytest.fail("must not generate"), 0, 10)
    assert (ep.turns, ep.finish_reason, ep.success) == (0, "max_turns", False)


def test_lenient_and_strict_differ_on_answer_wrapped_response():
    env = envs.calculator
    task = next(t for t in env.generate("easy", 50, 0, "train") if "." not in t.ground_truth)
    wrapped = f"<final><answer>{task.ground_truth}</answer></final>"
    ep = run_episode(env, task, _scripted([wrapped]), 3, 64)
    assert ep.finish_reason == "final" and ep.answer == f"<answer>{task.ground_truth}</answer>"
    assert ep.success is False and ep.success_lenient is True
    # a model that never uses <final> but writes <answer>: strict fails, lenient sees it
    ep2 = run_episode(env, task, lambda m: f"The result is <answer>{task.ground_truth}</answer>", 2, 64)
    assert (ep2.finish_reason, ep2.success, ep2.success_lenient) == ("max_turns", False, True)


def _random_value(rng, depth=0):
    pick = rng.randrange(9 if depth < 3 else 6)
    return [lambda: None, lambda: rng.random() * 10.0 ** rng.randint(-5, 300), lambda: rng.randint(-10**30, 10**30),
            lambda: "".join(rng.choice("ab1.[]()*/%-_'\";\\ \x00é") for _ in range(rng.randint(0, 40))),
            lambda: rng.choice([True, False, float("nan"), float("inf"), "", "users[0]", "SELECT 1", "1/0"]),
            lambda: rng.choice(["(1).__class__", "DROP TABLE orders", "$", "2**99"]),
            lambda: [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))],
            lambda: {str(rng.random()): _random_value(rng, depth + 1)},
            lambda: {"nested": _random_value(rng, depth + 1)}][pick]()


@pytest.mark.parametrize("name", sorted(envs.REGISTRY))
def test_fuzzed_tool_calls_never_raise(name):
    import random
    env = envs.get(name)
    task = env.generate(env.SPLITS[-1], 1, 0, "train")[0]
    arg_names = ["expression", "value", "from_unit", "to_unit", "path", "key", "sql", "x"]
    tools = ["calculator", "convert", "get", "keys", "find", "schema", "query", "nope", None]
    rng = random.Random(0)
    for _ in range(300):
        arguments = {n: _random_value(rng) for n in rng.sample(arg_names, rng.randint(0, 3))}
        out = env.call_tool(task, rng.choice(tools), arguments if rng.random() < 0.9 else _random_value(rng))
        assert isinstance(out, dict)
        assert "internal error" not in out.get("error", ""), out
        format_result(out)  # always serialisable
        assert parse(format_call("x", {"a": _random_value(rng)}) if rng.random() < 0.5 else _random_value(rng)).kind
