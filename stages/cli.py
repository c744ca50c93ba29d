"""`opd`: the command line. Every command takes Hydra overrides (composed from conf/) or --params FILE.

    opd params [overrides]              compose conf/ (+ overrides) into params.yaml, as `dvc exp run -S` does
    opd run [overrides]                 the whole pipeline without DVC: prepare, train, evaluate, export
    opd stage NAME [--step N] [...]     one stage (prepare|init|rollout|score|update|train|evaluate|export)
    opd inspect FILE [--step/--uid/--worst N/--format json]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .errors import UserError

STAGES = ("prepare", "init", "rollout", "score", "update", "train", "evaluate", "export")


def _config(args):
    from . import config

    if args.params:
        if args.overrides:
            raise UserError("give either --params FILE or overrides, not both")
        return config.load(args.params)
    conf_dir = Path.cwd() / "conf" if (Path.cwd() / "conf" / "config.yaml").exists() else None
    return config.compose(args.overrides, conf_dir)


def _session(args):
    from .session import Session

    return Session(_config(args))


def cmd_params(args) -> None:
    from . import config

    conf_dir = Path.cwd() / "conf" if (Path.cwd() / "conf" / "config.yaml").exists() else None
    config.write_params(args.overrides, args.out, conf_dir)
    print(f"wrote {args.out}")


def cmd_run(args) -> None:
    from . import evaluate, export, prepare, train

    sess = _session(args)
    prepare.main(sess)
    train.main(sess)
    evaluate.main(sess)
    export.main(sess)


def cmd_stage(args) -> None:
    from . import evaluate, export, prepare, rollout, score, train, update

    sess = _session(args)
    name, k = args.name, args.step
    if name in ("rollout", "score", "update") and k is None:
        raise UserError(f"opd stage {name} needs --step N (1..train.updates)")
    if name == "prepare":
        prepare.main(sess)
    elif name == "init":
        print(update.init(sess))
    elif name == "rollout":
        rollout.main(sess, k)
    elif name == "score":
        train.ensure_policy(sess, k - 1)
        rollout.run(sess, k)
        print(score.run(sess, k))
    elif name == "update":
        train.ensure_policy(sess, k - 1)
        rollout.run(sess, k)
        score.run(sess, k)
        print(update.run(sess, k))
    elif name == "train":
        train.main(sess)
    elif name == "evaluate":
        evaluate.main(sess)
    elif name == "export":
        export.main(sess, args.out)


def cmd_inspect(args) -> None:
    from . import inspection

    inspection.main(args)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="opd", description="On-policy distillation as content-addressed stages")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def with_cfg(p):
        p.add_argument("--params", help="a composed params file (e.g. params.yaml) instead of conf/ + overrides")
        p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. train.updates=4 objective.topk=16")
        return p

    p = sub.add_parser("params", help="compose conf/ (+ overrides) into params.yaml")
    p.add_argument("--out", default="params.yaml")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(fn=cmd_params)
    with_cfg(sub.add_parser("run", help="run the whole pipeline without DVC")).set_defaults(fn=cmd_run)
    p = sub.add_parser("stage", help="run one stage")
    p.add_argument("name", choices=STAGES)
    with_cfg(p)
    p.add_argument("--step", type=int)
    p.add_argument("--out", type=Path, help="export: output dir")
    p.set_defaults(fn=cmd_stage)
    p = sub.add_parser("inspect", help="print trajectories of a rollout/scores Parquet or a run step")
    p.add_argument("path", help="rollout.parquet, scores.parquet, a step dir or a run dir")
    p.add_argument("--step", type=int)
    p.add_argument("--uid")
    p.add_argument("--worst", type=int, help="the N trajectories with the largest mean teacher-student gap")
    p.add_argument("--limit", type=int, default=4)
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.set_defaults(fn=cmd_inspect)
    return ap


def _quiet_libraries() -> None:
    import os
    import warnings

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*gemm_4bit.*")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    # overrides may follow options (`opd stage score --step 2 k=v`): collect the leftovers
    args, extra = ap.parse_known_args(argv)
    if extra:
        if any(x.startswith("-") for x in extra) or not hasattr(args, "overrides"):
            ap.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = list(args.overrides or []) + extra
    _quiet_libraries()
    try:
        args.fn(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted: published stages are kept; run the same command again to resume", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
