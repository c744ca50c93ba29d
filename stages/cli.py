"""`opd`: the command line. Every command takes Hydra overrides (composed from conf/) or --params FILE.

Pipeline (dvc.yaml's stages; `opd run` runs them all without DVC):
    opd params [overrides]              compose conf/ (+ overrides) into params.yaml, as `dvc exp run -S` does
    opd run [overrides]                 prepare, train, evaluate, export; `--plan plan.json [--dry-run]` runs a plan
    opd stage NAME [overrides]          one DVC stage: prepare | train | evaluate | export | report
    opd stage rollout|score|update --step N    one step's stage of train (earlier steps run first if needed)
    opd stage export [--out DIR] [--merged]    the PEFT export of the run the view records (+ a merged model)
    opd stage export --verl OUT                a verl 0.8 bundle with a launchability report
    opd dvc-yaml [--check]              dvc.yaml's params and deps from the stages' declared reads
Tools:
    opd inspect FILE [--step/--uid/--worst N/--format json]
    opd report RUN [--out report.html]  one self-contained HTML page of any run: config, curves, phases, eval
    opd tooleval [--step N]             greedy held-out tool-use episodes of policy N (env.name set)
    opd benchmark tooluse CONFIG        tool-use arms x seeds, equal update budget (conf/benchmark/*.yaml)
    opd benchmark systems [...]         ours and the peers side by side (benchmarks/systems.py, GPU)
    opd doctor [overrides]              versions, CUDA, embedded model, artifacts dir; exit 1 on a blocker
    opd store du|gc [--yes]             the store's size per stage kind and per run; remove what no run reaches
    opd plan [overrides] [--out F]      weight-free memory plan per phase and placement; --probe measures (CUDA)
    opd plan --profile P --config C     a verl v0.8 OPD config mapped onto ours (+ memory plan) -> plan.json
    opd profiles list|show NAME         the verl OPD profiles; `opd compat explain FIELD|table`: the mapping
    opd data sample --out F [--rows N]  a verl-schema prompt Parquet from the prompt generator
"""
from __future__ import annotations

import argparse
import errno
import signal
import sys
from pathlib import Path

from .run.pipeline import STAGES, STEPS
from .tools.process import process_settings, quiet_libraries

from .errors import EXIT_NO_SPACE, Interrupted, UserError, install_signal_handlers

# Old spellings: a one-line error naming the command that does the job now.
MOVED = {
    ("export",): "opd stage export [--out DIR] [--merged] | opd stage export --verl OUT",
    ("bench",): "opd benchmark systems",
    ("stage", "init"): "opd stage train (policy 0 is its first stage; `opd tooleval --step 0` publishes it alone)",
    ("stage", "sft"): "opd stage train (it publishes the SFT cold start and the protocol_sft teacher adapter first; "
                      "`opd tooleval --step 0` publishes and evaluates the cold start alone)",
    ("stage", "tooleval"): "opd tooleval",
}


def moved(argv: list[str]) -> str | None:
    """The error for an old spelling, or None."""
    for old, new in MOVED.items():
        if tuple(argv[:len(old)]) == old:
            return f"`opd {' '.join(old)}` is now `{new}`"
    if argv[:1] == ["benchmark"] and len(argv) > 1 and argv[1] not in ("tooluse", "systems", "-h", "--help"):
        return "`opd benchmark CONFIG` is now `opd benchmark tooluse CONFIG`"
    return None


def _config(args):
    from .run import config

    if getattr(args, "plan", None) is not None:  # the config of a verified plan (`opd plan --profile`)
        from .verl import planfile

        if args.overrides or args.params:
            raise UserError("--plan: the plan fixes the config; give no overrides or --params (plan again instead)")
        return planfile.load(args.plan, config.conf_dir())[1]
    return config.from_args(args.params, args.overrides)


def _session(args):
    from . import train

    # how the config was given: a view `dvc repro` made (--params) is not silently taken over by an
    # `opd run` with other overrides, nor the reverse (stages/run/runview.py)
    return train.session(_config(args), origin=_origin(args))


def _origin(args) -> str:
    return "params" if getattr(args, "params", None) else "overrides"


def cmd_params(args) -> None:
    from .run import config

    config.write_params(args.overrides, args.out, config.conf_dir())
    print(f"wrote {args.out}" + (" (for `dvc repro`; `dvc exp run -S` composes conf/ afresh and does not keep "
                                 "these overrides: pass them all to -S)" if args.overrides else ""))


def cmd_run(args) -> None:
    from . import evaluate, export, prepare, train

    if getattr(args, "plan", None) is not None or getattr(args, "dry_run", False):
        from .verl.cli import plan_session  # `opd run --plan plan.json` (opd plan --profile)

        sess = plan_session(args)
        if sess is None:  # --dry-run
            return
    else:
        from .memory import plan

        cfg = _config(args)
        # CPU: the memory plan before prepare reads or writes any weights; a run past the host memory available
        # is refused here (stages/memory/plan.py `preflight`). CUDA, or shapes not readable yet (a model not
        # fetched): the session decides at its first model load, as for every command
        planned = plan.preflight(cfg)
        sess = train.session(cfg, planned[0] if planned else None, origin=_origin(args))
    prepare.main(sess)
    train.main(sess)
    evaluate.main(sess)
    export.main(sess)


def cmd_stage(args) -> None:
    from . import evaluate, prepare, rollout, score, train, update
    from . import report

    name, k = args.name, args.step
    if name in STEPS and k is None:
        raise UserError(f"opd stage {name} needs --step N (1..train.updates)")
    if name not in STEPS and k is not None:
        raise UserError(f"opd stage {name}: --step is for {', '.join(STEPS)}")
    if name != "export" and (args.out is not None or args.verl is not None or args.merged):
        raise UserError(f"opd stage {name}: --out, --merged and --verl are for export")
    if name == "report":  # reads the run view only: no models, no session
        cfg = _config(args)
        run_dir = report.locate(cfg.run, cfg.artifacts)
        print(f"report: {report.write(run_dir, run_dir / 'report.html')}")
        return
    if name == "export":
        _export(args)
        return
    sess = _session(args)
    if name == "align" and sess.cfg.objective.cross_tokenizer == "off":
        raise UserError("opd stage align: a cross-tokenizer run's stage; objective.cross_tokenizer is 'off'")
    if name == "prepare":
        prepare.main(sess)
    elif name == "train":
        train.main(sess)
    elif name == "evaluate":
        from .run import runview

        runview.check_same_run(sess, "evaluating it")  # before training for it, not after
        train.ensure_policy(sess, sess.cfg.train.updates)
        evaluate.main(sess)
    else:  # one step: the earlier steps are published first
        train.ensure_policy(sess, k - 1)
        d = rollout.run(sess, k)
        if name == "align" or (name != "rollout" and sess.cfg.objective.cross_tokenizer != "off"):
            from . import align

            d = align.run(sess, k)
        if name not in ("rollout", "align"):
            d = score.run(sess, k)
            d = d if name == "score" else update.run(sess, k)
        # (CUDA publishes on a worker thread: joined before the path is printed, its error raised)
        sess.store.flush()
        print(f"{name} step {k}: {d / 'rollout.parquet'}" if name == "rollout" else d)


def _export(args) -> None:
    """`opd stage export`: the PEFT export of the run the view recorded, or (--verl) a verl bundle."""
    from . import export, train
    from .session import Session

    cfg, origin = _config(args), _origin(args)
    if args.verl is None:
        # the final policy the run view recorded: no prepare (it would rewrite the view's prepare.json
        # for the config given, which only names the run), nothing computed
        sess = Session(cfg, origin=origin)
        export.check_selection(sess, args.overrides)
        export.main(sess, args.out, args.merged)
        return
    from .verl import bundle

    sess = train.session(cfg, origin=origin)
    # verl continues the run from its last published update (a warm start of the rest): only
    # policy 0 may need publishing first
    bundle.preflight(sess, bundle.cluster_of(args))  # bad numbers or model folders: refused before any training
    train.ensure_policy(sess, bundle.published(sess))
    bundle.main(sess, args.verl, args)


def cmd_tooleval(args) -> None:
    from . import tooleval, train

    sess = _session(args)
    if sess.cfg.env.name is None:
        raise UserError("opd tooleval needs a tool environment; set env.name")
    k = sess.cfg.train.updates if args.step is None else args.step
    train.ensure_policy(sess, k)
    tooleval.main(sess, k)


def cmd_inspect(args) -> None:
    from .tools import inspection

    inspection.main(args)


def cmd_benchmark(args) -> None:
    from .tools import benchmark

    benchmark.main(args.config, args.arm, args.seed, args.result)


def cmd_benchmark_systems(args) -> None:
    """`opd benchmark systems [--workload ...]`: the driver in benchmarks/systems.py (a repo checkout)."""
    import runpy

    from .run.config import ROOT

    driver = ROOT / "benchmarks" / "systems.py"
    if not driver.is_file():
        raise UserError(f"{driver}: not found; `opd benchmark systems` runs from a checkout of the repository")
    sys.argv = [str(driver), *args.overrides]
    runpy.run_path(str(driver), run_name="__main__")


def cmd_report(args) -> None:
    from . import report

    report.main(args)


def cmd_plan(args) -> None:
    from .tools import planview

    planview.main(args)


def cmd_dvc_yaml(args) -> None:
    from .tools import dvcyaml

    dvcyaml.main(args)


def cmd_store(args) -> None:
    from .tools import storeview

    storeview.main(args)


def cmd_doctor(args) -> None:
    from .tools import doctor

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
    p = sub.add_parser("stage", help="run one DVC stage, or one step's rollout/score/update")
    p.add_argument("name", choices=STAGES + STEPS, metavar="NAME",
                   help=f"a DVC stage ({', '.join(STAGES)}) or one step's {', '.join(STEPS)}")
    with_cfg(p)
    p.add_argument("--step", type=int, help="rollout/score/update: the step K (1..train.updates)")
    p.add_argument("--out", type=Path, help="export: output dir (default artifacts/export/RUN)")
    p.add_argument("--merged", action="store_true", help="export: also write merged/, a standalone model with the "
                   "LoRA merged in (AutoModelForCausalLM, pipeline)")
    p.add_argument("--verl", type=Path, metavar="OUT", help="export: write a verl 0.8 bundle to OUT instead")
    p.add_argument("--plan", type=Path, help="the config of a plan.json from `opd plan --profile`")
    from .verl.cli import bundle_arguments  # export --verl: the cluster it is sized for (--gpus ...)

    bundle_arguments(p)
    p.set_defaults(fn=cmd_stage)
    p = with_cfg(sub.add_parser("tooleval", help="greedy held-out tool-use episodes of one policy (env.name set)"))
    p.add_argument("--step", type=int, help="the policy version (default train.updates)")
    p.set_defaults(fn=cmd_tooleval, plan=None)
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
    p = sub.add_parser("store", help="the store: size per stage kind and per run (du), remove what no run reaches (gc)")
    ssub = p.add_subparsers(dest="action", required=True)
    for name, what in (("du", "size per stage kind and in total, and what each run view reaches"),
                       ("gc", "list the stages no run view reaches; remove them with --yes")):
        q = ssub.add_parser(name, help=what)
        q.add_argument("--artifacts", help="artifacts dir (default: params.yaml's, else ./artifacts)")
        q.add_argument("--format", choices=("text", "json"), default="text", help="json: for scripts (default text)")
        if name == "gc":
            q.add_argument("--yes", action="store_true", help="remove them (without it: a dry run that lists them)")
            q.add_argument("--min-age", type=float, default=1440, metavar="MIN", help="keep stages published in "
                           "the last MIN minutes: a running `opd stage STEP` or a starting run may not name "
                           "them in a view yet (default 1440, a day)")
        q.set_defaults(fn=cmd_store)
    p = sub.add_parser("dvc-yaml", help="write dvc.yaml from the stages' declared reads (--check: compare only)")
    p.add_argument("--check", action="store_true", help="exit 1 if dvc.yaml differs from the declarations")
    p.add_argument("--file", help="the dvc.yaml to write or check (default: the checkout's)")
    p.set_defaults(fn=cmd_dvc_yaml)
    p = sub.add_parser("benchmark", help="benchmarks: tool-use arms x seeds, or systems side by side with the peers")
    bsub = p.add_subparsers(dest="kind", required=True)
    p = bsub.add_parser("tooluse", help="tool-use arms x seeds with an equal update budget (JSON + Markdown)")
    p.add_argument("config", help="a benchmark YAML, e.g. conf/benchmark/tooluse.yaml")
    # internal: the harness runs each (arm, seed) in its own process through these
    p.add_argument("--arm", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.set_defaults(fn=cmd_benchmark)
    p = bsub.add_parser("systems", help="ours and the peers side by side (GPU; benchmarks/systems.py; its options "
                        "follow)", add_help=False)
    p.set_defaults(fn=cmd_benchmark_systems, overrides=[])  # every further argument goes to the driver
    from .verl.cli import add_commands  # plan --profile, profiles, compat, data

    add_commands(sub, with_cfg)
    verbose = "show third-party notices and progress bars (quiet by default)"
    ap.add_argument("-v", "--verbose", action="store_true", help=verbose)
    # also after the command: `opd run --verbose ...`; `opd benchmark systems` passes its arguments to its driver
    for sp in [*sub.choices.values(), bsub.choices["tooluse"]]:
        if "--verbose" not in sp._option_string_actions:
            sp.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=verbose)
    return ap



def main(argv: list[str] | None = None) -> int:
    process_settings()
    # before the parser is built: building it imports the libraries, and tqdm and the hub read their
    # progress-bar switches when imported
    argv = sys.argv[1:] if argv is None else list(argv)
    if (why := moved([a for a in argv if a not in ("-v", "--verbose")])) is not None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    quiet_libraries("-v" in argv or "--verbose" in argv)
    ap = build_parser()
    # overrides may follow options (`opd stage score --step 2 k=v`): collect the leftovers
    args, extra = ap.parse_known_args(argv)
    if args.cmd is None:  # bare `opd`: the overview of commands
        if extra:
            ap.error(f"unrecognized arguments: {' '.join(extra)}")
        ap.print_help()
        return 0
    if extra and args.fn is cmd_benchmark_systems:
        args.overrides = extra
    elif extra:
        if any(x.startswith("-") for x in extra) or not hasattr(args, "overrides"):
            ap.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = list(args.overrides or []) + extra
    restore = install_signal_handlers()
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


if __name__ == "__main__":
    sys.exit(main())
