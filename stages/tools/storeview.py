"""`opd store du|gc`: what the store holds, per stage kind and per run, and removing what no run
reaches (as `dvc gc` does for DVC's cache: a dry run unless `--yes`).

A run reaches, from its view `artifacts/runs/<run>/` (stages/run/runview.py):
  - every stage its record `view.json` names: the models, prompts and tasks of prepare's record, policy
    0 and every step's rollout, score and update (planned ones too: a stopped run resumes into them);
  - the stages its chain derives from its recorded config (`config.json`, identity.Chain): the
    evaluation, the fresh LoRA an SFT cold start starts from, the protocol_sft teacher adapter;
  - prepare's own stage (`prepared/`, the one whose record is the view's), a pruned model's parent
    (prepare derives the pruned model from it, and ensures it first on every run), and the embedded
    tokenizer an `arch:` model was built with;
  - whatever its step links and its prepare.json point at (a run past prepare, not yet training).
What no run reaches is unreachable: stages of deleted or replaced views, tool caches that no view
names (probe, tooleval, the benchmark's continued SFT), damaged dirs the store set aside
(`.corrupt-*`) and what a killed gc left (`.gc-*`). `gc` removes those only with `--yes`, and keeps
any published in the last `--min-age` minutes (default a day): a run that is starting may have
published them before its view names them, and `opd stage STEP --step K`, `opd stage evaluate`,
`tooleval` and `export --verl` write no view at all, so what they published is reached only through a
run view that names it later. Readers take no lock: gc while such a command runs over stages older
than the window can make it fail (a traceback, never a wrong result: everything is content-addressed). It refuses while a view's record cannot be read. DVC experiments
(`dvc exp run`) share one view, so only the stages of the one that made it last are reached: an
experiment applied again later recomputes the rest (to the same bytes).

Sizes are disk usage (allocated blocks, each inode counted once), as `du` counts them: the kinds' sizes
sum with the store dir itself to `du -sB1 artifacts/store`.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from ..run import identity, recorded, runview
from ..run.store import MANIFEST, file_hash
from ..weights import models

# the order kinds are listed in: the pipeline's, then anything else by name
ORDER = ("tokenizer", "model", "prepared", "prompts", "tasks", "init", "sft", "rollout", "score", "update",
         "evaluate", "tooleval", "probe")
MAX_KEEP = 512  # keep_layers values tried when finding a pruned model's parent
# dirs no writer or reader uses: damaged ones the store set aside, and what a killed gc left half-removed
ASIDE = (".corrupt-", ".gc-")


@dataclass
class Entry:
    kind: str  # the stage name (its directory under store/)
    name: str  # the digest, or the name of a dir set aside (ASIDE)
    path: Path
    bytes: int = 0
    runs: list[str] = field(default_factory=list)  # the runs that reach it

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.name


@dataclass
class Reach:
    stages: set = field(default_factory=set)  # (kind, digest)
    problem: str | None = None  # why this view's reach is not known in full: gc refuses
    notes: list[str] = field(default_factory=list)


def disk_usage(path: Path, seen: set) -> int:
    """Allocated bytes under `path` (itself included), each inode once across calls sharing `seen`;
    symlinks are counted, never followed."""
    total = 0
    for p in [path, *path.rglob("*")]:
        try:
            st = p.lstat()
        except FileNotFoundError:
            continue
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def sort_kinds(kinds) -> list[str]:
    return sorted(kinds, key=lambda k: (ORDER.index(k) if k in ORDER else len(ORDER), k))


def scan(root: Path) -> tuple[list[Entry], dict[str, int], int]:
    """(the stage dirs and set-aside dirs, bytes per kind dir, bytes of the store dir itself)."""
    entries, kinds = [], {}
    if not root.is_dir():
        return entries, kinds, 0
    st = root.lstat()
    seen = {(st.st_dev, st.st_ino)}
    for kd in sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink()):
        mine = [Entry(kd.name, d.name, d) for d in sorted(kd.iterdir()) if d.is_dir() and not d.is_symlink()
                and (not d.name.startswith(".") or d.name.startswith(ASIDE))]
        for e in mine:
            e.bytes = disk_usage(e.path, seen)
        # the kind dir itself, its lock files and any temp dir of a writer, besides its stages
        kinds[kd.name] = disk_usage(kd, seen) + sum(e.bytes for e in mine)
        entries += mine
    return entries, kinds, st.st_blocks * 512


# ---- what each run reaches ----

def run_dirs(artifacts: Path) -> list[Path]:
    runs = artifacts / "runs"
    if not runs.is_dir():
        return []
    return sorted(d for d in runs.iterdir() if d.is_dir() and not d.name.startswith(".") and (
        (d / runview.VIEW).exists() or (d / "prepare.json").exists() or any(d.glob("step-*"))))


def reach(run_dir: Path, root: Path) -> Reach:
    r = Reach()
    r.stages |= _links(run_dir, root)
    try:
        view = runview.read(run_dir)
    except UserError as e:
        r.problem = str(e)
        return r
    prep = _json(run_dir / "prepare.json")
    for p in ([view["digests"]["prepared"]] if view else []) + ([prep] if isinstance(prep, dict) else []):
        r.stages |= _prepared(p, root)
    cfg = _config(run_dir, r, quiet=view is None)  # (a run past prepare only has no config.json yet)
    r.stages |= _tokenizer(cfg)
    if view is None:
        return r
    d = view["digests"]
    r.stages.add((d["policy0_stage"], d["initial_policy"]))
    r.stages.add(("update" if view["updates"] else d["policy0_stage"], d["final_policy"]))
    for s in d["steps"].values():
        r.stages |= set(s.items())
    if cfg is None:
        return r
    unknown = f"run {run_dir.name!r}: made by another version of the stages (its recorded digests are kept; " \
              "its evaluation is not identified)"
    chain = recorded.chain(cfg, view)
    if chain is None:
        r.notes.append(unknown)
        return r
    try:
        r.stages.add(("evaluate", chain.evaluate()))
        if cfg.sft.steps:
            r.stages.add(("init", chain.init()))  # the fresh LoRA the cold start trained from
        if cfg.teacher_mode == "protocol_sft":
            r.stages.add(("sft", chain.teacher_adapter()))
    except (KeyError, UserError):  # a record of another version (a key it lacks)
        r.notes.append(unknown)
    return r


def _json(p: Path):
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def _links(run_dir: Path, root: Path) -> set:
    """(kind, digest) of every store dir a link in the view points into."""
    out, real = set(), root.resolve()
    for p in run_dir.rglob("*"):
        if p.is_symlink() and not any(part.startswith(".stale-") for part in p.relative_to(run_dir).parts):
            t = Path(os.path.realpath(p))
            if t.is_relative_to(real) and len(rel := t.relative_to(real).parts) >= 2:
                out.add((rel[0], rel[1]))
    return out


def _prepared(p: dict, root: Path) -> set:
    """The models, prompts and tasks of prepare's record, and the `prepared` stage that holds it."""
    out = {("model", p.get("student")), ("model", p.get("teacher")), ("prompts", p.get("prompts")),
           ("tasks", p.get("tasks_train")), ("tasks", p.get("tasks_test"))}
    for d in (root / "prepared").glob("[!.]*"):
        if _json(d / "prepared.json") == p:
            out.add(("prepared", d.name))
    return {(k, v) for k, v in out if v}


def _config(run_dir: Path, r: Reach, quiet: bool):
    """The run's resolved config (config.json, written when it starts training), or None (noted)."""
    why = "no readable config.json"
    try:
        cfg = recorded.config(run_dir)
        if cfg is not None:
            return cfg
    except UserError as e:
        why = str(e)
    if not quiet:
        r.notes.append(f"run {run_dir.name!r}: {why} (its recorded digests are kept; its evaluation is not identified)")
    return None


def _tokenizer(cfg) -> set:
    """The embedded tokenizer's stage, which `arch:` models with tokenizer=embedded are built with (and
    prepare ensures on every run); unknown config or no embedded model here: every tokenizer stage."""
    uses = cfg is None or any(getattr(cfg, r).name.startswith("arch:") and getattr(cfg, r).tokenizer == "embedded"
                              for r in ("student", "teacher"))
    if not uses:
        return set()
    try:
        return {("tokenizer", identity.tokenizer(file_hash(models.gguf_path())))}
    except UserError:
        return {("tokenizer", "*")}


def parents(entries: list[Entry], reached: set) -> set:
    """The models that reached pruned models were derived from (`identity.pruned_model`)."""
    models_ = [e.name for e in entries if e.kind == "model"]
    want = {dig for kind, dig in reached if kind == "model"}
    return {("model", p) for p in models_ for k in range(1, MAX_KEEP + 1) if identity.pruned_model(k, p) in want}


def survey(artifacts: Path) -> dict:
    """Everything `du` and `gc` print: entries with the runs that reach them, sizes, problems."""
    root = artifacts / "store"
    entries, kinds, top = scan(root)
    runs, problems, notes = {}, [], []
    for d in run_dirs(artifacts):
        r = reach(d, root)
        r.stages |= parents(entries, r.stages)
        runs[d.name] = r.stages
        problems += [f"run view {d}: {r.problem}"] if r.problem else []
        notes += r.notes
    for e in entries:
        e.runs = [n for n, s in runs.items() if e.key in s or (e.kind, "*") in s]
    return {"root": root, "entries": entries, "kinds": kinds, "top": top, "runs": runs, "problems": problems,
            "notes": notes}


# ---- the commands ----

def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def du(s: dict) -> dict:
    entries = s["entries"]
    kinds = {k: {"stages": sum(e.kind == k for e in entries), "bytes": s["kinds"][k],
                 "unreachable_stages": sum(e.kind == k and not e.runs for e in entries),
                 "unreachable_bytes": sum(e.bytes for e in entries if e.kind == k and not e.runs)}
             for k in sort_kinds(s["kinds"])}
    runs = {n: {"stages": sum(1 for e in entries if n in e.runs), "bytes": sum(e.bytes for e in entries if n in e.runs),
                "alone_bytes": sum(e.bytes for e in entries if e.runs == [n]),
                "reaches": [f"{e.kind}/{e.name}" for e in entries if n in e.runs]} for n in s["runs"]}
    return {"store": str(s["root"]), "total_bytes": s["top"] + sum(s["kinds"].values()), "kinds": kinds,
            "runs": runs, "unreachable": [{"stage": f"{e.kind}/{e.name}", "bytes": e.bytes}
                                          for e in entries if not e.runs],
            "problems": s["problems"], "notes": s["notes"]}


def print_du(r: dict) -> None:
    n = sum(k["stages"] for k in r["kinds"].values())
    print(f"store {r['store']}: {human(r['total_bytes'])} ({r['total_bytes']} bytes) in {n} stage dirs")
    print(f"  {'kind':<10} {'stages':>6} {'size':>10}  unreachable")
    for name, k in r["kinds"].items():
        un = f"{k['unreachable_stages']} ({human(k['unreachable_bytes'])})" if k["unreachable_stages"] else "-"
        print(f"  {name:<10} {k['stages']:>6} {human(k['bytes']):>10}  {un}")
    if r["runs"]:
        print("runs (what each view reaches; alone: what no other run reaches, freed by deleting its view and gc):")
        width = max(map(len, r["runs"]))
        for name, x in r["runs"].items():
            print(f"  {name:<{width}} {x['stages']:>4} stages {human(x['bytes']):>10}  alone {human(x['alone_bytes'])}")
    un = r["unreachable"]
    print(f"unreachable: {len(un)} stage dirs, {human(sum(u['bytes'] for u in un))}"
          + ("; `opd store gc` lists them, `opd store gc --yes` removes them" if un else ""))


def gc(s: dict, yes: bool, min_age_s: float) -> dict:
    if s["problems"]:
        raise UserError(f"{s['problems'][0]}; gc removes nothing while a run's reach is unknown "
                        "(repair or remove that view)")
    now, out = time.time(), {"removed": [], "kept_recent": [], "busy": [], "freed_bytes": 0}
    for e in (e for e in s["entries"] if not e.runs):
        if now - _published(e.path) < min_age_s:
            out["kept_recent"].append(e)
        elif not yes:
            out["removed"].append(e)
        elif _remove(e):
            out["removed"].append(e)
        else:
            out["busy"].append(e)
    out["freed_bytes"] = sum(e.bytes for e in out["removed"])
    return out


def _published(d: Path) -> float:
    """When a stage dir was published (its manifest is written last), else last changed."""
    for p in (d / MANIFEST, d):
        try:
            return p.stat().st_mtime
        except OSError:
            continue
    return 0.0


def _remove(e: Entry) -> bool:
    """Remove one stage dir, renamed aside first so that no reader ever sees half of it, under its
    digest's lock (False: a writer holds it). A dir the store set aside has no writer."""
    aside = e.path.parent / f".gc-{e.name.lstrip('.')}-{os.getpid()}"
    if e.name.startswith(ASIDE):
        os.replace(e.path, aside)
        shutil.rmtree(aside)
        return True
    with open(e.path.parent / f".{e.name}.lock", "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        os.replace(e.path, aside)
        shutil.rmtree(aside)
    return True


def main(args) -> None:
    artifacts = Path(args.artifacts or runview.default_run()[1])
    if not (artifacts / "store").is_dir():
        raise UserError(f"{artifacts / 'store'}: no store here (give --artifacts DIR, or run something first)")
    s = survey(artifacts)
    for n in s["notes"]:
        print(f"note: {n}", file=sys.stderr)
    if args.action == "du":
        r = du(s)
        if args.format == "json":
            print(json.dumps(r, indent=1))
        else:
            for p in r["problems"]:
                print(f"warning: {p} (gc refuses until it is repaired or removed)", file=sys.stderr)
            print_du(r)
        return
    out = gc(s, args.yes, args.min_age * 60)
    if args.format == "json":
        print(json.dumps({"dry_run": not args.yes, "freed_bytes": out["freed_bytes"],
                          **{k: [f"{e.kind}/{e.name}" for e in out[k]] for k in ("removed", "kept_recent", "busy")}},
                         indent=1))
        return
    for e in out["removed"]:
        print(f"{'removed' if args.yes else 'unreachable'}  {e.kind}/{e.name}  {human(e.bytes)}")
    for e in out["kept_recent"]:
        print(f"kept (published in the last {args.min_age:g} min)  {e.kind}/{e.name}  {human(e.bytes)}")
    for e in out["busy"]:
        print(f"kept (a writer holds its lock)  {e.kind}/{e.name}  {human(e.bytes)}")
    n, b = len(out["removed"]), out["freed_bytes"]
    if args.yes:
        print(f"gc: removed {n} stage dirs, freed {b} bytes ({human(b)})")
    else:
        print(f"gc: {n} stage dirs no run reaches, {b} bytes ({human(b)}); `opd store gc --yes` removes them"
              if n else "gc: every stage is reached by a run; nothing to remove")

