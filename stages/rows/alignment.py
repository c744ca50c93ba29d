"""Cross-tokenizer alignment (issue #46): the student's response ids against the teacher's ids for the
same text, cut into spans whose byte boundaries both tokenizations share.

The alignment is on bytes, not characters: each token contributes exact bytes to the decoded text
(`token_bytes`), the teacher re-tokenizes the student's text, and a span ends wherever the cumulative
byte ends of both sides meet. Summing log-probs over a span on each side then scores the same bytes
(the span is `exact`), whatever the two vocabularies are. Bytes the teacher cannot read as text
(invalid UTF-8) or cannot reproduce (a normalizing tokenizer) fall in spans marked not exact, which
later code leaves unscored; every student byte still lands in exactly one span.
"""
from __future__ import annotations

import json
import re
from bisect import bisect_left
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from ..errors import UserError

SUPPORTED = "byte-level BPE (ByteLevel decoder) or sentencepiece-style Metaspace/Replace('▁') with byte fallback"


def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the printable bytes stand for themselves, the other 68
    (controls, space, DEL, NBSP, soft hyphen...) for U+0100 onwards, in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    out, shifted = {}, 0
    for b in range(256):
        if b in printable:
            out[chr(b)] = b
        else:
            out[chr(0x100 + shifted)] = b
            shifted += 1
    return out


BYTE_DECODER = _byte_decoder()
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level(s: str) -> bytes:
    try:
        return bytes(BYTE_DECODER[c] for c in s)
    except KeyError:  # a character outside the table passes through as UTF-8, as the ByteLevel decoder does
        return b"".join(bytes([BYTE_DECODER[c]]) if c in BYTE_DECODER else c.encode() for c in s)


def _flat(node: dict | None) -> list[dict]:
    """A decoder and the members of a Sequence decoder, as one list."""
    if not node:
        return []
    if node.get("type") == "Sequence":
        return [d for sub in node.get("decoders", []) for d in _flat(sub)]
    return [node]


def _piece_decoder(tok):
    """(token string) -> bytes, for the decoder family of `tok`'s backend; UserError for any other."""
    decs = _flat(json.loads(tok.backend_tokenizer.to_str()).get("decoder"))
    types = [d["type"] for d in decs]
    if types == ["ByteLevel"]:
        return _byte_level
    marks = [d["replacement"] for d in decs if d["type"] == "Metaspace"]
    marks += [d["pattern"].get("String") for d in decs if d["type"] == "Replace" and d.get("content") == " "]
    if marks and set(types) <= {"Metaspace", "Replace", "ByteFallback", "Fuse", "Strip"} and None not in marks:
        mark, fallback = marks[0], "ByteFallback" in types

        def piece(s: str) -> bytes:
            m = BYTE_PIECE.fullmatch(s) if fallback else None
            return bytes([int(m.group(1), 16)]) if m else s.replace(mark, " ").encode()

        return piece
    name = getattr(tok, "name_or_path", "") or type(tok).__name__
    raise UserError(f"tokenizer {name}: decoder {'+'.join(types) or 'none'} is not supported for "
                    f"cross-tokenizer alignment; expected {SUPPORTED}")


def token_bytes(tok) -> list[bytes | None]:
    """For each id of fast tokenizer `tok` (len(tok) ids, added tokens included), the bytes it puts in
    decoded text mid-sequence; None for special tokens, ids the vocabulary skips and unreadable pieces.

    Metaspace family: "▁" is a space, "<0xNN>" (with a ByteFallback decoder) is byte NN. Its decoder also
    strips one leading space of the whole text (Strip, or Metaspace prepend_scheme), the space that
    encoding prepends (a Prepend normalizer, or add_prefix_space / prepend_scheme on the pre-tokenizer).
    That strip is left out here: a token's bytes are the same wherever it stands, and the prepended
    space is dealt with where it arises, when the teacher encodes a text (`align_row`)."""
    piece = _piece_decoder(tok)
    backend = tok.backend_tokenizer
    vocab = backend.get_vocab(with_added_tokens=True)  # token string -> id
    added = tok.added_tokens_decoder  # id -> AddedToken
    special = set(tok.all_special_ids) | {i for i, a in added.items() if a.special}
    out: list[bytes | None] = [None] * max(len(tok), 1 + max(vocab.values(), default=-1))
    for s, i in vocab.items():
        if i in special:
            continue
        # a non-special added token is matched in the raw text and decoded as its content
        out[i] = added[i].content.encode() if i in added else piece(s)
    return out


def special_map(s_tok, t_tok) -> dict[int, int]:
    """Student special id -> teacher id, for the special tokens the teacher reads as the same thing: eos
    to eos, and a student special token spelled like one of the teacher's added or special tokens. A
    teacher token of the same spelling in the plain vocabulary is text, not a control token: no match."""
    t_added = {a.content: i for i, a in t_tok.added_tokens_decoder.items()}
    t_added.update({t_tok.convert_ids_to_tokens(i): i for i in t_tok.all_special_ids})
    s_special = set(s_tok.all_special_ids) | {i for i, a in s_tok.added_tokens_decoder.items() if a.special}
    out = {i: t_added[c] for i in sorted(s_special) if (c := s_tok.convert_ids_to_tokens(i)) in t_added}
    if s_tok.eos_token_id is not None and t_tok.eos_token_id is not None:
        out[s_tok.eos_token_id] = t_tok.eos_token_id
    return out


def vocab_map(t_bytes: list[bytes | None], s_bytes: list[bytes | None]):
    """[len(t_bytes)] int32: each teacher id's student id of the very same bytes, -1 where the student
    has no single token spelling it (or for a special token): how the teacher's top-k candidates at
    a one-token span become student ids (exact matching, as TRL's GOLD does)."""
    by = {}
    for i, b in enumerate(s_bytes):
        if b is not None and b not in by:
            by[b] = i
    return np.array([by.get(b, -1) if b is not None else -1 for b in t_bytes], dtype=np.int32)


@dataclass(frozen=True)
class Row:
    """One response aligned. Spans are numbered from 0 in text order; each holds >= 1 student token.
    Exact: the span's teacher bytes equal its student bytes, but for the one space a teacher may prepend
    to each text it encodes (which its decoder strips: see _align_run); such a space belongs to the
    first span of that text."""
    teacher_ids: list[int]   # [T] the teacher's response ids
    student_span: list[int]  # [S] span of each student token (non-decreasing, from 0)
    teacher_span: list[int]  # [T] span of each teacher token (non-decreasing)
    span_exact: list[int]    # [n_spans] 1: both sides hold the same bytes and the teacher >= 1 token
    span_text: list[str]     # [n_spans] the span's student bytes, decoded with errors="replace"


def _segments(data: bytes) -> list[tuple[int, int, bool]]:
    """(start, end, valid) byte ranges of `data`, alternating valid UTF-8 text and invalid bytes.
    surrogateescape turns each invalid byte into one lone surrogate (UTF-8 text never decodes to
    one), so the split is linear in the length."""
    out, pos = [], 0
    for m in re.finditer(r"[\udc80-\udcff]+|[^\udc80-\udcff]+", data.decode("utf-8", "surrogateescape")):
        bad = "\udc80" <= m.group()[0] <= "\udcff"
        n = len(m.group()) if bad else len(m.group().encode())
        out.append((pos, pos + n, not bad))
        pos += n
    return out


def _encode(t_tok, text: str) -> list[int]:
    # split_special_tokens: a student that wrote "<|im_end|>" as text wrote text; the teacher must not
    # read a control token there (it would end the teacher's turn mid-response)
    return t_tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def _align_run(data: bytes, s_ends: list[int], t_tok, t_bytes, out: dict) -> None:
    """Append the spans of one run of normal student tokens: `data` their bytes, `s_ends` [S] their
    cumulative byte ends. Teacher tokens are placed by effective byte end; ranges no exact span may
    hold (invalid bytes, text the teacher does not reproduce) are kept whole by placing only their
    edges among the teacher's boundaries."""
    t_ids, t_ends, t_bounds, bad = [], [], set(), []  # [T], [T], byte offsets, [(start, end)]
    for start, end, valid in _segments(data):
        t_bounds.add(end)
        if not valid:  # not text: the teacher gets nothing to read; the span is left unscored
            bad.append((start, end))
            continue
        want = data[start:end]
        ids = _encode(t_tok, want.decode())
        tb = [t_bytes[i] if i < len(t_bytes) else None for i in ids]
        got = None if None in tb else b"".join(tb)
        if got == want:
            skip = 0
        elif got == b" " + want:
            # The teacher prepended a space (Metaspace Prepend/prepend_scheme, ByteLevel add_prefix_space):
            # its first token carries one byte the text lacks, the byte its own decoder strips. It counts as
            # no student byte, so a span exact here holds bytes equal up to that one leading space.
            skip = 1
        else:
            # Text the teacher changes (NFC, lowercasing, dropped characters...): no boundary inside it can
            # be trusted, so the piece is one block, never exact, rather than a wrong alignment.
            t_ids += ids
            t_ends += [end] * len(ids)
            bad.append((start, end))
            continue
        pos = start - skip
        for i, b in zip(ids, tb):
            pos += len(b)
            t_ids.append(i)
            t_ends.append(max(pos, start + 1))  # (a lone prepended "▁" joins the piece's first span)
            t_bounds.add(pos)
    # spans end where both sides have a boundary; every student token's end is one, so no span is empty
    cuts = sorted(set(s_ends) & t_bounds) or [len(data)]  # [n] span ends (a zero-byte run: one span)
    t_span = [bisect_left(cuts, e) for e in t_ends]  # [T] (the span holding byte e - 1)
    exact = [0] * len(cuts)
    for k in t_span:
        exact[k] = 1
    for _, end in bad:  # a bad range has no cut inside it: it lies in one span
        exact[bisect_left(cuts, end)] = 0
    base = len(out["exact"])
    out["student_span"] += [base + bisect_left(cuts, e) for e in s_ends]
    out["teacher_span"] += [base + k for k in t_span]
    out["teacher_ids"] += t_ids
    out["exact"] += exact
    out["text"] += [data[a:b].decode("utf-8", "replace") for a, b in zip([0] + cuts, cuts)]


def align_row(s_ids: list[int], s_bytes: list[bytes | None], t_tok, t_bytes: list[bytes | None],
              smap: dict[int, int]) -> Row:
    """Align one response (`s_ids`, the student's ids) with the teacher's tokenization of its text.
    `s_bytes`/`t_bytes`: token_bytes of each tokenizer; `smap`: special_map. Runs of normal tokens are
    re-encoded by the teacher (`t_tok`) one run at a time; a special token is a span of its own: one
    teacher token, exact, when `smap` maps it, else no teacher token, not exact. An id outside s_bytes
    (a model vocabulary padded past the tokenizer's) counts as an unmapped special token."""
    out = {"teacher_ids": [], "student_span": [], "teacher_span": [], "exact": [], "text": []}
    i = 0
    while i < len(s_ids):
        b = s_bytes[s_ids[i]] if 0 <= s_ids[i] < len(s_bytes) else None
        if b is None:
            t = smap.get(s_ids[i])
            n = len(out["exact"])
            out["student_span"].append(n)
            out["teacher_ids"] += [] if t is None else [t]
            out["teacher_span"] += [] if t is None else [n]
            out["exact"].append(int(t is not None))
            out["text"].append("")  # a special token has no bytes in the text
            i += 1
            continue
        pieces = []
        while i < len(s_ids) and 0 <= s_ids[i] < len(s_bytes) and s_bytes[s_ids[i]] is not None:
            pieces.append(s_bytes[s_ids[i]])
            i += 1
        ends, pos = [], 0
        for p in pieces:
            pos += len(p)
            ends.append(pos)
        _align_run(b"".join(pieces), ends, t_tok, t_bytes, out)
    return Row(out["teacher_ids"], out["student_span"], out["teacher_span"], out["exact"], out["text"])


# alignment.parquet: one row per response, beside rollout.parquet's (same uid)
SCHEMA = pa.schema([
    ("uid", pa.string()), ("teacher_prompt_ids", pa.list_(pa.int32())), ("teacher_response_ids", pa.list_(pa.int32())),
    # span index of each student response token / each teacher response token (both non-decreasing)
    ("student_span", pa.list_(pa.int32())), ("teacher_span", pa.list_(pa.int32())),
    # per span: 1 where both sides hold the same bytes (scored), 0 where not (left unscored)
    ("span_exact", pa.list_(pa.int8())), ("span_text", pa.list_(pa.string())),
])

NEEDS = {c: SCHEMA.field(c).type for c in SCHEMA.names}  # what score and update read of spans.parquet


def table(uids: list[str], rows: list[Row], teacher_prompt_ids: list[list[int]]) -> pa.Table:
    if not len(uids) == len(rows) == len(teacher_prompt_ids):
        raise ValueError(f"{len(uids)} uids, {len(rows)} rows, {len(teacher_prompt_ids)} teacher prompts")
    cols = [list(uids), [list(p) for p in teacher_prompt_ids], [r.teacher_ids for r in rows],
            [r.student_span for r in rows], [r.teacher_span for r in rows], [r.span_exact for r in rows],
            [r.span_text for r in rows]]
    return pa.Table.from_arrays([pa.array(c, type=f.type) for c, f in zip(cols, SCHEMA)], schema=SCHEMA)
