"""export: the run's final policy (export.policy=best: its best evaluated one) as a standard PEFT
adapter dir, the student base it applies to, a provenance manifest and, with --merged, a standalone
model with the LoRA merged into its layers.

    model = AutoPeftModelForCausalLM.from_pretrained("artifacts/export/<run>/adapter")  # any cwd
    model = AutoModelForCausalLM.from_pretrained("artifacts/export/<run>/merged")       # --merged

An adapter over a Hugging Face Hub model names it by id and commit, so the export loads wherever it
is moved; over any other base (pruned, embedded, a local dir) it names base/ by its absolute path,
since PEFT resolves a relative one against the cwd: after a move, load it over the moved base/
(manifest.json says how).

What is exported is what the run view records (stages/run/runview.py): the final policy of the run
that made `artifacts/runs/<run>/`, never one computed here from the config given (export never
trains). Every file is a copy (a reflink where the filesystem has them): nothing in the export is
a link into the store, so editing an export cannot change a published file.
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shutil
from pathlib import Path

from .run import files, identity, recorded, reproducible, runview
from .run.config import ModelCfg
from .weights import models
from .errors import UserError
from .run.store import fault, write_json
from .session import Session

# config keys that only say which run to export, where its artifacts are and which of its policies:
# anything else given to `opd stage export` would be a config the export ignores (it exports the
# recorded run)
SELECTORS = ("run", "artifacts", "export")
# the files of a model dir that make up its tokenizer (copied next to the adapter and the merged model)
TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "chat_template", "vocab", "merges", "added_tokens")


def check_selection(sess: Session, overrides: list[str] | None) -> None:
    """`opd stage export` exports the run the view recorded: an override that disagrees with that
    run's config would be ignored, so it is refused (one that agrees, or run=NAME, is fine)."""
    recorded = sess.run_dir / "config.json"
    if not overrides or not recorded.is_file():  # no run there: chosen_policy() says so
        return
    now, then = dataclasses.asdict(sess.cfg), json.loads(recorded.read_text())
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key.split(".")[0] in SELECTORS:
            continue
        a, b = _dotted(now, key), _dotted(then, key)
        if a != b:
            raise UserError(f"override {o!r}: run {sess.cfg.run!r} was trained with {key}={b!r}; export takes the "
                            "run's recorded config (give run=NAME, or run this config first under its own name)")


def _dotted(d: dict, key: str):
    for part in key.split("."):
        d = d.get(part, KeyError) if isinstance(d, dict) else KeyError
    return d


def chosen_policy(sess: Session) -> tuple[dict, Path, dict]:
    """(the run view's record, the published dir of the policy export.policy chooses, why it was
    chosen: {"step", "digest", "rule"[, "kl", "of", "evaluate"]}); UserError if there is none.
    final: the run's last policy. best: the evaluated policy with the lowest held-out KL on the
    teacher's answers (runview.best_policy), read from the run's evaluation in the store."""
    cfg = sess.cfg
    rec = runview.read(sess.run_dir)
    hint = f"run it first (`opd run run={cfg.run}`, or `dvc repro` for the run params.yaml names)"
    if rec is None or not rec.get("complete"):
        raise UserError(f"run {cfg.run!r} has no final policy ({sess.run_dir} holds no finished run); {hint}")
    d, K = rec["digests"], rec["updates"]
    why: dict = {"step": K, "rule": "the run's final policy (export.policy=final)"}
    if cfg.export.policy == "best":  # the evaluation of the run's recorded config (the one `opd run` made)
        chain = recorded.chain(recorded.config(sess.run_dir), rec)
        ev = chain and sess.store.get("evaluate", chain.evaluate())
        if ev is None:
            raise UserError(f"export.policy=best: run {cfg.run!r} has no evaluation in {sess.store.root}; "
                            f"run `opd stage evaluate run={cfg.run}` first (`opd run` does)")
        best = runview.best_policy(json.loads((ev / "eval.json").read_text()), K)
        why = {"step": best["policy"], "kl": best["kl"], "of": best["of"], "evaluate": ev.name,
               "rule": "the lowest held-out KL(teacher||student) on the teacher's answers among the evaluated "
                       "policies (export.policy=best; eval.every sets which are evaluated)"}
    k = why["step"]
    stage, dig = ("update", d["steps"][str(k)]["update"]) if k else (d["policy0_stage"], d["initial_policy"])
    pol = sess.store.get(stage, dig)
    if pol is None:
        raise UserError(f"run {cfg.run!r} has no policy {k}: {stage}/{dig[:12]} is missing or "
                        f"damaged in {sess.store.root}; {hint}")
    return rec, pol, {**why, "digest": dig}


def run(sess: Session, out: Path | None = None, merged: bool = False) -> Path:
    cfg = sess.cfg
    out = Path(out or Path(cfg.artifacts) / "export" / cfg.run)
    rec, pol, why = chosen_policy(sess)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "a") as lock:  # one exporter per dir (two runs, one view)
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        try:
            _export(sess, rec, pol, why, out, merged)
        except BaseException:  # abandoned (error, SIGTERM): leave no temp dir behind
            shutil.rmtree(out.parent / f".{out.name}.tmp-{os.getpid()}", ignore_errors=True)
            raise
    fault("export.after", out)
    return out


def _export(sess: Session, rec: dict, pol: Path, why: dict, out: Path, merged: bool) -> None:
    fault("export.before", out)
    for stale in out.parent.glob(f".{out.name}.tmp-*"):  # under the lock: dead writers' leftovers
        shutil.rmtree(stale, ignore_errors=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    base = sess.store.get("model", rec["digests"]["prepared"]["student"])  # content-checked before it is copied
    if base is None:
        raise UserError(f"run {rec['run']!r}: its student model/{rec['digests']['prepared']['student'][:12]} is "
                        f"missing or damaged in {sess.store.root}; run it again (prepare rebuilds it)")
    files.copy_tree(base, tmp / "base")
    files.copy_tree(pol / "adapter", tmp / "adapter")
    files.copy_tree(base, tmp / "adapter", TOKENIZER_FILES)  # AutoTokenizer / AutoPeftModel read it from here
    config = json.loads((sess.run_dir / "config.json").read_text())
    hub = hub_base(config["student"], rec["digests"]["prepared"]["student"])
    if hub is not None:  # the base is a Hugging Face snapshot: named by id and commit, the export may move
        files.rebase_adapter(tmp / "adapter", hub[0])
        _set_revision(tmp / "adapter", hub[1])
    else:
        # absolute: PEFT resolves a relative path against the cwd, not the adapter dir, so none would load
        # from any directory; after a move, the adapter loads over the moved base/ (the manifest says how)
        files.rebase_adapter(tmp / "adapter", str(out.resolve() / "base"))
    if merged:
        _merge(tmp, rec["runtime"]["dtype"])
    sums = {str(p.relative_to(tmp)): files.sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
    write_json(tmp / "manifest.json", {
        "run": rec["run"], "versions": models.env_versions(), "stack": reproducible.stack(), "device": rec["runtime"]["device"],
        "dtype": f"torch.{rec['runtime']['dtype']}", "student": config["student"]["name"],
        "teacher": config["teacher"]["name"],
        "digests": {"prepared": rec["digests"]["prepared"], "initial_policy": rec["digests"]["initial_policy"],
                    "final_policy": rec["digests"]["final_policy"], "steps": rec["digests"]["steps"]},
        "policy": why,  # which policy adapter/ holds, and why (export.policy)
        "load": {"adapter": f"AutoPeftModelForCausalLM.from_pretrained('adapter') (its base is {hub[0]!r} at "
                            f"revision {hub[1]}, from the Hugging Face cache or hub: this dir may move; "
                            "base/ holds the same model)" if hub is not None else
                            "AutoPeftModelForCausalLM.from_pretrained('adapter') (its base path is absolute: "
                            "after moving this dir, PeftModel.from_pretrained(AutoModelForCausalLM."
                            "from_pretrained('base'), 'adapter'))",
                 **({"merged": "AutoModelForCausalLM.from_pretrained('merged')"} if merged else {})},
        "sha256": sums,
    })
    fault("export.before_rename", tmp)
    files.swap_into_place(tmp, out)


def hub_base(student: dict, digest: str) -> tuple[str, str] | None:
    """(Hugging Face id, commit) when the run's student base is exactly a cached Hub snapshot's model:
    named by a Hub id (not a local dir, the embedded model or an architecture), every layer kept, and
    the snapshot the id resolves to now hashes to the run's student model (`identity_of`, as prepare
    made it). An adapter naming it loads from any directory wherever the export moves; any other base
    (pruned, a local dir, the cache moved on to another commit) is only the export's own base/."""
    try:
        mcfg = ModelCfg(**student)
    except TypeError:  # a config of another version: not provably the same base
        return None
    if mcfg.name == "embedded" or mcfg.name.startswith("arch:") or mcfg.init != "pretrained" \
            or Path(mcfg.name).is_dir():
        return None
    from huggingface_hub import snapshot_download

    try:
        snap = Path(snapshot_download(mcfg.name, revision=mcfg.revision, local_files_only=True))
        full = identity.model(models.identity_of(dataclasses.replace(mcfg, keep_layers=0, quant="none"), "student"))
        layers = json.loads((snap / "config.json").read_text()).get("num_hidden_layers")
    except Exception:  # noqa: BLE001 - not in the cache (any more), unreadable: the export's own base
        return None
    if not mcfg.keep_layers:
        whole = full
    elif mcfg.keep_layers == layers:  # pruning to every layer keeps the model as it is
        whole = identity.pruned_model(mcfg.keep_layers, full)
    else:
        return None
    return (mcfg.name, snap.name) if whole == digest else None


def _set_revision(adapter_dir: Path, revision: str) -> None:
    """The base's revision in an exported adapter's config (PEFT loads the base at it); the file is
    replaced, never written through."""
    f = adapter_dir / "adapter_config.json"
    acfg = json.loads(f.read_text())
    acfg["revision"] = revision
    f.unlink()
    f.write_text(json.dumps(acfg, indent=2, sort_keys=True) + "\n")


def _merge(tmp: Path, dtype: str) -> None:
    """merged/: the base with the LoRA folded into its weights (W + B A * alpha/r), saved as a plain
    Hugging Face model with its tokenizer: no PEFT needed to load or serve it. In the dtype the run
    trained in (`dtype`): a bf16-stored base trained in fp32 would lose most of a small LoRA delta to
    bf16 rounding."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tmp / "base", dtype=getattr(torch, dtype))
    with torch.no_grad():
        model = PeftModel.from_pretrained(base, tmp / "adapter").merge_and_unload()
    model.save_pretrained(tmp / "merged", safe_serialization=True)
    files.copy_tree(tmp / "base", tmp / "merged", TOKENIZER_FILES)


def main(sess: Session, out: Path | None = None, merged: bool = False) -> Path:
    d = run(sess, out, merged)
    why = json.loads((d / "manifest.json").read_text())["policy"]
    chosen = "" if sess.cfg.export.policy == "final" else \
        f" (policy {why['step']} of {why['of']}: held-out KL {why['kl']:.4f}, the lowest)"
    print(f"export: {d}/adapter (PEFT){chosen}, {d}/base" + (f", {d}/merged (standalone)" if merged else "")
          + f", {d}/manifest.json")
    return d
