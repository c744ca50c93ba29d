"""The verl-facing commands, registered on `opd`'s parser by stages/cli.py:

    opd plan --profile NAME --config FILE|builtin:PAIR [--set k=v ...] [--accept FIELD|all ...]
             [--out plan.json] [overrides]
    opd run --plan plan.json [--dry-run]            (the run subcommand's options; see plan_session)
    opd profiles list | show NAME
    opd compat explain FIELD | table [--out docs/compat.md]
    opd data sample --format verl-parquet --out FILE [--rows N] [overrides]
    opd data reasoning-gym NAME --size N --seed S --out FILE [--test-fraction F]

`opd plan` without --profile is the weight-free memory plan (stages/memory/plan.py); with --profile it maps
the verl config first, then plans memory. The verl bundle is `opd stage export --verl OUT [--gpus N
--nodes M --teacher-gpus T --teacher-tp K --gpu-gib G]` (stages/cli.py; its options: bundle_arguments).
"""
from __future__ import annotations

import sys
from pathlib import Path

from ..errors import UserError

# Each command imports what it runs when it runs (docs/architecture.md, "Dependency direction"):
# building `opd`'s parser imports this module, and `opd --help` needs none of them (torch among them).


def cmd_plan(args) -> None:
    from ..run import config
    from ..memory import plan as memory_planner
    from ..tools import planview
    from . import planfile

    if args.profile is None:
        if args.config or args.set or args.accept:
            raise UserError("opd plan: --config, --set and --accept need --profile NAME")
        memory_plan_cli(args)
        return
    if not args.config:
        raise UserError("opd plan --profile: --config FILE|builtin:PAIR is required")
    if getattr(args, "params", None):
        raise UserError("opd plan --profile: the profile composes the config; --params cannot be combined with it")
    plan = planfile.make(args.profile, args.config, args.set or [], args.accept or [], args.overrides or [],
                         config.conf_dir(), probe=bool(getattr(args, "probe", False)))
    out = planfile.write(plan, Path(args.out or "plan.json"))
    c = plan["mapping"]["counts"]
    mem = plan["memory"]
    planview.render(mem)
    print(f"plan: {out} (profile {args.profile}; {c['exact']} exact, {c['reinterpreted']} reinterpreted, "
          f"{c['ignored-informational']} informational fields; memory: {plan['memory_status']})")
    if not mem["feasible"]:
        raise UserError(memory_planner.infeasible_message(mem))


def memory_plan_cli(args) -> None:
    """`opd plan [overrides] [--out plan.json]` is the memory planner's command."""
    from ..tools import planview

    planview.main(args)


def plan_session(args):
    """`opd run --plan`: the Session of a verified plan; None for --dry-run (after printing it)."""
    from .. import train
    from ..run import config
    from . import planfile

    if args.plan is None:
        raise UserError("opd run --dry-run needs --plan plan.json")
    if args.overrides or args.params:
        raise UserError("opd run --plan: the plan fixes the config; give no overrides or --params "
                        "(plan again with them instead)")
    plan, cfg = planfile.load(args.plan, config.conf_dir())
    if args.dry_run:
        c = plan["mapping"]["counts"]
        print(f"plan {args.plan}: profile {plan['profile']}, config {plan['config']}, digest {plan['digest'][:16]}")
        print(f"  verl fields: {c['exact']} exact, {c['reinterpreted']} reinterpreted, "
              f"{c['ignored-informational']} informational")
        print(f"  student {cfg.student.name}, teacher {cfg.teacher.name}, objective {cfg.objective.name}, "
              f"{cfg.train.updates} updates x {cfg.rollout.batch_size} prompts x {cfg.rollout.n} samples")
        print(f"  memory: {plan['memory_status']}")
        print(f"  would run: prepare, train, evaluate, export (run '{cfg.run}', artifacts '{cfg.artifacts}'); "
              "nothing was run")
        return None
    return train.session(cfg)


def cmd_profiles(args) -> None:
    from . import compat

    if args.action == "list":
        print(compat.profiles_list())
    else:
        if not args.name:
            raise UserError("opd profiles show NAME: a profile name is required")
        print(compat.profile_show(args.name), end="")


def cmd_compat(args) -> None:
    from . import compat

    if args.action == "explain":
        if not args.field:
            raise UserError("opd compat explain FIELD: a field is required")
        print(compat.explain(args.field))
    else:
        text = compat.table_markdown()
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(text)
            print(f"wrote {args.out}")
        else:
            sys.stdout.write(text)


def cmd_data(args) -> None:
    from ..run import config
    from ..rows import verl_rows as data

    if args.format != "verl-parquet":
        raise UserError(f"--format {args.format!r}: expected verl-parquet")
    out = data.sample(config.from_args(args.params, args.overrides), args.rows, Path(args.out))
    print(f"wrote {out} ({args.rows} rows, verl schema)")


def cmd_data_tasks(args) -> None:
    """`opd data reasoning-gym`: a reasoning-gym dataset as verl rows its own checker scores (rows/taskdata.py)."""
    from ..rows import taskdata

    out, n = taskdata.write(args.name, args.size, args.seed, Path(args.out), args.test_fraction)
    print(f"wrote {out} ({n['train']} train, {n['test']} test rows, verl schema; data_source and checker "
          f"reasoning_gym/{args.name})")


def bundle_arguments(p) -> None:
    """The cluster a verl bundle is sized for (stages/verl/sizing.py): `opd stage export --verl`."""
    g = p.add_argument_group("verl bundle sizing (with --verl)")
    g.add_argument("--gpus", type=int, metavar="N", help="GPUs per node (default 2)")
    g.add_argument("--nodes", type=int, metavar="M", help="nodes (default 1)")
    g.add_argument("--teacher-gpus", type=int, metavar="T", help="of the N x M GPUs, how many serve the teacher "
                   "(default 1; the rest train and sample the student)")
    g.add_argument("--teacher-tp", type=int, metavar="K", help="GPUs per teacher replica (default: the fewest "
                   "that hold it)")
    g.add_argument("--gpu-gib", type=float, metavar="G", help="memory per GPU the plan sizes for (default 80)")


def _plan_arguments(p) -> None:
    have = set(p._option_string_actions)
    for flag, kw in (("--profile", dict(help="a verl OPD profile (opd profiles list)")),
                     ("--config", dict(help="a verl-shaped YAML file, or builtin:PAIR (conf/pair/)")),
                     ("--set", dict(action="append", metavar="KEY=VALUE", help="a verl field to set (repeatable)")),
                     ("--accept", dict(action="append", metavar="FIELD", help="accept a reinterpreted verl field "
                                       "from the config file or --set ('all': every one)")),
                     ("--out", dict(help="the plan file (default plan.json)")),
                     ("--params", dict(help="memory plan: a composed params file instead of conf/ + overrides")),
                     ("--probe", dict(action="store_true", help="memory plan: measure peaks on CUDA too"))):
        if flag not in have:
            p.add_argument(flag, **kw)


def add_commands(sub, with_cfg) -> None:
    """Register plan --profile, profiles, compat and data on `opd`'s subparsers."""
    p = sub.choices["plan"]  # the memory plan's command (stages/cli.py) gains --profile and its options
    _plan_arguments(p)
    # every `opd plan` goes through cmd_plan: without --profile it refuses --config/--set/--accept
    # (options only a profile uses: never ignored) and runs the memory planner
    p.set_defaults(fn=cmd_plan)
    p = sub.add_parser("profiles", help="list the verl OPD profiles or show one")
    p.add_argument("action", choices=("list", "show"), help="list: every profile; show NAME: one profile's settings")
    p.add_argument("name", nargs="?", help="show: the profile (opd profiles list)")
    p.set_defaults(fn=cmd_profiles)
    p = sub.add_parser("compat", help="explain how a verl field maps here, or print the compatibility table")
    p.add_argument("action", choices=("explain", "table"), help="explain FIELD: one verl field; table: all of them")
    p.add_argument("field", nargs="?", help="explain: a verl field, e.g. actor_rollout_ref.rollout.temperature")
    p.add_argument("--out", help="table: write to this file (docs/compat.md)")
    p.set_defaults(fn=cmd_compat)
    p = sub.add_parser("data", help="data utilities")
    dsub = p.add_subparsers(dest="data_action", required=True)
    p = with_cfg(dsub.add_parser("sample", help="write a verl-schema prompt Parquet from the prompt generator"))
    p.add_argument("--format", default="verl-parquet", help="verl-parquet (the only format)")
    p.add_argument("--out", required=True, help="the Parquet file to write")
    p.add_argument("--rows", type=int, default=16, help="prompt rows to write (default 16)")
    p.set_defaults(fn=cmd_data)
    p = dsub.add_parser("reasoning-gym", help="write a verl-schema prompt Parquet from a reasoning-gym dataset, "
                        "scored by its own checker (needs the extra: pip install 'opd-stages[tasks]')")
    p.add_argument("name", help="the dataset, e.g. chain_sum or basic_arithmetic")
    p.add_argument("--size", type=int, required=True, help="entries to draw (rows written)")
    p.add_argument("--seed", type=int, required=True, help="the dataset's seed: the same name, size and seed "
                   "give the same rows")
    p.add_argument("--out", required=True, help="the Parquet file to write")
    p.add_argument("--test-fraction", type=float, default=0.2, help="share of the distinct questions held out "
                   "(extra_info.split = test: the evaluation rows; default 0.2)")
    p.set_defaults(fn=cmd_data_tasks)
