"""export: a standard PEFT adapter dir, the student base it applies to, and a provenance manifest.

    base = AutoModelForCausalLM.from_pretrained("artifacts/export/<run>/base")
    model = PeftModel.from_pretrained(base, "artifacts/export/<run>/adapter")
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path

from . import models, reproducible
from .errors import UserError
from .session import Session
from .store import fault, write_json


def _copy_tree(src: Path, dst: Path) -> None:
    """Hard-link where possible (same filesystem, no bytes copied), else copy."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in ("manifest.json", "state.json"):
            target = dst / f.name
            target.unlink(missing_ok=True)
            try:
                os.link(f, target)
            except OSError:
                shutil.copy2(f, target)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while b := fh.read(1 << 22):
            h.update(b)
    return h.hexdigest()


def run(sess: Session, out: Path | None = None) -> Path:
    cfg = sess.cfg
    out = Path(out or Path(cfg.artifacts) / "export" / cfg.run)
    final = sess.policy_digest(cfg.train.updates)
    pol = sess.store.get(sess.chain.policy_stage(cfg.train.updates), final)
    if pol is None:  # the driver publishes it first (stages/train.py ensure_policy)
        raise UserError(f"export: the final policy {final[:12]} is not in the store; run train first")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "a") as lock:  # one exporter per dir (two runs, one view)
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        try:
            _export(sess, pol, final, out)
        except BaseException:  # abandoned (error, SIGTERM): leave no temp dir behind
            shutil.rmtree(out.parent / f".{out.name}.tmp-{os.getpid()}", ignore_errors=True)
            raise
    fault("export.after", out)
    return out


def _export(sess: Session, pol: Path, final: str, out: Path) -> None:
    cfg = sess.cfg
    fault("export.before", out)
    for stale in out.parent.glob(f".{out.name}.tmp-*"):  # under the lock: dead writers' leftovers
        shutil.rmtree(stale, ignore_errors=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    _copy_tree(sess.store.path("model", sess.prepared["student"]), tmp / "base")
    _copy_tree(pol / "adapter", tmp / "adapter")
    acfg = json.loads((tmp / "adapter" / "adapter_config.json").read_text())
    acfg["base_model_name_or_path"] = "../base"  # relative to the adapter dir
    (tmp / "adapter" / "adapter_config.json").unlink()
    (tmp / "adapter" / "adapter_config.json").write_text(json.dumps(acfg, indent=2, sort_keys=True) + "\n")
    files = {str(p.relative_to(tmp)): sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
    write_json(tmp / "manifest.json", {
        "run": cfg.run, "versions": models.env_versions(), "stack": reproducible.stack(), "device": sess.device.type,
        "dtype": str(sess.dtype), "student": cfg.student.name, "teacher": cfg.teacher.name,
        "digests": {"prepared": sess.prepared, "initial_policy": sess.policy_digest(0), "final_policy": final,
                    "steps": {k: {"rollout": sess.rollout_digest(k), "score": sess.score_digest(k),
                                  "update": sess.update_digest(k)} for k in range(1, cfg.train.updates + 1)}},
        "sha256": files,
    })
    fault("export.before_rename", tmp)
    if out.exists():  # swap: the old export is moved aside, then removed (a kill in between: rerun)
        old = out.parent / f".{out.name}.tmp-old-{os.getpid()}"
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)


def main(sess: Session, out: Path | None = None) -> Path:
    d = run(sess, out)
    print(f"export: {d}/adapter (PEFT), {d}/base, {d}/manifest.json")
    return d
