"""prepare's tokenizer check (issue #44): a pair whose ids and special tokens agree is accepted, with one
`note:` line naming what else differs (the chat template...); a pair whose ids or special tokens
differ is refused with one line naming them; a refused teacher read from a directory is never copied
into the store."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from support import TINY, TOKENIZER_DIR, opd


@pytest.fixture(scope="module")
def tokenizer_src(seeded_store) -> Path:
    """The SmolLM2 tokenizer files the tiny models use (the embedded tokenizer, or OPD_TEST_TOKENIZER)."""
    if TOKENIZER_DIR:
        return Path(TOKENIZER_DIR)
    (d,) = (p for p in (seeded_store / "tokenizer").iterdir() if not p.name.startswith("."))
    return d


def variant(src: Path, dst: Path, edit) -> Path:
    """A writable copy of a tokenizer (or model) dir, `edit`ed in place."""
    shutil.copytree(src, dst, copy_function=shutil.copy)
    for p in dst.rglob("*"):
        p.chmod(0o644)
    (dst / "manifest.json").unlink(missing_ok=True)
    edit(dst)
    return dst


def other_template(d: Path) -> None:
    tpl = d / "chat_template.jinja"
    if tpl.exists():
        tpl.write_text(tpl.read_text().replace("<|im_start|>", "<|im_start|> ", 1))
    else:
        c = json.loads((d / "tokenizer_config.json").read_text())
        c["chat_template"] = c["chat_template"].replace("<|im_start|>", "<|im_start|> ", 1)
        (d / "tokenizer_config.json").write_text(json.dumps(c))


def swapped_ids(d: Path) -> None:
    """Ids 100 and 101 trade tokens: the same strings, another id -> token mapping."""
    j = json.loads((d / "tokenizer.json").read_text())
    v = j["model"]["vocab"]
    inv = {i: t for t, i in v.items()}
    v[inv[100]], v[inv[101]] = 101, 100
    (d / "tokenizer.json").write_text(json.dumps(j))


def other_eos(d: Path) -> None:
    c = json.loads((d / "tokenizer_config.json").read_text())
    c["eos_token"] = "<|endoftext|>"
    (d / "tokenizer_config.json").write_text(json.dumps(c))


def other_pad(d: Path) -> None:
    """A teacher with another pad token (fine-tuning often sets one): its pad is never used here."""
    c = json.loads((d / "tokenizer_config.json").read_text())
    c["pad_token"] = "<|endoftext|>"
    (d / "tokenizer_config.json").write_text(json.dumps(c))


def longer_context(d: Path) -> None:
    c = json.loads((d / "tokenizer_config.json").read_text())
    c["model_max_length"] = 4096
    (d / "tokenizer_config.json").write_text(json.dumps(c))


def test_differences_are_sorted_into_what_changes_a_score_and_what_does_not(tokenizer_src, tmp_path):
    from transformers import AutoTokenizer

    from stages.prepare import tokenizer_differences

    load = AutoTokenizer.from_pretrained
    base = load(tokenizer_src)
    assert tokenizer_differences(base, load(tokenizer_src)) == (None, [])
    assert tokenizer_differences(base, load(variant(tokenizer_src, tmp_path / "t", other_template))) == \
        (None, ["chat_template"])
    assert tokenizer_differences(base, load(variant(tokenizer_src, tmp_path / "m", longer_context))) == \
        (None, ["model_max_length"])
    pad = load(variant(tokenizer_src, tmp_path / "p", other_pad))
    assert base.pad_token != pad.pad_token  # (the variant does differ there)
    assert tokenizer_differences(base, pad) == (None, ["pad token"])
    bad, _ = tokenizer_differences(base, load(variant(tokenizer_src, tmp_path / "s", swapped_ids)))
    t100, t101 = (base.convert_ids_to_tokens(i) for i in (100, 101))
    assert bad == f"2 id(s) map to different tokens (id 100: student {t100!r}, teacher {t101!r}; " \
                  f"id 101: student {t101!r}, teacher {t100!r})"
    bad, _ = tokenizer_differences(base, load(variant(tokenizer_src, tmp_path / "e", other_eos)))
    assert bad == "eos token differs (student '<|im_end|>', id 2; teacher '<|endoftext|>', id 0)"


def test_another_chat_template_is_accepted_with_one_note(work, tokenizer_src):
    t = variant(tokenizer_src, work / "in" / "tpl", other_template)
    r = opd("stage", "prepare", *TINY, f"teacher.tokenizer={t}", "run=tpl", cwd=work)
    assert r.stderr.splitlines() == ["note: student and teacher tokenizers differ only in chat_template (the "
                                     "student's tokenizer and chat template format every prompt, the teacher's "
                                     "included); ids and special tokens agree"], r.stderr
    assert r.stdout.startswith("prepare: student model/")
    # the prompts are the student's: the same prompt stage as with the student's own tokenizer
    same = opd("stage", "prepare", *TINY, "run=same", cwd=work)
    assert same.stderr == "" and re.findall(r"prompts/\w+", same.stdout) == re.findall(r"prompts/\w+", r.stdout)


@pytest.mark.parametrize("edit,names", [
    (swapped_ids, r"2 id\(s\) map to different tokens \(id 100: student '.+', teacher '.+'; id 101: "),
    (other_eos, r"eos token differs \(student '<\|im_end\|>', id 2; teacher '<\|endoftext\|>', id 0\)"),
], ids=["swapped-ids", "other-eos"])
def test_other_ids_or_special_tokens_are_refused_by_name(work, tokenizer_src, edit, names):
    t = variant(tokenizer_src, work / "in" / edit.__name__, edit)
    r = opd("stage", "prepare", *TINY, f"teacher.tokenizer={t}", "run=bad", cwd=work, check=False)
    errors = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(errors) == 1, r.stderr
    assert errors[0].startswith("error: tokenizer mismatch: student 'arch:tiny-llama' and teacher "
                                "'arch:tiny-llama-teacher' must share one tokenizer: "), errors[0]
    assert re.search(names, errors[0]), errors[0]


def test_a_refused_teacher_directory_is_not_copied_into_the_store(work, tokenizer_src):
    """A teacher given as a Hugging Face model dir: its tokenizer is checked before its weights are
    materialised, so the refused attempt publishes no model."""
    store = work / "artifacts" / "store" / "model"
    teacher = next(d for d in store.iterdir() if d.is_dir() and json.loads(
        (d / "config.json").read_text())["num_hidden_layers"] == 3)  # tiny-llama-teacher
    models = lambda: sorted(p.name for p in store.iterdir() if not p.name.startswith("."))  # noqa: E731
    before = models()
    bad = variant(teacher, work / "in" / "teacher", swapped_ids)
    r = opd("stage", "prepare", *TINY, f"teacher.name={bad}", "teacher.init=pretrained", "run=bad", cwd=work,
            check=False)
    assert r.returncode == 2 and "id 100: student" in r.stderr, r.stderr
    assert models() == before
    ok = variant(teacher, work / "in" / "teacher_tpl", other_template)  # accepted: materialised, noted once
    r = opd("stage", "prepare", *TINY, f"teacher.name={ok}", "teacher.init=pretrained", "run=ok", cwd=work)
    assert r.stderr.startswith("note: student and teacher tokenizers differ only in chat_template"), r.stderr
    assert len(models()) == len(before) + 1
