"""Directories written outside the store (exports, bundles): copies of store files, sha256 listings,
and the atomic swap of a finished directory into place."""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path

# a store dir's own records, not part of what it holds
STORE_RECORDS = ("manifest.json", "state.json")
FICLONE = 0x40049409  # Linux ioctl: make dst share src's extents copy-on-write (btrfs, xfs)


def copy_file(src: Path, dst: Path) -> None:
    """A copy the destination owns: a reflink (copy-on-write, no bytes duplicated) where the filesystem
    supports one, else the bytes. Never a hard link: a shared inode would make the store editable."""
    dst.unlink(missing_ok=True)
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        try:
            fcntl.ioctl(fo.fileno(), FICLONE, fi.fileno())
            return
        except OSError:
            pass
    shutil.copyfile(src, dst)


def copy_tree(src: Path, dst: Path, names: tuple[str, ...] | None = None) -> None:
    """The files of a store dir (without its manifest and state), or only those starting with `names`."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in STORE_RECORDS and (names is None or f.name.startswith(names)):
            copy_file(f, dst / f.name)


def rebase_adapter(adapter_dir: Path, base: str) -> None:
    """Point an exported PEFT adapter at the base it applies to (`base_model_name_or_path`). The
    config file is replaced, never written through (it came from the store)."""
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
