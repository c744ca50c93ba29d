"""Directories written outside the store (exports, bundles): hard-linked copies of store files,
sha256 listings, and the atomic swap of a finished directory into place."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

# a store dir's own records, not part of what it holds
STORE_RECORDS = ("manifest.json", "state.json")


def link_tree(src: Path, dst: Path) -> None:
    """The files of store dir `src` in `dst`: hard links where possible (same filesystem, no bytes
    copied), else copies. A hard link shares its bytes with the store: never write through one."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in STORE_RECORDS:
            target = dst / f.name
            target.unlink(missing_ok=True)
            try:
                os.link(f, target)
            except OSError:
                shutil.copy2(f, target)


def rebase_adapter(adapter_dir: Path, base: str) -> None:
    """Point an exported PEFT adapter at the base it applies to (`base_model_name_or_path`). The
    config file is a hard link into the store: it is replaced, never written through."""
    f = adapter_dir / "adapter_config.json"
    acfg = json.loads(f.read_text())
    acfg["base_model_name_or_path"] = base
    f.unlink()
    f.write_text(json.dumps(acfg, indent=2, sort_keys=True) + "\n")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while b := fh.read(1 << 22):
            h.update(b)
    return h.hexdigest()


def swap_into_place(tmp: Path, out: Path) -> None:
    """Replace `out` with the finished `tmp`: the old one is moved aside, then removed (a kill in
    between leaves a dot-dir that the next run's temp cleanup removes; `out` is always whole)."""
    if out.exists():
        old = out.parent / f".{out.name}.tmp-old-{os.getpid()}"
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)
