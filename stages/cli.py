"""`opd`: the command line. Every command takes Hydra overrides (composed from conf/) or --params FILE.

    opd params [overrides]              compose conf/ (+ overrides) into params.yaml, as `dvc exp run -S` does
    opd run [overrides]                 the whole pipeline without DVC: prepare, train, evaluate, export
    opd stage NAME [--step N] [...]     one stage (prepare|init|rollout|score|update|train|evaluate|export)
    opd inspect FILE [--step/--uid/--worst N/--format json]
    opd benchmark CONFIG                tool-use arms x seeds, equal update budget (conf/benchmark/*.yaml)
    opd report RUN [--out report.html]  one self-contained HTML page: config, curves, phases, trajectories, eval
    opd dvc-yaml [--check]              dvc.yaml's params and deps from the stages' declared reads
    opd doctor [overrides]              versions, CUDA, embedded model, artifacts dir; exit 1 on a blocker
    opd plan [overrides] [--out F]      weight-free memory plan per phase and placement; --probe measures (CUDA)
    opd plan --profile P --config C     a verl v0.8 OPD config mapped onto ours (+ memory plan) -> plan.json;
                                        `opd run --plan plan.json [--dry-run]` runs it (stages/verl/cli.py)
    opd profiles list|show NAME         the verl OPD profiles; `opd compat explain FIELD|table`: the mapping
    opd export [--verl OUT]             the PEFT export, or a verl 0.8 bundle with a launchability report
    opd data sample --out F [--rows N]  a verl-schema prompt Parquet from the prompt generator
"""
from __future__ import annotations

import argparse
import errno
import re
import signal
import sys
import threading
from pathlib import Path

from .errors import EXIT_NO_SPACE, Interrupted, UserError

STAGES = ("prepare", "init", "rollout", "score", "update", "train", "evaluate", "export", "sft", "tooleval")


def _session(args):
    from . import config, train

    # how the config was given: a view `dvc repro` made (--params) is not silently taken over by an
    # `opd run` with other overrides, nor the reverse (stages/runview.py)
    return train.session(config.from_args(args.params, args.overrides), origin=_origin(args))


def _origin(args) -> str:
    return "params" if getattr(args, "params", None) else "overrides"


def cmd_params(args) -> None:
    from . import config

    config.write_params(args.overrides, args.out, config.conf_dir())
    print(f"wrote {args.out}")


def cmd_run(args) -> None:
    from . import evaluate, export, prepare, train

    if getattr(args, "plan", None) is not None or getattr(args, "dry_run", False):
        from .verl.cli import plan_session  # `opd run --plan plan.json` (opd plan --profile)

        sess = plan_session(args)
        if sess is None:  # --dry-run
            return
    else:
        sess = _session(args)
    prepare.main(sess)
    train.main(sess)
    evaluate.main(sess)
    export.main(sess)


def cmd_stage(args) -> None:
    from . import evaluate, prepare, rollout, score, tooleval, train, update

    name, k = args.name, args.step
    if name in ("rollout", "score", "update") and k is None:
        raise UserError(f"opd stage {name} needs --step N (1..train.updates)")
    if name == "export":  # one export, whichever verb: `opd export` (stages/verl/cli.py)
        from .verl.cli import cmd_export

        cmd_export(args)
        return
    sess = _session(args)
    if name == "prepare":
        prepare.main(sess)
    elif name == "init":
        print(update.init(sess))
    elif name == "rollout":
        train.ensure_policy(sess, k - 1)
        print(f"rollout step {k}: {rollout.run(sess, k) / 'rollout.parquet'}")
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
        train.ensure_policy(sess, sess.cfg.train.updates)
        evaluate.main(sess)
    elif name == "sft":  # the student's cold start; the protocol_sft teacher adapter when configured
        cfg = sess.cfg
        if cfg.env.name is None or not (cfg.sft.steps or cfg.teacher_mode == "protocol_sft"):
            raise UserError("opd stage sft needs env.name and sft.steps > 0 (cold start) or teacher_mode=protocol_sft")
        train.policy0(sess)
        if cfg.sft.steps:
            print(f"sft cold start (policy 0): {sess.policy_dir(0)}")
        if cfg.teacher_mode == "protocol_sft":
            print(f"sft teacher adapter: {sess.store.path('sft', sess.chain.teacher_adapter())}")
    elif name == "tooleval":  # greedy held-out episodes of policy --step N (default train.updates)
        if sess.cfg.env.name is None:
            raise UserError("opd stage tooleval needs a tool environment; set env.name")
        k = sess.cfg.train.updates if k is None else k
        train.ensure_policy(sess, k)
        tooleval.main(sess, k)


def cmd_inspect(args) -> None:
    from . import inspection

    inspection.main(args)


def cmd_benchmark(args) -> None:
    from . import benchmark

    benchmark.main(args.config, args.arm, args.seed, args.result)


def cmd_bench(args) -> None:
    """`opd bench systems [--workload ...]`: the driver in benchmarks/systems.py (a repo checkout)."""
    import runpy

    from .config import ROOT

    driver = ROOT / "benchmarks" / "systems.py"
    if not driver.is_file():
        raise UserError(f"{driver}: not found; `opd bench` runs from a checkout of the repository")
    sys.argv = [str(driver), *args.overrides]
    runpy.run_path(str(driver), run_name="__main__")


def cmd_report(args) -> None:
    from . import report

    report.main(args)


def cmd_plan(args) -> None:
    from . import planview

    planview.main(args)


def cmd_dvc_yaml(args) -> None:
    from . import dvcyaml

    dvcyaml.main(args)


def cmd_doctor(args) -> None:
    from . import doctor

    code = doctor.main(args)
    if code:
        raise SystemExit(code)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="opd", description="On-policy distillation as content-addressed stages",
                                 epilog="`opd COMMAND -h` lists a command's options; README.md has the quick start.")
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND")

    def with_cfg(p):
        p.add_argument("--params", help="a composed params file (e.g. params.yaml) instead of conf/ + overrides")
        p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. train.updates=4 objective.topk=16")
        return p

    p = sub.add_parser("params", help="compose conf/ (+ overrides) into params.yaml")
    p.add_argument("--out", default="params.yaml", help="the file to write (default params.yaml, what dvc.yaml reads)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. train.updates=4 objective.topk=16")
    p.set_defaults(fn=cmd_params)
    p = with_cfg(sub.add_parser("run", help="run the whole pipeline without DVC"))
    p.add_argument("--plan", type=Path, help="run a plan.json from `opd plan --profile` (refused if edited)")
    p.add_argument("--dry-run", action="store_true", help="with --plan: show what would run, run nothing")
    p.set_defaults(fn=cmd_run)
    p = sub.add_parser("stage", help="run one stage")
    p.add_argument("name", choices=STAGES, metavar="NAME", help=f"the stage: {', '.join(STAGES)}")
    with_cfg(p)
    p.add_argument("--step", type=int, help="rollout/score/update: the step K (1..train.updates); tooleval: the "
                   "policy version (default train.updates)")
    p.add_argument("--out", type=Path, help="export: output dir (default artifacts/export/RUN)")
    p.add_argument("--merged", action="store_true", help="export: also write merged/, a standalone model with the "
                   "LoRA merged in (AutoModelForCausalLM, pipeline)")
    p.add_argument("--verl", type=Path, metavar="OUT", help="export: write a verl 0.8 bundle to OUT instead")
    from .verl.cli import bundle_arguments  # export --verl: the cluster it is sized for (--gpus ...)

    bundle_arguments(p)
    p.set_defaults(fn=cmd_stage)
    p = sub.add_parser("inspect", help="print trajectories of a run, a step or a rollout/scores Parquet")
    p.add_argument("path", nargs="?", metavar="RUN", help="a run (NAME, run=NAME or its dir; default: the run of "
                   "./params.yaml, else 'default'), a step dir, or a rollout/scores Parquet")
    p.add_argument("--step", type=int, help="the run's step N (default: its last; --worst searches every step, "
                   "--uid its own)")
    p.add_argument("--uid", help="one trajectory by uid, e.g. s0003-p00001-0 (step, prompt, sample)")
    p.add_argument("--worst", type=int, help="the N trajectories with the largest mean teacher-student gap")
    p.add_argument("--limit", type=int, default=4, help="trajectories shown without --uid/--worst (default 4)")
    p.add_argument("--format", choices=("text", "json"), default="text", help="json: for scripts (default text)")
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("report", help="write one self-contained HTML report of a run")
    p.add_argument("run", nargs="?", metavar="RUN", help="a run (NAME, run=NAME or its dir; default: the run of "
                   "./params.yaml, else 'default')")
    p.add_argument("--out", help="output file (default: the run dir's report.html)")
    p.add_argument("--samples", type=int, default=3, help="trajectories shown per sampled step")
    p.add_argument("--artifacts", help="artifacts dir (default: params.yaml's, else ./artifacts)")
    p.set_defaults(fn=cmd_report)
    p = with_cfg(sub.add_parser("plan", help="weight-free memory plan: peak per phase and placement, fits or not"))
    p.add_argument("--out", help="also write the plan as JSON (e.g. plan.json)")
    p.add_argument("--probe", action="store_true", help="CUDA: measure one bounded step (no optimizer update)")
    p.set_defaults(fn=cmd_plan)
    p = with_cfg(sub.add_parser("doctor", help="check this machine: versions, CUDA, embedded model, artifacts dir"))
    p.add_argument("--format", choices=("text", "json"), default="text", help="json: for scripts (default text)")
    p.set_defaults(fn=cmd_doctor)
    p = sub.add_parser("dvc-yaml", help="write dvc.yaml from the stages' declared reads (--check: compare only)")
    p.add_argument("--check", action="store_true", help="exit 1 if dvc.yaml differs from the declarations")
    p.add_argument("--file", help="the dvc.yaml to write or check (default: the checkout's)")
    p.set_defaults(fn=cmd_dvc_yaml)
    p = sub.add_parser("benchmark", help="tool-use arms x seeds with an equal update budget (JSON + Markdown)")
    p.add_argument("config", help="a benchmark YAML, e.g. conf/benchmark/tooluse.yaml")
    # internal: the harness runs each (arm, seed) in its own process through these
    p.add_argument("--arm", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.set_defaults(fn=cmd_benchmark)
    p = sub.add_parser("bench", help="systems benchmarks: ours and the peers side by side (GPU)",
                       add_help=False)
    p.add_argument("which", choices=("systems",), help="systems (benchmarks/systems.py; its options follow)")
    p.set_defaults(fn=cmd_bench, overrides=[])  # every further argument goes to the driver
    from .verl.cli import add_commands  # plan, profiles, compat, export, data

    add_commands(sub, with_cfg)
    verbose = "show third-party notices and progress bars (quiet by default)"
    ap.add_argument("-v", "--verbose", action="store_true", help=verbose)
    for name, sp in sub.choices.items():  # also after the command: `opd run --verbose ...`
        if name != "bench" and "--verbose" not in sp._option_string_actions:
            sp.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=verbose)
    return ap


# Third-party notices known to be harmless here, each silenced by its own text (and nothing else):
# - bitsandbytes, at import on an AVX512-BF16 CPU: an optional kernel package is absent (it falls back
#   to its own kernel; we never need the other)
# - transformers' `is_gradient_checkpointing` deprecation: PEFT calls it, not our code
QUIET_LOGS = {"bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community"}
QUIET_WARNINGS = [(FutureWarning, "`is_gradient_checkpointing` is deprecated")]


def _quiet_libraries(verbose: bool = False) -> None:
    """Without --verbose: the notices above are dropped, and third-party progress bars (the embedded
    model's GGUF dequantisation, weight loading, hub) are off; ours show on a terminal only."""
    import logging
    import os
    import warnings

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if verbose:
        return
    for name, text in QUIET_LOGS.items():
        logging.getLogger(name).addFilter(lambda r, text=text: not r.getMessage().startswith(text))
    for category, text in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(text), category=category)
    # tqdm reads TQDM_* at import: the GGUF conversion bar (tqdm.auto, not transformers' switch) stays off
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # `opd doctor` reports a missing transformers itself
        return
    hf_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    # before the parser is built: building it imports the libraries, and tqdm and the hub read their
    # progress-bar switches when imported
    argv = sys.argv[1:] if argv is None else list(argv)
    _quiet_libraries("-v" in argv or "--verbose" in argv)
    ap = build_parser()
    # overrides may follow options (`opd stage score --step 2 k=v`): collect the leftovers
    args, extra = ap.parse_known_args(argv)
    if args.cmd is None:  # bare `opd`: the overview of commands
        if extra:
            ap.error(f"unrecognized arguments: {' '.join(extra)}")
        ap.print_help()
        return 0
    if extra and args.fn is cmd_bench:
        args.overrides = extra
    elif extra:
        if any(x.startswith("-") for x in extra) or not hasattr(args, "overrides"):
            ap.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = list(args.overrides or []) + extra
    restore = _install_signal_handlers()
    try:
        args.fn(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        print(f"interrupted by {signal.Signals(signum).name}: the stage in flight was abandoned, published "
              "stages are kept; run the same command again to resume", file=sys.stderr)
        return 128 + signum
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(f"error: no space left on device writing {e.filename or '?'}; nothing half-written was "
              "published: free space and run the same command again", file=sys.stderr)
        return EXIT_NO_SPACE
    finally:
        restore()
    return 0


def _install_signal_handlers():
    """SIGTERM/SIGINT raise Interrupted in the main thread (once; later ones are ignored so the
    abandoned stage's cleanup finishes). Returns a function restoring the previous handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    sigs = (signal.SIGTERM, signal.SIGINT)
    old = {s: signal.getsignal(s) for s in sigs}

    def handler(signum, frame):
        for s in sigs:
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(signum)

    for s in sigs:
        signal.signal(s, handler)
    return lambda: [signal.signal(s, h) for s, h in old.items()]


if __name__ == "__main__":
    sys.exit(main())
