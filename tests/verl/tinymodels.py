"""Tiny random model folders as transformers 5 writes them, with the SmolLM2 tokenizer files (tests/verl)."""
from __future__ import annotations

import shutil
from pathlib import Path

from support import TOKENIZER_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def tokenizer_source(seeded_store: Path) -> Path:
    if TOKENIZER_DIR:
        return Path(TOKENIZER_DIR)
    return next(p.parent for p in sorted((seeded_store / "model").glob("*/tokenizer.json")))


def write_model(out: Path, model_type: str, tok: Path, seed: int, **kw) -> Path:
    """A tiny random model folder as transformers 5 saves it (fp32), with the SmolLM2 tokenizer files."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = AutoConfig.for_model(model_type, vocab_size=49152, max_position_embeddings=256, tie_word_embeddings=True,
                                initializer_range=0.5, bos_token_id=1, eos_token_id=2, pad_token_id=2, **kw)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(conf, dtype=torch.float32).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tok / name).is_file():
            shutil.copyfile(tok / name, out / name)
    return out
