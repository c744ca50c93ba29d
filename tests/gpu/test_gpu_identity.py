"""On the GPU too, a prompt file is identified by its content, not where it lives: the same Parquet at
another path, read by a project in another directory, publishes the same digests and the same bytes
(before, the path was part of the prompts' identity, so the rows were sampled under another seed
from the first token of step 1); and moving the file and the artifacts dir reuses every stage."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from reliability.harness import entry_differences, published
from support import ROOT, TINY, opd

pytestmark = pytest.mark.gpu

RUN = [*TINY, "runtime.device=cuda", "train.updates=2", "rollout.max_new_tokens=16"]


def fresh(root: Path, seeded_store: Path) -> Path:
    root.mkdir(parents=True)
    (root / "conf").symlink_to(ROOT / "conf")
    for part in ("tokenizer", "model"):
        if (seeded_store / part).exists():
            shutil.copytree(seeded_store / part, root / "artifacts" / "store" / part)
    return root


def test_the_same_prompt_file_at_another_path_replays_the_same_bytes(tmp_path, seeded_store):
    a = fresh(tmp_path / "project-a", seeded_store)
    opd("data", "sample", "--out", str(a / "data-a" / "train.parquet"), "--rows", "12", *TINY, cwd=a)
    opd("stage", "train", *RUN, f"data.path={a / 'data-a' / 'train.parquet'}", cwd=a)
    entries = {e for e in published(a / "artifacts") if e.split("/")[0] in ("prompts", "rollout", "score", "update")}
    assert len(entries) == 7, sorted(entries)  # prompts + 2 steps x rollout/score/update

    b = fresh(tmp_path / "elsewhere" / "project-b", seeded_store)  # another clone, another file path
    (b / "in").mkdir()
    shutil.copyfile(a / "data-a" / "train.parquet", b / "in" / "prompts.parquet")
    opd("stage", "train", *RUN, f"data.path={b / 'in' / 'prompts.parquet'}", cwd=b)
    assert {e for e in published(b / "artifacts") if e.split("/")[0] in ("prompts", "rollout", "score", "update")} \
        == entries
    assert entry_differences(b / "artifacts", a / "artifacts", entries) == []

    (a / "data-a").rename(a / "data-moved")  # and in place: move the file and the store
    (a / "artifacts").rename(a / "artifacts-moved")
    before = published(a / "artifacts-moved")
    opd("stage", "train", *RUN, f"data.path={a / 'data-moved' / 'train.parquet'}", "artifacts=artifacts-moved", cwd=a)
    assert published(a / "artifacts-moved") == before  # every stage reused
