"""The run view's own record, `artifacts/runs/<run>/view.json`: which run the view holds and which of
its steps are linked, so that a view never mixes two runs.

    {"run": NAME, "origin": "params" | "overrides", "config": <xxh3 of the resolved config>,
     "updates": K, "complete": bool, "steps": [0, 1, ...],
     "digests": {"prepared": {...}, "initial_policy": D, "final_policy": D, "policy0_stage": S,
                 "steps": {"1": {"rollout": D, "score": D, "update": D}, ...}},
     "runtime": {"device": ..., "dtype": ..., "threads": ...}}

`train` writes it: when a run with another final policy takes over the view, the new record (no
steps yet) replaces the old one in one rename, then the old step dirs and the files that described
the old run (history, metrics, eval, train record, report) are removed; each step is listed once it is
linked. Readers (`opd report`, `opd inspect`) take only the listed steps; `opd stage export` takes
the final policy from here. The record holds no timings, so a resumed run writes the same bytes as
an uninterrupted one. `origin` is how the config was given: `--params FILE` (what `dvc repro` runs)
or conf/ + overrides (`opd run`, `opd stage`); a view made one way is never silently replaced by a
run with another config made the other way.
"""
from __future__ import annotations

import dataclasses
import math
import fcntl
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from ..errors import UserError
from .store import canonical, link, read_json, read_state, write_json

VIEW = "view.json"
# files in the view that describe one run as a whole: removed when another run takes the view over
DERIVED = ("history.csv", "train.json", "metrics.json", "eval.json", "answers.json", "report.html", "config.json")
ORIGINS = {"params": "`dvc repro` / `--params FILE`", "overrides": "`opd run` / `opd stage` with overrides"}


def headline(result: dict, updates: int) -> dict:
    """metrics.json, the DVC metrics file: the evaluate stage's record (`result`, the view's eval.json) cut
    to a few numbers under short flat keys, one narrow `dvc exp show` / `dvc metrics diff` column each.
    On the teacher's held-out text: KL(teacher||student) and top-1 agreement of policy 0 (`_before`) and
    of the final policy (`_after`); the share of non-blank greedy answers after; `worse` (below) when KL
    rose, or agreement or task accuracy fell, past the evaluation's noise. Where held-out rows have a
    ground truth, task accuracy (`acc_before`, `acc_after`, `acc_teacher`: the evaluate stage's `task`).
    With eval.every, `best_policy`: the step of the lowest held-out KL (`best_policy` below).
    The numbers are the record's own (already rounded), so the file is as reproducible."""
    t0, t1 = result["initial"]["on_teacher_text"], result["final"]["on_teacher_text"]
    out = {"kl_before": t0["kl"], "kl_after": t1["kl"], "agree_before": t0["top1_agreement"],
           "agree_after": t1["top1_agreement"], "nonblank_after": result["final"]["answers"]["nonblank"],
           "updates": updates, "worse": worse(result["initial"], result["final"])}
    if "policies" in result:  # eval.every: the policy export.policy=best would take
        out.update(best_policy=best_policy(result, updates)["policy"])
    if "task" in result["final"]:
        out.update({f"acc_{key}": result[who]["task"]["accuracy"]
                    for key, who in (("before", "initial"), ("after", "final"), ("teacher", "teacher"))})
    return out


def best_policy(result: dict, K: int) -> dict:
    """Of the evaluated policies (`policies`, else the initial and the final one), the one with the
    lowest held-out KL on the teacher's answers (the earliest of equals): {"policy": k, "kl", "of"}."""
    cands = result.get("policies") or [{"policy": 0, "kl": result["initial"]["on_teacher_text"]["kl"]},
                                       {"policy": K, "kl": result["final"]["on_teacher_text"]["kl"]}]
    best = min(cands, key=lambda c: (c["kl"], c["policy"]))
    return {"policy": best["policy"], "kl": best["kl"], "of": [c["policy"] for c in cands]}


KL_RISE = 0.05  # a relative rise of held-out KL past which a run counts as worse (evaluation noise is less)


def fell(before: float, after: float, n: int) -> bool:
    """A proportion measured over n items fell by more than two standard errors of its first value."""
    n = max(int(n or 1), 1)
    return after < before - 2 * math.sqrt(max(before * (1 - before), 1 / n) / n)


def worse(initial: dict, final: dict) -> bool:
    """Whether the final policy is worse than policy 0 on held-out prompts (the evaluate record's
    `initial` and `final`): on the teacher's text, KL rose by more than KL_RISE of its first value or
    top-1 agreement fell past its noise (`fell`, over the evaluated tokens); or task accuracy, where
    there is one, fell past its noise over the scored rows. A change within an evaluation's own noise is
    no regression (a random tiny model's KL moves by a fraction of a percent)."""
    t0, t1 = initial["on_teacher_text"], final["on_teacher_text"]
    a0, a1 = initial.get("task"), final.get("task")
    return (t1["kl"] > t0["kl"] * (1 + KL_RISE) or fell(t0["top1_agreement"], t1["top1_agreement"], t0.get("tokens"))
            or bool(a0 and a1 and fell(a0["accuracy"], a1["accuracy"], a0["n"])))


def worse_warning(metrics: dict | None) -> str | None:
    """The one `warning:` line for a run that left the student further from the teacher than policy 0
    (metrics.json's `worse`), naming both figures; None otherwise (and for a metrics.json without them)."""
    m = metrics or {}
    if m.get("worse") is not True:
        return None
    return (f"warning: the trained student is worse than policy 0 on held-out prompts: KL {m['kl_before']:.4f} -> "
            f"{m['kl_after']:.4f}, agreement {m['agree_before']:.3f} -> {m['agree_after']:.3f}"
            + (f", task accuracy {m['acc_before']:.3f} -> {m['acc_after']:.3f}" if "acc_after" in m else "")
            + " (consider a lower optim.lr)")


def config_digest(cfg) -> str:
    import xxhash

    return xxhash.xxh3_128_hexdigest(canonical(dataclasses.asdict(cfg)))


def read(run_dir: Path) -> dict | None:
    return read_json(Path(run_dir) / VIEW, " (remove the run view and run again)")


@contextmanager
def _locked(run_dir: Path):
    """One writer of view.json at a time (two processes may train the same view)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / ".view.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def planned(sess, origin: str) -> dict:
    """The record of the run `sess` is about to make (weight-free: the digest chain)."""
    K = sess.cfg.train.updates
    return {"run": sess.cfg.run, "origin": origin, "config": config_digest(sess.cfg), "updates": K,
            "complete": False, "steps": [], "runtime": sess.runtime_slice(),
            "digests": {"prepared": sess.prepared, "initial_policy": sess.chain.policy(0),
                        "final_policy": sess.chain.policy(K), "policy0_stage": sess.chain.policy_stage(0),
                        "steps": {str(k): {"rollout": sess.chain.rollout(k), "score": sess.chain.score(k),
                                           "update": sess.chain.update(k)} for k in range(1, K + 1)}}}


def origin_of(sess) -> str:
    """How the session's config was given (the CLI sets it; `overrides` otherwise)."""
    return getattr(sess, "origin", "overrides")


def refuse_other_origin(sess, final) -> None:
    """Before anything is written into the view: a view made the other way (`dvc repro` vs `opd
    run`) by another run (another final policy digest than `final()`) is not replaced silently.
    Called by prepare (before it writes prepare.json) and by train."""
    old, origin = read(sess.run_dir), origin_of(sess)
    if not old or old.get("origin") == origin or not any(sess.run_dir.glob("step-*")):
        return
    if old["digests"]["final_policy"] != final():
        raise UserError(
            f"{sess.run_dir}: holds a run made by {ORIGINS.get(old['origin'], old['origin'])} ({old['updates']} "
            f"updates, another config); this {ORIGINS.get(origin, origin)} run would replace it: give it its "
            f"own name (run=NAME) or remove {sess.run_dir} first")


def begin(sess) -> dict:
    """Claim the view for this run. The same run (same final policy) keeps the view as it is (a
    resumed or repeated run relinks the same steps); another run replaces it, unless the view was
    made the other way (`dvc repro` vs `opd run`): that is refused, naming both."""
    new = planned(sess, origin_of(sess))
    with _locked(sess.run_dir):
        old = read(sess.run_dir)
        if old and old.get("digests", {}).get("final_policy") == new["digests"]["final_policy"]:
            return old
        refuse_other_origin(sess, lambda: new["digests"]["final_policy"])
        write_json(sess.run_dir / VIEW, new)  # the commit point: from here readers see no step of the old run
        _remove_stale(sess.run_dir, keep=set())
        return new


def _remove_stale(run_dir: Path, keep: set[int]) -> None:
    """Move every step dir not in `keep` and the old run's summary files aside, then delete them."""
    aside = run_dir / f".stale-{os.getpid()}"
    aside.mkdir(exist_ok=True)
    for d in run_dir.glob("step-*"):
        if _step_of(d) not in keep:
            os.replace(d, aside / d.name)
    for name in DERIVED:
        if (run_dir / name).exists():
            os.replace(run_dir / name, aside / name)
    for old in run_dir.glob(".stale-*"):  # this one, and any a killed process left behind
        shutil.rmtree(old, ignore_errors=True)


def _step_of(d: Path) -> int | None:
    try:
        return int(d.name.split("-", 1)[1])
    except (IndexError, ValueError):
        return None


def add_step(sess, k: int) -> None:
    """Step k is linked: list it (a no-op when the record already does)."""
    with _locked(sess.run_dir):
        rec = read(sess.run_dir)
        if rec is None or k in rec["steps"]:
            return
        rec["steps"] = sorted(set(rec["steps"]) | {k})
        write_json(sess.run_dir / VIEW, rec)


def finish(sess) -> dict:
    """Every step is linked: the record lists 0..K and is complete."""
    rec = planned(sess, origin_of(sess))
    rec["steps"], rec["complete"] = list(range(rec["updates"] + 1)), True
    with _locked(sess.run_dir):
        old = read(sess.run_dir)
        if old and old.get("origin") and old["digests"]["final_policy"] == rec["digests"]["final_policy"]:
            rec["origin"] = old["origin"]  # the same run, made again the other way: it stays the first one's
        if old != rec:
            write_json(sess.run_dir / VIEW, rec)
    return rec


def check_same_run(sess, what: str) -> None:
    """A stage that writes into the view of a trained run must be of that run's final policy."""
    rec = read(sess.run_dir)
    K = sess.cfg.train.updates
    if rec and rec["digests"]["final_policy"] != sess.chain.policy(K):
        raise UserError(f"{sess.run_dir}: holds another run ({rec['updates']} updates, final policy "
                        f"{rec['digests']['final_policy'][:12]}) than this config's ({K} updates, "
                        f"{sess.chain.policy(K)[:12]}); train this config first or name it (run=NAME) "
                        f"before {what}")


# ---- reading ----

def steps(run_dir: Path) -> list[int]:
    """The steps of the run the view holds: the record's list, else (a view without a record, made
    by an older version) history.csv's steps plus step 0, else every step dir."""
    rec = read(run_dir)
    if rec is not None:
        return sorted(rec["steps"])
    hist = Path(run_dir) / "history.csv"
    if hist.is_file():
        import csv

        with open(hist, newline="") as f:
            ks = [int(r["step"]) for r in csv.DictReader(f) if r.get("step", "").isdigit()]
        return [0, *ks] if (Path(run_dir) / "step-0000").exists() else ks
    return sorted(k for d in Path(run_dir).glob("step-*") if (k := _step_of(d)) is not None)


def step_dir(run_dir: Path, k: int) -> Path:
    return Path(run_dir) / f"step-{k:04d}"


def link_step(sess, k: int) -> None:
    """Step k's published files linked into the view (joining their publishes if in flight), with a
    state.json holding each stage's record: the policy's adapter and moments; from step 1 also the
    rollout, the scores and (a cross-tokenizer run) the spans."""
    d, pol = step_dir(sess.run_dir, k), sess.policy_dir(k)
    sess.store.wait(pol)  # its publish may still be running in the background
    link(pol / "adapter", d / "adapter")
    link(pol / "optimizer.safetensors", d / "optimizer.safetensors")
    state = {"policy": read_state(pol)}
    if k > 0:
        files = {"rollout": (sess.chain.rollout(k), "rollout.parquet"),
                 "score": (sess.chain.score(k), "scores.parquet")}
        if sess.cfg.objective.cross_tokenizer != "off":
            files["align"] = (sess.chain.align(k), "spans.parquet")
        for name, (dig, file) in files.items():
            sd = sess.store.path(name, dig)
            sess.store.wait(sd)
            link(sd / file, d / file)
            state[name] = read_state(sd)
    write_json(d / "state.json", state)


def run_name(spec: str | None) -> str | None:
    """`run=NAME` (the config key, as every command takes it) -> NAME; anything else unchanged."""
    if spec is not None and spec.startswith("run="):
        return spec.split("=", 1)[1]
    return spec


def default_run() -> tuple[str, str]:
    """(run, artifacts) of the config here: ./params.yaml's if there is one (as `dvc repro` uses it),
    else the defaults."""
    p = Path("params.yaml")
    if p.is_file():
        try:
            from omegaconf import OmegaConf

            data = OmegaConf.load(p)
            return str(data.get("run") or "default"), str(data.get("artifacts") or "artifacts")
        except Exception:  # a broken params.yaml is reported by the commands that read it
            pass
    return "default", "artifacts"


def locate(spec: str | None, artifacts: str | None = None) -> Path:
    """The run directory a command is pointed at: NAME or run=NAME (in the artifacts dir), a run
    directory, or nothing (the run of ./params.yaml, else `default`). UserError if there is none."""
    name = run_name(spec)
    default_name, default_artifacts = default_run()
    artifacts = artifacts or default_artifacts
    if name is None:
        name = default_name
    elif not (spec or "").startswith("run=") and Path(name).is_dir() and _is_run_dir(Path(name)):
        return Path(name)
    d = Path(artifacts) / "runs" / name
    if "/" in name or name.startswith(".") or not _is_run_dir(d):  # a name, never a way out of runs/
        known = sorted(x.name for x in (Path(artifacts) / "runs").glob("*") if _is_run_dir(x))
        hint = f"; runs here: {', '.join(known)}" if known else "; run `opd run` or `dvc repro` first"
        raise UserError(f"run {name!r}: {d} is not a run directory{hint}")
    return d


def ranges(ks: list[int]) -> str:
    """[1, 2, 3, 5] -> 'steps 1-3, 5'; [4] -> 'step 4'."""
    parts, start = [], None
    for i, k in enumerate(ks):
        start = k if start is None else start
        if i + 1 == len(ks) or ks[i + 1] != k + 1:
            parts.append(f"{start}-{k}" if k > start else str(k))
            start = None
    return ("steps " if len(ks) > 1 else "step ") + ", ".join(parts)


def _is_run_dir(p: Path) -> bool:
    return p.is_dir() and any((p / f).exists() for f in (VIEW, "history.csv", "step-0000", "step-0001"))
