"""`opd inspect`'s token pieces: decoded without importing transformers, and the same text as
transformers' decode of the real SmolLM2 tokenizer."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

from stages.rows import trajectories


def _tokenizer_dir(seeded_store):
    return next(p.parent for p in sorted(seeded_store.glob("model/*/tokenizer.json")))


def test_decode_is_transformers_decode_without_transformers(seeded_store):
    from transformers import AutoTokenizer

    d = _tokenizer_dir(seeded_store)
    tok = AutoTokenizer.from_pretrained(d)
    ids = (tok("Hello, wörld 🙂\n\n  <|im_start|>user x = 3.5 ;")["input_ids"] + list(range(0, len(tok), 61))
           + tok.all_special_ids)
    decode = trajectories._load_decode(str(d))
    assert [decode([i]) for i in ids] == [tok.decode([i]) for i in ids]  # one piece per token, specials kept
    assert decode(ids) == tok.decode(ids)
    code = ("import sys; from stages.rows import trajectories; "
            f"print(repr(trajectories._load_decode({str(d)!r})([19556, 28, 905]))); print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == [repr(tok.decode([19556, 28, 905])), "False"]


def test_a_tokenizer_that_cleans_up_spaces_decodes_with_transformers(seeded_store, tmp_path):
    from transformers import PreTrainedTokenizerBase

    d = tmp_path / "tok"
    shutil.copytree(_tokenizer_dir(seeded_store), d)
    conf = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**conf, "clean_up_tokenization_spaces": True}))
    decode = trajectories._load_decode(str(d))
    assert isinstance(decode.__self__, PreTrainedTokenizerBase)  # transformers' own, which cleans up
