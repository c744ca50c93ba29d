"""stages/rows/alignment.py (issue #46): the student's response ids against the teacher's ids of the same
text, cut into the shortest spans whose byte boundaries both sides share. A span marked exact holds the
same bytes on both sides (up to the one leading space a sentencepiece teacher prepends to a text, which
its decoder strips); invalid UTF-8, unmapped special tokens and text the teacher rewrites lie in spans
marked not exact; every student byte lands in exactly one span."""
from __future__ import annotations

import json
import random

import pyarrow as pa
import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from cross_tokenizers import bpe_tokenizer_dir, metaspace_tokenizer_dir, smollm2_tokenizer
from stages.errors import UserError
from stages.rows import alignment
from stages.rows.alignment import align_row, special_map, token_bytes

METASPACE = ("llama", "metaspace", "gemma")
PREPENDS = {"llama", "metaspace"}  # teachers that prepend a space to an encoded text


@pytest.fixture(scope="module")
def toks(tmp_path_factory) -> dict:
    """name -> tokenizer: the trained byte-level BPE, the three Metaspace styles and SmolLM2."""
    d = tmp_path_factory.mktemp("toks")
    out = {"bpe": AutoTokenizer.from_pretrained(bpe_tokenizer_dir(d / "bpe"))}
    out.update({s: AutoTokenizer.from_pretrained(metaspace_tokenizer_dir(d / s, s)) for s in METASPACE})
    try:
        out["sm"] = smollm2_tokenizer()
    except UserError as e:
        pytest.skip(f"the SmolLM2 tokenizer is unavailable here: {e}")
    return out


@pytest.fixture(scope="module")
def tb(toks) -> dict:
    return {k: token_bytes(t) for k, t in toks.items()}


def enc(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def check(row, s_ids, s_bytes, t_bytes, smap, phantom: bool) -> None:
    """The invariants every alignment keeps (see the module docstring); `phantom`: the teacher may
    prepend one space to a piece of text."""
    n = len(row.span_exact)
    assert len(row.student_span) == len(s_ids) and len(row.teacher_span) == len(row.teacher_ids)
    assert len(row.span_text) == n and set(row.span_exact) <= {0, 1}
    if s_ids:  # consecutive span numbers from 0: every span holds a student token
        assert row.student_span[0] == 0 and row.student_span[-1] == n - 1
        assert all(b - a in (0, 1) for a, b in zip(row.student_span, row.student_span[1:]))
    assert row.teacher_span == sorted(row.teacher_span) and all(0 <= k < n for k in row.teacher_span)
    sb = lambda i: s_bytes[i] if 0 <= i < len(s_bytes) else None  # noqa: E731
    joined = b""
    for k in range(n):
        s_ids_k = [i for i, j in zip(s_ids, row.student_span) if j == k]
        t_ids_k = [i for i, j in zip(row.teacher_ids, row.teacher_span) if j == k]
        if any(sb(i) is None for i in s_ids_k):  # a special token: a span of its own
            assert len(s_ids_k) == 1 and row.span_text[k] == ""
            assert t_ids_k == ([smap[s_ids_k[0]]] if s_ids_k[0] in smap else [])
            assert row.span_exact[k] == int(s_ids_k[0] in smap)
            continue
        s = b"".join(sb(i) for i in s_ids_k)
        joined += s
        assert row.span_text[k] == s.decode("utf-8", "replace")
        if not row.span_exact[k]:
            continue
        assert t_ids_k and None not in [t_bytes[i] for i in t_ids_k]
        t = b"".join(t_bytes[i] for i in t_ids_k)
        skip = int(phantom and t == b" " + s)
        assert t[skip:] == s
        # minimal: no byte offset inside the span is a token boundary on both sides
        s_cuts, t_cuts, pos = set(), set(), 0
        for i in s_ids_k[:-1]:
            pos += len(sb(i))
            s_cuts.add(pos)
        pos = -skip
        for i in t_ids_k[:-1]:
            pos += len(t_bytes[i])
            t_cuts.add(pos)
        assert not s_cuts & t_cuts - {0}, (k, s_cuts, t_cuts)
    assert joined == b"".join(sb(i) for i in s_ids if sb(i) is not None)


def valid(b: bytes) -> bool:
    try:
        b.decode()
    except UnicodeDecodeError:
        return False
    return True


def spans(toks, tb, s: str, t: str, ids: list[int]) -> list[tuple]:
    """Align `ids` of student `s` against teacher `t`, check the invariants, and return per span
    (student pieces, teacher pieces, exact); a piece is a token's bytes, or a special token's name."""
    smap = special_map(toks[s], toks[t])
    row = align_row(ids, tb[s], toks[t], tb[t], smap)
    check(row, ids, tb[s], tb[t], smap, t in PREPENDS)
    name = lambda k, i: tb[k][i] if tb[k][i] is not None else toks[k].convert_ids_to_tokens(i)  # noqa: E731
    return [([name(s, i) for i, j in zip(ids, row.student_span) if j == k],
             [name(t, i) for i, j in zip(row.teacher_ids, row.teacher_span) if j == k], row.span_exact[k])
            for k in range(len(row.span_exact))]


def test_token_bytes_of_both_decoder_families(toks, tb):
    sm, ll = tb["sm"], tb["llama"]
    assert len(sm) == len(toks["sm"]) == 49152 and sm[:17] == [None] * 17  # the 17 special tokens
    ids = enc(toks["sm"], " world, café 🙂")
    assert [sm[i] for i in ids] == [b" world", b",", b" caf\xc3\xa9", b" \xf0\x9f\x99\x82"]
    assert ll[:3] == [None] * 3 and ll[3:6] == [b"\x00", b"\x01", b"\x02"] and ll[3 + 0xF0] == b"\xf0"
    assert [ll[i] for i in toks["llama"].convert_tokens_to_ids(["▁café", "▁w", "\n"])] == [b" caf\xc3\xa9", b" w", b"\n"]
    # what the decoders print: byte-level as is; sentencepiece without the one leading space it strips
    rng = random.Random(0)
    for k in ("sm", "bpe", *METASPACE):
        normal = [i for i, b in enumerate(tb[k]) if b is not None]
        for _ in range(50):
            ids = rng.sample(normal, 6)
            got = b"".join(tb[k][i] for i in ids)
            text = toks[k].decode(ids)
            try:
                got = got.decode()
            except UnicodeDecodeError:
                continue
            assert text == (got[1:] if k in PREPENDS and got.startswith(" ") else got), (k, ids)


def test_non_special_added_tokens_are_their_content_and_other_decoders_are_refused(tmp_path, toks):
    tok = AutoTokenizer.from_pretrained(bpe_tokenizer_dir(tmp_path / "bpe"))
    tok.add_tokens(["<think>"])  # special=False: text the model reads, decoded as its content
    (think,) = tok.convert_tokens_to_ids(["<think>"])
    assert token_bytes(tok)[think] == b"<think>" and len(token_bytes(tok)) == len(tok)
    spec = json.loads(toks["bpe"].backend_tokenizer.to_str())
    spec["decoder"] = {"type": "WordPiece", "prefix": "##", "cleanup": True}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec))).save_pretrained(tmp_path / "wp")
    with pytest.raises(UserError, match=r"tokenizer .*wp: decoder WordPiece is not supported .*byte-level BPE"):
        token_bytes(AutoTokenizer.from_pretrained(tmp_path / "wp"))


def test_special_map(toks):
    # same spelling: the ChatML specials; eos to eos whatever its spelling; nothing else
    assert special_map(toks["sm"], toks["bpe"]) == {0: 0, 1: 1, 2: 2}
    assert special_map(toks["bpe"], toks["llama"]) == {2: 2}  # <|im_end|> -> </s>
    assert special_map(toks["llama"], toks["sm"]) == {2: 2}  # </s> -> <|im_end|>; <unk>, <s>: none
    assert special_map(toks["llama"], toks["gemma"]) == {0: 0, 1: 1, 2: 2}


def test_multibyte_characters(toks, tb):
    ids = enc(toks["sm"], "café 日本語")
    # byte-level teacher: the alignment is on bytes, so spans may end inside a character on both sides
    assert spans(toks, tb, "sm", "bpe", ids) == [
        ([b"c"], [b"c"], 1), ([b"af", b"\xc3\xa9"], [b"a", b"f\xc3\xa9"], 1),
        ([b" \xe6", b"\x97", b"\xa5", b"\xe6\x9c\xac", b"\xe8"], [b" ", b"\xe6\x97\xa5\xe6\x9c\xac\xe8"], 1),
        ([b"\xaa", b"\x9e"], [b"\xaa\x9e"], 1)]
    # sentencepiece teacher: "語" is not in its vocabulary, so it takes three <0xNN> byte tokens; the
    # first span's teacher token carries the space the teacher prepends
    assert spans(toks, tb, "sm", "llama", ids) == [
        ([b"c", b"af", b"\xc3\xa9"], [b" caf\xc3\xa9"], 1),
        ([b" \xe6", b"\x97", b"\xa5", b"\xe6\x9c\xac"], [b" ", b"\xe6\x97\xa5\xe6\x9c\xac"], 1),
        ([b"\xe8"], [b"\xe8"], 1), ([b"\xaa"], [b"\xaa"], 1), ([b"\x9e"], [b"\x9e"], 1)]
    row = align_row(ids, tb["sm"], toks["llama"], tb["llama"], {})
    assert row.span_text == ["caf\u00e9", " 日本", "\ufffd", "\ufffd", "\ufffd"]
    assert row.teacher_ids == enc(toks["llama"], "café 日本語")


def test_an_emoji_split_over_byte_level_tokens(toks, tb):
    ids = enc(toks["sm"], "🙂 ok")
    assert [tb["sm"][i] for i in ids] == [b"\xf0\x9f", b"\x99\x82", b" ok"]
    assert spans(toks, tb, "sm", "bpe", ids) == [
        ([b"\xf0\x9f", b"\x99\x82"], [b"\xf0\x9f\x99\x82"], 1), ([b" ok"], [b" o", b"k"], 1)]
    # a lone prepended "▁" joins its piece's first span
    assert spans(toks, tb, "sm", "llama", ids) == [
        ([b"\xf0\x9f"], [b" ", b"\xf0", b"\x9f"], 1), ([b"\x99\x82"], [b"\x99", b"\x82"], 1),
        ([b" ok"], [b" o", b"k"], 1)]
    assert spans(toks, tb, "sm", "gemma", ids) == [
        ([b"\xf0\x9f"], [b"\xf0", b"\x9f"], 1), ([b"\x99\x82"], [b"\x99", b"\x82"], 1), ([b" ok"], [b" o", b"k"], 1)]


def test_whitespace(toks, tb):
    sm = toks["sm"]
    assert spans(toks, tb, "sm", "bpe", enc(sm, "a  b")) == [([b"a"], [b"a"], 1), ([b" "], [b" "], 1),
                                                             ([b" b"], [b" b"], 1)]
    assert spans(toks, tb, "sm", "llama", enc(sm, "a  b")) == [([b"a"], [b" a"], 1), ([b" "], [b" "], 1),
                                                               ([b" b"], [b" b"], 1)]
    # "\n\n" is one SmolLM2 token, two teacher tokens
    assert spans(toks, tb, "sm", "bpe", enc(sm, "x\n\n")) == [([b"x"], [b"x"], 1), ([b"\n\n"], [b"\n", b"\n"], 1)]
    # a leading space: the legacy sentencepiece teacher adds its own "▁" before it, the Metaspace
    # pre-tokenizer (prepend_scheme="first") does not, and Gemma never does
    lead = [b" le", b"a", b"d", b"i", b"n", b"g"]
    assert spans(toks, tb, "sm", "llama", enc(sm, " leading")) == [([b" leading"], [b" "] + lead, 1)]
    assert spans(toks, tb, "sm", "metaspace", enc(sm, " leading")) == [([b" leading"], lead, 1)]
    assert spans(toks, tb, "sm", "gemma", enc(sm, " leading")) == [([b" leading"], lead, 1)]


def test_special_tokens_inside_and_at_the_end(toks, tb):
    bpe = toks["bpe"]
    ids = enc(bpe, "x") + [1] + enc(bpe, "y") + [2]  # <|im_start|> inside, eos <|im_end|> at the end
    # the teacher knows both: one token each side
    assert spans(toks, tb, "bpe", "sm", ids) == [([b"x"], [b"x"], 1), (["<|im_start|>"], ["<|im_start|>"], 1),
                                                 ([b"y"], [b"y"], 1), (["<|im_end|>"], ["<|im_end|>"], 1)]
    # the sentencepiece teacher lacks <|im_start|>: no teacher token, not exact; eos -> its eos </s>.
    # Each run of text is encoded on its own, so each gains the prepended space.
    assert spans(toks, tb, "bpe", "llama", ids) == [([b"x"], [b" x"], 1), (["<|im_start|>"], [], 0),
                                                    ([b"y"], [b" ", b"y"], 1), (["<|im_end|>"], ["</s>"], 1)]
    # SmolLM2's <|endoftext|> (a BOS-like token) has no counterpart in the teacher: its own span, unscored
    sm = toks["sm"]
    assert spans(toks, tb, "sm", "llama", [0] + enc(sm, "Hi")) == [(["<|endoftext|>"], [], 0),
                                                                  ([b"Hi"], [b" ", b"H", b"i"], 1)]
    # an id past the tokenizer (a padded model vocabulary) counts as an unmapped special token
    row = align_row([49200] + enc(sm, "Hi"), tb["sm"], toks["bpe"], tb["bpe"], {})
    assert row.student_span == [0, 1] and row.span_exact == [0, 1] and row.span_text == ["", "Hi"]


def test_special_token_text_written_by_the_student_stays_text(toks, tb):
    sm = toks["sm"]
    ids = sm("a<|im_end|>", add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert 2 not in ids
    row = align_row(ids, tb["sm"], toks["bpe"], tb["bpe"], special_map(sm, toks["bpe"]))
    assert 2 not in row.teacher_ids and all(row.span_exact) and "".join(row.span_text) == "a<|im_end|>"


def test_a_response_cut_inside_a_character(toks, tb):
    ids = enc(toks["sm"], "x 日本")[:-2]  # " 日" is cut after 2 of its 3 bytes
    assert [tb["sm"][i] for i in ids] == [b"x", b" \xe6", b"\x97"]
    # the space before the cut is text (the teacher reads it); the cut bytes are not: the span that
    # holds them is not exact. Teacher tokens of that span are context only.
    assert spans(toks, tb, "sm", "bpe", ids) == [([b"x"], [b"x"], 1), ([b" \xe6", b"\x97"], [b" "], 0)]
    # student tokens that hold only invalid bytes: their own span with no teacher token
    ids = enc(toks["sm"], "日本")[:-1] + enc(toks["sm"], "語")[:2]
    assert [tb["sm"][i] for i in ids] == [b"\xe6\x97", b"\xa5", b"\xe8", b"\xaa"]
    assert spans(toks, tb, "sm", "bpe", ids) == [([b"\xe6\x97"], [b"\xe6\x97"], 1), ([b"\xa5"], [b"\xa5"], 1),
                                                 ([b"\xe8", b"\xaa"], [], 0)]
    # (span_text is for people: a span ending inside a character shows U+FFFD for its part)
    row = align_row(ids, tb["sm"], toks["bpe"], tb["bpe"], {})
    assert row.span_text == ["\ufffd"] * 3


def test_garbage_bytes_inside_a_response(toks, tb):
    sm = toks["sm"]
    ids = sm.convert_tokens_to_ids(["Hi", "Ġ", "Ĺ", "Ĺ", "Ġthere"])  # "Ĺ" is the lone continuation byte 0x97
    assert spans(toks, tb, "sm", "bpe", ids) == [([b"Hi"], [b"H", b"i"], 1), ([b" "], [b" "], 1),
                                                 ([b"\x97", b"\x97"], [], 0), ([b" there"], [b" there"], 1)]
    # each text piece is encoded on its own: the sentencepiece teacher prepends a space to both
    assert spans(toks, tb, "sm", "llama", ids) == [([b"Hi"], [b" ", b"H", b"i"], 1), ([b" "], [b" "], 1),
                                                   ([b"\x97", b"\x97"], [], 0), ([b" there"], [b" ", b" there"], 1)]


def test_text_the_teacher_rewrites_is_one_unscored_span(toks, tb):
    """A normalizing teacher (here: lowercasing) does not reproduce the bytes: the run is one span,
    not exact, rather than a wrong alignment."""
    spec = json.loads(toks["bpe"].backend_tokenizer.to_str())
    spec["normalizer"] = {"type": "Lowercase"}
    low = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token="<|im_end|>")
    ids = enc(toks["sm"], "Hello World") + [2]
    row = align_row(ids, tb["sm"], low, token_bytes(low), special_map(toks["sm"], low))
    assert row.student_span == [0, 0, 1] and row.span_exact == [0, 1] and row.span_text == ["Hello World", ""]
    assert row.teacher_ids == enc(low, "Hello World") + [2] and row.teacher_span == [0] * (len(row.teacher_ids) - 1) + [1]
    # a literal "▁" is text to a byte-level student, a space to a sentencepiece teacher: not exact either
    assert spans(toks, tb, "sm", "gemma", enc(toks["sm"], "a▁b")) == [
        ([b"a", b"\xe2\x96", b"\x81", b"b"], [b"a", b" b"], 0)]


def test_student_and_teacher_with_the_same_tokenizer(toks, tb):
    for k in ("sm", "bpe", "metaspace", "gemma"):
        ids = enc(toks[k], "Hello world, café 日本語 🙂!\n\n  x") + [toks[k].eos_token_id]
        row = align_row(ids, tb[k], toks[k], tb[k], special_map(toks[k], toks[k]))
        check(row, ids, tb[k], tb[k], special_map(toks[k], toks[k]), k in PREPENDS)
        assert row.teacher_ids == ids, k
        assert row.student_span == row.teacher_span == list(range(len(ids))) and all(row.span_exact), k
    # the legacy sentencepiece tokenizer prepends a space to every text, its own response included
    ids = enc(toks["llama"], "Hello world")
    row = align_row(ids, tb["llama"], toks["llama"], tb["llama"], {})
    assert row.teacher_ids == toks["llama"].convert_tokens_to_ids(["▁"]) + ids
    assert row.teacher_span == [0] + list(range(len(ids))) and all(row.span_exact)


def test_random_responses_keep_the_invariants(toks, tb):
    """~200 random strings (fixed seed) from three students to five teachers; some gain special tokens,
    some are cut after any token (possibly inside a character), some are random ids (garbage bytes)."""
    rng = random.Random(46)
    pool = list("abcdefghij XYZ0123456789.,;!?-()'\"") + ["  ", "\n", "\n\n", "\t", "é", "ü", "ß", "日本", "語",
                                                             "🙂", "🦀", " the", "ing", "café"]
    smaps = {(s, t): special_map(toks[s], toks[t]) for s in ("sm", "bpe", "llama") for t in toks}
    for n in range(200):
        text = "".join(rng.choice(pool) for _ in range(rng.randrange(0, 30)))
        for s in ("sm", "bpe", "llama"):
            ids = enc(toks[s], text)
            whole = True
            if n % 4 == 1:  # special tokens between characters
                for _ in range(rng.randrange(1, 3)):
                    ok = [p for p in range(len(ids) + 1) if valid(b"".join(tb[s][i] or b"" for i in ids[:p]))]
                    ids.insert(rng.choice(ok), rng.choice(toks[s].all_special_ids))
            elif n % 4 == 2:  # cut after any token
                ids, whole = ids[:rng.randrange(len(ids) + 1)], False
            elif n % 4 == 3 and n % 8 == 3:  # garbage
                ids, whole = [rng.randrange(len(toks[s])) for _ in range(rng.randrange(1, 12))], False
            for t in toks:
                row = align_row(ids, tb[s], toks[t], tb[t], smaps[s, t])
                check(row, ids, tb[s], tb[t], smaps[s, t], t in PREPENDS)
                if whole:  # valid text and no normalizer: every span of text is exact
                    text_spans = {j for i, j in zip(ids, row.student_span) if tb[s][i] is not None}
                    assert all(row.span_exact[k] for k in text_spans), (text, s, t, row)


def test_table(toks, tb):
    rows = [align_row(enc(toks["sm"], t) + [2], tb["sm"], toks["bpe"], tb["bpe"], {2: 2}) for t in ("Hi", "")]
    tab = alignment.table(["u0", "u1"], rows, [[1, 5], []])
    assert tab.schema == alignment.SCHEMA and tab.column_names == [
        "uid", "teacher_prompt_ids", "teacher_response_ids", "student_span", "teacher_span", "span_exact", "span_text"]
    assert tab.schema.field("span_exact").type == pa.list_(pa.int8())
    assert tab.to_pylist() == [
        {"uid": "u0", "teacher_prompt_ids": [1, 5], "teacher_response_ids": rows[0].teacher_ids, "student_span": [0, 1],
         "teacher_span": rows[0].teacher_span, "span_exact": [1, 1], "span_text": ["Hi", ""]},
        {"uid": "u1", "teacher_prompt_ids": [], "teacher_response_ids": [2], "student_span": [0],
         "teacher_span": [0], "span_exact": [1], "span_text": [""]}]
    with pytest.raises(ValueError):
        alignment.table(["u0"], rows, [[1]])
