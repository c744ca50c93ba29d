"""Shipped deterministic prompt generators -> rows in verl's Parquet schema.

A row: data_source, prompt (chat messages), ability, reward_model {style, ground_truth},
extra_info {split, index}. Train and eval rows are disjoint by construction: every candidate
prompt is assigned to a split by a hash of its text, not by position.
"""
from __future__ import annotations

import json
import random

import xxhash

from .config import ROOT, DataCfg
from .errors import UserError

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
