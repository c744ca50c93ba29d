"""Registry, generation determinism, train/test disjointness, oracle traces, verl rows."""
import json

import pyarrow as pa
import pytest

from stages import envs
from stages.errors import UserError
from stages.envs import protocol
from stages.envs.task import identity_digest, part_of

ENV_SPLITS = [(name, split) for name, env in envs.REGISTRY.items() for split in env.SPLITS]


def test_registry_names_and_splits():
    assert sorted(envs.REGISTRY) == ["calculator", "jsonnav", "sqlite"]
    assert envs.calculator.SPLITS == ("easy", "medium", "hard")
    assert "default" in envs.jsonnav.SPLITS and "default" in envs.sqlite.SPLITS
    assert envs.get("sqlite") is envs.sqlite


def test_unknown_env_is_one_line_user_error():
    with pytest.raises(UserError) as e:
        envs.get("foo")
    assert str(e.value) == "key 'env.name' = 'foo'; expected one of calculator, jsonnav, sqlite"


@pytest.mark.parametrize("name", sorted(envs.REGISTRY))
def test_unknown_split_and_part_are_user_errors(name):
    env = envs.get(name)
    with pytest.raises(UserError, match=r"^key 'env.split' = 'nope'; expected one of "):
        env.generate("nope", 3, 0, "train")
    with pytest.raises(UserError, match=r"^key 'env.part'"):
        env.generate(env.SPLITS[0], 3, 0, "validation")
    with pytest.raises(UserError, match=r"^key 'env.n'"):
        env.generate(env.SPLITS[0], -1, 0, "train")


@pytest.mark.parametrize("name,split", ENV_SPLITS)
def test_generation_is_deterministic_and_seed_dependent(name, split):
    env = envs.get(name)
    a = env.generate(split, 12, 7, "train")
    assert a == env.generate(split, 12, 7, "train")
    assert len(a) == 12 and len({t.uid for t in a}) == 12
    assert env.generate(split, 5, 7, "train") == a[:5]  # n only decides where the stream stops
    b = env.generate(split, 12, 8, "train")
    assert [t.uid for t in a] != [t.uid for t in b]
    for t in a:
        assert t.env == name and t.split == split and t.part == "train"
        assert t.uid.startswith(f"{name}/{split}/") and t.question and t.ground_truth and t.oracle_hint
        json.dumps(t.context)  # JSON-serialisable


@pytest.mark.parametrize("name,split", ENV_SPLITS)
def test_train_and_test_are_disjoint_by_construction(name, split):
    env = envs.get(name)
    train = env.generate(split, 80, 0, "train") + env.generate(split, 40, 1, "train")
    test = env.generate(split, 20, 0, "test") + env.generate(split, 20, 1, "test")
    keys = lambda tasks: {identity_digest(t.question, t.context) for t in tasks}  # noqa: E731
    assert not keys(train) & keys(test)
    assert not {t.uid for t in train} & {t.uid for t in test}
    # the partition is a function of the task itself, whatever seed produced it
    assert {part_of(k) for k in keys(train)} == {"train"}
    assert {part_of(k) for k in keys(test)} == {"test"}
    if name == "calculator":  # the question alone determines a calculator task
        assert not {t.question for t in train} & {t.question for t in test}


@pytest.mark.parametrize("name,split", ENV_SPLITS)
@pytest.mark.parametrize("part", ["train", "test"])
def test_every_oracle_trace_replays_to_a_verified_answer(name, split, part):
    env = envs.get(name)
    for task in env.generate(split, 30, 3, part):
        trace = env.oracle_trace(task)
        assert trace[-1]["role"] == "assistant"
        # replay the assistant turns through the parser and call_tool; tool turns must match
        for i, msg in enumerate(trace[:-1]):
            if msg["role"] == "assistant":
                action = protocol.parse(msg["content"])
                assert action.kind == "tool_call", msg
                result = env.call_tool(task, action.name, action.arguments)
                assert "error" not in result, (task.question, result)
                assert trace[i + 1] == {"role": "tool", "content": protocol.format_result(result)}
        final = protocol.parse(trace[-1]["content"])
        assert final.kind == "final" and final.answer == task.ground_truth
        assert env.verify(task, final.answer) and env.verify_lenient(task, final.answer)
        assert not env.verify(task, final.answer + "0")


@pytest.mark.parametrize("name,split", ENV_SPLITS)
def test_verl_rows_schema_and_round_trip(name, split):
    env = envs.get(name)
    tasks = env.generate(split, 4, 0, "test")
    rows = envs.to_verl_rows(name, tasks, "test")
    assert [r["extra_info"]["index"] for r in rows] == [0, 1, 2, 3]
    row = rows[0]
    assert row["data_source"] == f"opd/{name}-{split}"
    assert row["ability"] == "tool_use"
    assert row["reward_model"] == {"style": "rule", "ground_truth": tasks[0].ground_truth}
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert row["prompt"][0]["content"] == env.system_prompt(tasks[0])
    assert row["prompt"][1]["content"] == tasks[0].question
    info = row["extra_info"]
    assert (info["split"], info["uid"], info["env"], info["env_split"]) == ("test", tasks[0].uid, name, split)
    assert isinstance(info["context"], str) and json.loads(info["context"]) == tasks[0].context
    assert info["oracle_hint"] == tasks[0].oracle_hint
    table = pa.Table.from_pylist(rows)  # Arrow-friendly: one consistent type per column
    back = [envs.from_verl_row(r) for r in table.to_pylist()]
    assert back == tasks
    assert env.oracle_trace(back[0]) == env.oracle_trace(tasks[0])


def test_verl_rows_refuse_mixing_parts():
    tasks = envs.calculator.generate("easy", 2, 0, "train")
    with pytest.raises(ValueError, match="not calculator/test"):
        envs.to_verl_rows("calculator", tasks, "test")
    with pytest.raises(UserError, match="key 'split'"):
        envs.to_verl_rows("calculator", tasks, "dev")
    with pytest.raises(UserError, match="key 'env.name'"):
        envs.to_verl_rows("nope", tasks, "train")
