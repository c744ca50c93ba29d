"""`opd plan`: the weight-free memory plan (stages/memory/plan.py) as a table, optionally with the CUDA
probe's measured peaks beside it (stages/tools/probe.py), and as JSON (--out)."""
from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..run import config
from ..memory import plan
from ..errors import UserError
from . import probe


def render(est: dict, console=None) -> None:
    console = console or Console(width=120)
    probe = est.get("probe", {}).get("phases", {})
    t = Table(title=f"opd plan: {est['device']} {est['dtype']}, placement {est['placement']['chosen']}")
    for col, j in (("phase", "left"), ("role", "left"), ("component", "left"), ("GiB", "right")):
        t.add_column(col, justify=j)
    if probe:
        t.add_column("measured GiB", justify="right")
    for ph, d in est["phases"].items():
        for i, it in enumerate(d["items"]):
            what = ("[dim]one of:[/] " if it["one_at_a_time"] else "") + it["component"]
            t.add_row(ph if i == 0 else "", it["role"], what, f"{it['gib']:.4f}", *([""] if probe else []))
        meas = probe.get(ph, {}).get("peak_allocated_gib")
        t.add_row("", "", f"[bold]{ph} total[/]", f"[bold]{d['total_gib']:.4f}[/]",
                  *([f"{meas:.4f}" if meas is not None else "-"] if probe else []), end_section=True)
    console.print(t)
    console.print("  one of: transients that come one after another within the phase; only the largest counts",
                  style="dim")
    for p, r in est["placements"].items():
        console.print(f"  {p:16s} " + (f"refused: {r['refused']}" if "refused" in r else
                                        f"peak {r['peak_gib']:.3f} GiB ({r['peak_phase']})"
                                        + ("" if r["feasible"] else "  [red]does not fit[/]")))
    for role, m in est["models"].items():  # which shapes were planned (weight-free: where they came from)
        console.print(f"  {role}: {m['layers']} layers, hidden {m['hidden']}, {m['params'] / 1e6:,.0f}M params; "
                      f"shapes from {m['source']}", markup=False)
    console.print(f"placement: [bold]{est['placement']['chosen']}[/] - {est['placement']['why']}")
    console.print(f"budget {est['budget_gib']:.2f} GiB ({est['budget_source']}), usable {est['usable_gib']:.2f} "
                  f"(margin {est['margin']}), peak {est['peak_gib']:.3f} GiB ({est['peak_phase']}), "
                  f"headroom {est['headroom_gib']:.3f} GiB")
    for n in est["notes"]:
        console.print(f"  note: {n}", style="dim")


def main(args) -> dict:
    """`opd plan [overrides] [--params FILE] [--out plan.json] [--probe]`."""
    cfg = config.from_args(args.params, args.overrides)
    est = plan.estimate(cfg)
    if est["feasible"] and (getattr(args, "probe", False) or cfg.memory.probe):
        est["probe"] = probe.run(cfg, est)
    render(est)
    if getattr(args, "out", None):
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(est, indent=2, sort_keys=True) + "\n")
        print(f"wrote {out}")
    if not est["feasible"]:
        raise UserError(plan.infeasible_message(est))
    return est
