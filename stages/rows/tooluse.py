"""Multi-turn tool use: task rows and episodes on a tool environment (stages/envs/), batched per turn.
The rollout stage (stages/rollout.py `episodes`), SFT traces and the held-out evaluation share them.

A trajectory is one token sequence: the chat-templated system+user prompt (`prompt_ids`), then
the response: assistant turn 1 (sampled, mask 1), the tool message with its `<tool_result>`
(inserted, mask 0, sample log-prob 0), assistant turn 2 (mask 1), ... So score and update see
exactly the context the student sampled each turn from, and the loss never trains on tool output.

Each turn generates for every unfinished trajectory at once with the student's engine; the
environment's text protocol (`envs.protocol.parse`) decides the action. `advance`/`finish` keep
the per-episode accounting of `envs.protocol.run_episode` (tests check they agree); the one
deliberate difference is that the per-turn budget is exact tokens here (the driver there has no
tokenizer and budgets characters).

Tool messages are tokenised with glue text read off the tokenizer's own chat template, so a
rollout, an SFT trace and a chat-templated transcript of the same turns are the same tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from .. import envs
from ..envs import protocol
from ..envs.task import Task
from ..run import identity
from . import prompts, tables
from ..errors import UserError

# The block a privileged_context teacher reads in its system message; the student never sees it.
ORACLE_BLOCK = "\n\nPrivileged solution notes (for you only; the user does not see them):\n{hint}"


# ---- task rows (prepare) ----

def prepare_tasks(sess, tokenizer_fp: str) -> dict:
    """Publish the environment's train and test task rows (verl schema) as two store stages.

    Two digests, so changing the number of held-out tasks never invalidates a training rollout."""
    e = sess.cfg.env
    env = envs.get(e.name)
    out = {}
    for part, n in (("train", e.num_train), ("test", e.num_test)):
        dig = identity.tasks(sess.cfg, part, tokenizer_fp)

        def produce(tmp: Path, part=part, n=n, dig=dig) -> None:
            rows = envs.to_verl_rows(e.name, env.generate(e.split, n, e.seed, part), part)
            tables.write(tmp / "tasks.parquet", pa.Table.from_pylist(rows, tables.TASKS),
                         {"digest": dig, "tokenizer": tokenizer_fp, "env": e.name})

        sess.store.ensure("tasks", dig, produce)
        out[f"tasks_{part}"] = dig
    return out


def load_tasks(sess, part: str) -> list[Task]:
    t = tables.read(sess.store.path("tasks", sess.prepared[f"tasks_{part}"]) / "tasks.parquet")
    return [envs.from_verl_row(r) for r in t.to_pylist()]


def initial_ids(tok, env, task: Task) -> list[int]:
    return prompts.encode_prompt(tok, protocol.initial_messages(env, task))


def teacher_ids(tok, env, task: Task) -> list[int]:
    """The privileged_context teacher's prompt: the student's, with the oracle block in the system message."""
    msgs = protocol.initial_messages(env, task)
    msgs[0] = {**msgs[0], "content": msgs[0]["content"] + ORACLE_BLOCK.format(hint=task.oracle_hint)}
    return prompts.encode_prompt(tok, msgs)


def with_teacher_prompts(sess, ro: pa.Table) -> pa.Table:
    """rollout rows with prompt_ids swapped for the privileged teacher prompt; responses untouched,
    so the teacher scores exactly the student's tokens (packing aligns by response length)."""
    tok, env = sess.models.tokenizer(), envs.get(sess.cfg.env.name)
    by_uid = {t.uid: t for t in load_tasks(sess, "train")}
    ids = [teacher_ids(tok, env, by_uid[u]) for u in ro.column("task_uid").to_pylist()]
    i = ro.column_names.index("prompt_ids")
    return ro.set_column(i, "prompt_ids", pa.array(ids, pa.list_(pa.int32())))


# ---- tokens of tool messages ----

@dataclass
class Glue:
    eos: int
    open_tool: str  # after an assistant turn's EOS, before the tool message content
    close_tool: str  # after the tool message content, up to the next assistant turn's first token

    def tool_ids(self, tok, content: str) -> list[int]:
        return tok.encode(self.open_tool + content + self.close_tool, add_special_tokens=False)


def glue(tok) -> Glue:
    a, t = "\x00ASSISTANT\x00", "\x00TOOL\x00"
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
            {"role": "assistant", "content": a}, {"role": protocol.TOOL_ROLE, "content": t}]
    try:
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # noqa: BLE001 - templates raise anything; say which tokenizer is unusable
        raise UserError(f"tokenizer chat template cannot render a '{protocol.TOOL_ROLE}' message ({e})") from None
    if a not in text or t not in text:
        raise UserError(f"tokenizer chat template drops '{protocol.TOOL_ROLE}' messages; tool use needs them")
    between, after = text[text.index(a) + len(a):text.index(t)], text[text.index(t) + len(t):]
    # ChatML closes an assistant turn with the EOS token itself: the model samples it, the glue starts after it
    eos_text = tok.eos_token or ""
    if eos_text and between.startswith(eos_text):
        between = between[len(eos_text):]
    return Glue(tok.eos_token_id, between, after)


def trace_ids(tok, g: Glue, turns: list[dict]) -> tuple[list[int], list[int]]:
    """Response ids and mask of a transcript's assistant/tool turns (the SFT view of an oracle trace)."""
    ids, mask = [], []
    for m in turns:
        if m["role"] == "assistant":
            t = tok.encode(m["content"], add_special_tokens=False) + [g.eos]  # the model learns to stop
            ids += t
            mask += [1] * len(t)
        else:
            t = g.tool_ids(tok, m["content"])
            ids += t
            mask += [0] * len(t)
    return ids, mask


# ---- episode accounting (mirrors envs.protocol.run_episode) ----

@dataclass
class Traj:
    task: Task
    prompt: list[int]
    ep: protocol.Episode
    resp: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    attempted_calls: int = 0  # executed calls + malformed ones that started a tool_call
    last_text: str = ""
    done: bool = False


def advance(env, task: Task, t: Traj, text: str, truncated: bool) -> str | None:
    """Account one assistant turn; return the tool message content, or None on a final answer."""
    ep = t.ep
    ep.turns += 1
    ep.truncated_turns += int(truncated)
    t.last_text = text
    ep.messages.append({"role": "assistant", "content": text})
    action = protocol.parse(text)
    if action.kind == "final":
        ep.answer, ep.finish_reason, t.done = action.answer, "final", True
        return None
    if action.kind == "invalid":
        ep.parse_errors += 1
        ep.invalid_calls += int(action.attempted_call)
        t.attempted_calls += int(action.attempted_call)
        result = {"error": action.error}
    else:
        result = env.call_tool(task, action.name, action.arguments)
        ep.tool_calls += 1
        t.attempted_calls += 1
        ep.invalid_calls += int(isinstance(result, dict) and "error" in result)
    content = protocol.format_result(result)
    ep.messages.append({"role": protocol.TOOL_ROLE, "content": content})
    return content


def finish(env, task: Task, t: Traj) -> None:
    ep = t.ep
    if not t.done:
        ep.finish_reason, t.done = "max_turns", True
    if ep.answer is not None:
        ep.success = bool(env.verify(task, ep.answer))
    ep.success_lenient = bool(env.verify_lenient(task, ep.answer if ep.answer is not None else t.last_text))


def run_episodes(sess, env, tasks: list[Task], max_turns: int, max_tokens: int, seed: int,
                 greedy: bool = False) -> list[Traj]:
    """One episode per task, all advanced together: one batched generate per turn (sess: a Session
    whose student holds the policy to sample)."""
    tok = sess.models.tokenizer()
    g = glue(tok)
    trajs = [Traj(task, initial_ids(tok, env, task), protocol.Episode(messages=protocol.initial_messages(env, task)))
             for task in tasks]
    for turn in range(max_turns):
        live = [t for t in trajs if not t.done]
        if not live:
            break
        out = sess.models.generate([t.prompt + t.resp for t in live], max_tokens, seed + turn, greedy=greedy)
        for b, t in enumerate(live):
            n, stopped = int(out.lengths[b]), bool(out.finished[b])
            ids = out.tokens[b, :n].tolist()
            t.resp += ids
            t.mask += [1] * n
            t.logprobs += out.logprobs[b, :n].tolist()
            reply = advance(env, t.task, t, tok.decode(ids[:-1] if stopped else ids), truncated=not stopped)
            if reply is not None and turn + 1 < max_turns:  # a result after the last turn trains nothing
                tool = ([] if stopped else [g.eos]) + g.tool_ids(tok, reply)  # close a cut turn first
                t.resp += tool
                t.mask += [0] * len(tool)
                t.logprobs += [0.0] * len(tool)
    for t in trajs:
        finish(env, t.task, t)
    return trajs


def task_columns(t: Traj) -> dict:
    ep = t.ep
    return {"task_uid": t.task.uid, "answer": ep.answer, "success": ep.success,
            "success_lenient": ep.success_lenient, "turns": ep.turns, "tool_calls": ep.tool_calls,
            "attempted_calls": t.attempted_calls, "invalid_calls": ep.invalid_calls,
            "parse_errors": ep.parse_errors, "reward": float(ep.success)}
