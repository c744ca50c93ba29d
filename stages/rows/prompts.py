"""Prompts: the shipped deterministic generators -> rows in verl's Parquet schema; chat-templated
prompt ids under the length policy; which prompts form update batch k.

A row: data_source, prompt (chat messages), ability, reward_model {style, ground_truth},
extra_info {split, index}. Train and eval rows are disjoint by construction: every candidate
prompt is assigned to a split by a hash of its text, not by position.
"""
from __future__ import annotations

import functools
import json
import random

import xxhash

from ..run.config import ROOT, DataCfg
from ..errors import UserError

SEEDS = ROOT / "data" / "prompt_seeds.json"


def _candidates(generator: str, seeds: dict, rng: random.Random) -> list[tuple[str, str]]:
    """(text, ground_truth) pairs, deterministic for a given rng state."""
    out = []
    if generator in ("topics", "arith_words"):
        out += [(t.format(topic=topic), "") for topic in seeds["topics"] for t in seeds["templates"]]
    if generator in ("arith", "arith_words"):
        for t in seeds["arith_templates"]:
            for _ in range(40):
                a, b = rng.randint(2, 99), rng.randint(2, 99)
                op = "times" if "times" in t else "minus" if "minus" in t else "plus"
                ans = a * b if op == "times" else a - b if op == "minus" else a + b
                out.append((t.format(a=a, b=b), str(ans)))
    if not out:
        raise UserError(f"key 'data.generator' = {generator!r}; expected one of topics, arith, arith_words")
    return sorted(set(out))


def generate(cfg: DataCfg) -> tuple[list[dict], list[dict]]:
    seeds = json.loads(SEEDS.read_text())
    cands = _candidates(cfg.generator, seeds, random.Random(cfg.seed))
    # split by content hash (stable under any reordering); ~20% of candidates are eval-only
    evals = [c for c in cands if xxhash.xxh64_intdigest(c[0].encode()) % 5 == 0]
    trains = [c for c in cands if xxhash.xxh64_intdigest(c[0].encode()) % 5 != 0]
    rng = random.Random(cfg.seed)
    rng.shuffle(trains)
    rng.shuffle(evals)
    if cfg.num_train > len(trains) or cfg.num_eval > len(evals):
        raise UserError(f"key 'data.num_train'/'data.num_eval' = {cfg.num_train}/{cfg.num_eval}; generator "
                        f"{cfg.generator!r} has {len(trains)} train and {len(evals)} eval prompts")
    return (_rows(trains[:cfg.num_train], "train", cfg.generator), _rows(evals[:cfg.num_eval], "test", cfg.generator))


def _rows(items: list[tuple[str, str]], split: str, generator: str) -> list[dict]:
    return [{
        "data_source": f"opd/{generator}",
        "prompt": [{"role": "user", "content": text}],
        "ability": "arith" if truth else "chat",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": split, "index": i},
    } for i, (text, truth) in enumerate(items)]


# ---- prompt ids and batches ----

def encode_prompt(tok, messages: list[dict]) -> list[int]:
    ids = tok.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages],
                                  add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def truncate_ids(ids: list[int], limit: int, policy: str) -> list[int]:
    """verl's `data.truncation` on the chat-templated prompt ids: left keeps the last `limit` ids, right
    the first, middle the first limit//2 and the last limit - limit//2; error (the default) never cuts."""
    if len(ids) <= limit or policy == "error":
        return ids
    if policy == "left":
        return ids[-limit:]
    if policy == "right":
        return ids[:limit]
    if policy == "middle":
        return ids[:limit // 2] + ids[len(ids) - (limit - limit // 2):]
    raise UserError(f"key 'data.truncation' = {policy!r}; expected one of error, left, right, middle")


def prompt_ids(tok, messages: list[dict], data) -> list[int]:
    """Chat-templated prompt ids under the configured length policy (data: DataCfg)."""
    return truncate_ids(encode_prompt(tok, messages), data.max_prompt_tokens, data.truncation)


def batch_indices(num_prompts: int, batch_size: int, k: int, key: str) -> list[int]:
    """Prompt indices of batch k (1-based): epochs of seeded permutations, concatenated."""
    out, start = [], (k - 1) * batch_size
    for pos in range(start, start + batch_size):
        epoch, i = divmod(pos, num_prompts)
        out.append(_permutation(num_prompts, key, epoch)[i])
    return out


@functools.lru_cache(maxsize=4)
def _permutation(num_prompts: int, key: str, epoch: int) -> tuple[int, ...]:
    """Epoch `epoch`'s order of the prompts. Shuffled once per epoch (and cached), not once per prompt
    drawn: a batch is then a lookup, not a walk over every prompt (725 ms -> 0.03 ms per batch of 64
    from 50,000 prompts: docs/performance.md, "Evidence for the constants in the code")."""
    perm = list(range(num_prompts))
    random.Random(f"{key}:{epoch}").shuffle(perm)
    return tuple(perm)
