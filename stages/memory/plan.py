"""`opd plan`: a weight-free memory plan. Reads only the models' config files (config.json, the
embedded GGUF's header, conf/arch/*.json) and our config, estimates the peak memory of every phase
(the training step's and evaluate's) under every placement, picks one (memory.placement=auto) and
refuses an infeasible plan naming the settings that would make it fit. `--probe` (CUDA) puts
measured peaks beside the estimates. The per-phase memory model is stages/memory/phases.py.

A run consults the same plan before any weights load (`decide`). On CUDA an infeasible plan is a
warning (the estimate is an estimate; OOM retries and swap still apply). On the CPU the device is
host memory, where nothing retries: the kernel swaps or kills the process, so a planned peak past
the host memory available now is refused and one within HOST_BAND of it is a warning
(`host_check`, which `opd plan` notes and `opd doctor` reports). memory.vram_gib sets that budget
instead.
"""
from __future__ import annotations

import copy
import importlib.util
import math
import sys

from ..errors import UserError
from . import hostmem
from .placement import GIB, check_placement, device_total, refusal
from ..run.codepaths import graphed_roles
from .phases import (ENV_TOOL_TOKENS, LOOP, Ctx, engine_runs, eval_workload, in_place, phase_total,
                     phases, teacher_samples, workload)
from .shapes import lora_params, pristine_bytes, shape_of, weight_bytes

PLACEMENTS = ("resident", "swap", "shared_backbone")
# CPU: a planned peak within this fraction of the host memory budget is a warning (past it: refused)
HOST_BAND = 0.15


def _evaluate(x: Ctx) -> dict:
    res = {}
    for p in PLACEMENTS:
        why = refusal(x.cfg, p)
        if why:
            res[p] = {"refused": why}
            continue
        ph = phases(x, p)
        tot = {name: phase_total(items) for name, items in ph.items()}
        worst = max(tot, key=tot.get)
        res[p] = {"phases": ph, "totals": tot, "peak": tot[worst], "peak_phase": worst,
                  "loop": max(tot[name] for name in LOOP)}
    return res


def _choose(cfg, ev: dict, usable: float) -> tuple[str, str]:
    req = cfg.memory.placement
    if req != "auto":
        if "refused" in ev[req]:
            raise UserError(ev[req]["refused"])
        return req, f"memory.placement={req} (requested)"
    ok = [p for p in ("shared_backbone", "resident", "swap") if "refused" not in ev[p]]
    g = lambda p: ev[p]["peak"] / GIB  # noqa: E731
    for p in ok:
        if ev[p]["peak"] <= usable:
            if p == "shared_backbone":
                saved = ev["shared_backbone"]["peak"] - ev["resident"]["peak"]
                return p, (f"student and teacher are the same base: one copy of the weights "
                           f"({-saved / GIB:.2f} GiB less than resident)")
            if p == "resident":
                return p, (f"both roles fit on the device (peak {g(p):.2f} of {usable / GIB:.2f} GiB usable): "
                           "nothing moves")
            return p, (f"resident needs {g('resident'):.2f} GiB > {usable / GIB:.2f} usable; swap keeps one role "
                       f"on the device at a time (peak {g(p):.2f} GiB)")
    # the least peak; of equal ones (evaluate holds both roles under every placement) the first whose
    # training loop fits, else the one with the least loop
    tied = [p for p in ok if ev[p]["peak"] == min(ev[q]["peak"] for q in ok)]
    best = next((p for p in tied if ev[p]["loop"] <= usable), min(tied, key=lambda p: ev[p]["loop"]))
    loop = ev[best]["loop"] / GIB
    return best, (f"nothing fits {usable / GIB:.2f} GiB usable; {best} needs the least ({g(best):.2f} GiB"
                  + (f"; its training loop {loop:.2f} GiB fits, {ev[best]['peak_phase']} does not)"
                     if ev[best]["loop"] <= usable else ")"))


# ---- the plan ----

def _target(cfg) -> tuple[str, str, int]:
    """(device type, dtype name, bytes per element) the run will use. Planning for CUDA needs no GPU."""
    dev = cfg.runtime.device
    if dev == "auto":
        import torch

        dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = cfg.runtime.dtype if cfg.runtime.dtype != "auto" else ("bfloat16" if dev == "cuda" else "float32")
    return dev, {"bfloat16": "bf16", "float32": "fp32"}[dtype], {"bfloat16": 2, "float32": 4}[dtype]


def _budget(cfg, device: str) -> tuple[int, str]:
    """The plan's budget: memory.vram_gib, else the CUDA device's total or the host's RAM (the
    machine's, whatever other processes hold now: `host_budget` is the run's check)."""
    if cfg.memory.vram_gib is not None:
        return int(cfg.memory.vram_gib * GIB), "memory.vram_gib"
    return device_total(device)


def host_budget(cfg) -> tuple[int, str]:
    """What a CPU run checks its planned peak against before any weights load: memory.vram_gib, else
    the host memory available now (hostmem.available: what other processes leave this one), else
    (the kernel cannot say) the host's RAM."""
    if cfg.memory.vram_gib is not None:
        return int(cfg.memory.vram_gib * GIB), "memory.vram_gib"
    return hostmem.available() or device_total("cpu")


def _ctx(cfg, shapes: dict) -> Ctx:
    dev, dtype, s = _target(cfg)
    key = lambda m: (m.name, m.revision, m.keep_layers)  # noqa: E731  what a shape depends on
    for role in ("student", "teacher"):
        m = getattr(cfg, role)
        if key(m) not in shapes:
            shapes[key(m)] = shape_of(m, role)
    return Ctx(cfg, dev, dtype, s, shapes[key(cfg.student)], shapes[key(cfg.teacher)])


def _set(cfg, dotted: str, value):
    obj = cfg
    *path, last = dotted.split(".")
    for part in path:
        obj = getattr(obj, part)
    setattr(obj, last, value)


def _could_merge_in_place(cfg) -> bool:
    """memory.merge_in_place is off and could be turned on (it needs an unquantized student)."""
    return cfg.student.quant == "none" and not cfg.memory.merge_in_place


def _halves(key: str, n: int, floor: int = 1) -> list:
    """[[(key, n // 2)], [(key, n // 4)], ...] down to `floor`: one group's changes, mildest first."""
    out, c = [], n // 2
    while c >= max(1, floor):
        out.append([(key, c)])
        c //= 2
    return out


def _variants(cfg):
    """Groups of single changes that lower the peak, most specific first: (label, [(key, value)])."""
    if cfg.memory.placement != "auto":
        yield "placement", [[("memory.placement", p)] for p in PLACEMENTS if p != cfg.memory.placement]
    if not getattr(cfg.train, "activation_checkpointing", True):
        yield "checkpointing", [[("train.activation_checkpointing", True)]]
    if _could_merge_in_place(cfg):
        yield "in_place", [[("memory.merge_in_place", True)]]
    yield "chunk", _halves("train.chunk", cfg.train.chunk, cfg.memory.chunk_floor)
    q = [[(f"{role}.quant", "nf4")] for role in ("student", "teacher") if getattr(cfg, role).quant == "none"
         and _bitsandbytes() and not (role == "student" and cfg.memory.merge_in_place)]  # (NF4: not merged in place)
    q += [q[0] + q[1]] if len(q) == 2 else []
    # then the NF4 roles smaller, cheapest first: the teacher without its dense sampling copy (evaluation's only),
    # no captured graphs (pools holding activations: a slower update), the student's copy (a far slower rollout)
    nf4 = q[-1] if q else []
    small = {r: getattr(cfg, r).quant == "nf4" or (f"{r}.quant", "nf4") in nf4 for r in ("student", "teacher")}
    t, st = ([(f"{r}.dense_copy", False)] if small[r] and getattr(cfg, r).dense_copy else []
             for r in ("teacher", "student"))
    g = [("runtime.cuda_graphs", False)] if any(small.values()) and graphed_roles(cfg, _target(cfg)[0]) else []
    ladder = [nf4 + t, nf4 + t + g, nf4 + t + st, nf4 + t + st + g]
    yield "quant", q + [r for i, r in enumerate(ladder) if r != nf4 and r not in ladder[:i]]
    yield "batch", _halves("rollout.batch_size", cfg.rollout.batch_size)
    # evaluate: its KL chunk (the same numbers), then fewer held-out prompts at once
    yield "eval_chunk", _halves("eval.chunk", cfg.eval.chunk, cfg.memory.chunk_floor)
    yield "eval_prompts", _halves("data.num_eval", cfg.data.num_eval)


def _best_peak(cfg, shapes: dict, usable: float) -> tuple[float, str]:
    ev = _evaluate(_ctx(cfg, shapes))
    if cfg.memory.placement != "auto":
        if "refused" in ev[cfg.memory.placement]:
            return math.inf, cfg.memory.placement
        return ev[cfg.memory.placement]["peak"], cfg.memory.placement
    p, _ = _choose(cfg, ev, usable)
    return ev[p]["peak"], p


def _try(cfg, changes, shapes: dict, usable: float) -> dict:
    v = copy.deepcopy(cfg)
    for k, val in changes:
        _set(v, k, val)
    peak, placement = _best_peak(v, shapes, usable)
    return {"set": dict(changes), "peak_gib": round(peak / GIB, 4), "placement": placement, "fits": peak <= usable}


def suggestions(cfg, shapes: dict, usable: float) -> list[dict]:
    """Settings that would make an infeasible plan fit: from each group, the mildest change that fits.
    When no single change fits, the one entry is every group's strongest change at once (fits or not)."""
    out, strongest = [], []
    for label, group in _variants(cfg):
        for changes in group:
            t = _try(cfg, changes, shapes, usable)
            if t["fits"]:
                out.append(t)
                break
        if group and label not in ("placement", "checkpointing", "in_place"):
            strongest += group[-1]
    if not out and strongest:
        out.append(_try(cfg, strongest, shapes, usable))
    return out


def _gib(b: float) -> float:
    return round(b / GIB, 4)


def _bitsandbytes() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None


def estimate(cfg, shapes: dict | None = None) -> dict:
    """The whole plan as a JSON-able dict (what `opd plan --out` writes); loads no weights."""
    for role in ("student", "teacher"):
        q = getattr(cfg, role).quant
        if q != "none" and not _bitsandbytes():
            raise UserError(f"key '{role}.quant' = {q!r} needs bitsandbytes: pip install 'opd-stages[quant]'")
    shapes = {} if shapes is None else shapes
    x = _ctx(cfg, shapes)
    budget, source = _budget(cfg, x.device)
    if budget <= 0:
        raise UserError(f"key 'memory.vram_gib' = {cfg.memory.vram_gib}; expected a positive number of GiB")
    usable = budget * (1 - cfg.memory.margin)
    ev = _evaluate(x)
    chosen, why = _choose(cfg, ev, usable)
    sel = ev[chosen]
    models_out = {}
    for role, sh in (("student", x.S), ("teacher", x.T)):
        m = getattr(cfg, role)
        models_out[role] = {"source": sh.source, "model_type": sh.model_type, "layers": sh.layers,
                            "hidden": sh.hidden, "intermediate": sh.inter, "heads": sh.heads,
                            "kv_heads": sh.kv_heads, "head_dim": sh.head_dim, "vocab": sh.vocab,
                            "tied_embeddings": sh.tied, "params": sh.params(), "quant": m.quant,
                            "weights_gib": _gib(weight_bytes(sh, m.quant, getattr(m, "double_quant", False), x.s))}
    models_out["student"]["lora_params"] = lora_params(x.S, cfg.lora)
    models_out["student"]["rollout_engine"] = ("transformers fallback" if not x.engine else
                                               "fast (dense copy of the NF4 base, merged LoRA)"
                                               if cfg.student.quant == "nf4" else
                                               "fast (LoRA merged into the student's own weights)" if in_place(x)
                                               else "fast (merged LoRA)")
    placements = {}
    for p, r in ev.items():
        if "refused" in r:
            placements[p] = {"refused": r["refused"]}
            continue
        placements[p] = {
            "peak_gib": _gib(r["peak"]), "peak_phase": r["peak_phase"], "feasible": r["peak"] <= usable,
            "loop_peak_gib": _gib(r["loop"]),
            "phases": {ph: {"total_gib": _gib(r["totals"][ph]),
                            "items": [{"role": ro, "component": what, "gib": _gib(b), "bytes": int(b),
                                       "one_at_a_time": alt} for ro, what, b, alt in items]}
                       for ph, items in r["phases"].items()}}
    t_fast = engine_runs(x.T, cfg.teacher)
    notes = ["steady state (step >= 2): step 1 has no LoRA grads, Adam moments or (rollout) teacher yet",
             "each rollout merges the LoRA into the student's own weights, one projection at a time (fp32 scratch)"
             if in_place(x) else
             "the teacher samples the rollouts (rollout.sampler=teacher): its engine is built for each rollout and "
             "dropped after it" if teacher_samples(cfg) else
             "after each update the engine re-merges in place, one projection at a time (fp32 scratch)"
             if x.engine else "the student samples through transformers, the LoRA unmerged: nothing to re-merge",
             f"evaluate: the {cfg.data.num_eval} held-out prompts (data.num_eval) in one greedy batch; the "
             + ("teacher's greedy engine stays for the whole evaluation" if t_fast else
                "teacher answers through transformers (no greedy engine)") + "; every placement holds both roles there"]
    if cfg.memory.placement == "swap" and x.device == "cpu":
        notes.append("on CPU the device is host memory: swap moves nothing")
    if getattr(getattr(cfg, "env", None), "name", None):
        notes.append(f"env rollouts: response = max_turns x (max_tokens_per_turn + {ENV_TOOL_TOKENS} assumed "
                     "tool tokens)")
    if in_place(x):
        b = pristine_bytes(x.S, x.s)
        # torch's pinned-memory allocator rounds each allocation up to a power of two (by default:
        # ATen/core/CachingHostAllocator.h, read in torch 2.13's source; not measured)
        notes.append(f"memory.merge_in_place: the student's projections' pristine copy, {_gib(b):.2f} GiB, stays in "
                     "host memory" + (f", pinned ({_gib(2 ** math.ceil(math.log2(b))):.2f} GiB of page-locked memory: "
                                      "the pinned allocator rounds up to a power of two), copied back to the device "
                                      "after each rollout" if x.device == "cuda" else ""))
    if x.device == "cuda":
        notes.append("CUDA context and allocator fragmentation are outside these figures: memory.margin covers them")
        if chosen == "swap" and cfg.memory.placement == "auto":
            # swap moves a role on and off the device every phase; checkpointing keeps both resident
            # for one captured recompute and merging in place drops the engine's copy, each for a few
            # percent of the seed step (docs/performance.md, "Evidence for the constants in the
            # code"): the first of these that fits
            ck, ip = ("train.activation_checkpointing", True), ("memory.merge_in_place", True)
            can_ck = not cfg.train.activation_checkpointing
            can_ip = _could_merge_in_place(cfg)
            tries = [c for c, ok in (([ck], can_ck), ([ip], can_ip), ([ck, ip], can_ck and can_ip)) if ok]
            gain = {ck: "the checkpointed update replays a captured graph" if "student" in graphed_roles(cfg, "cuda")
                    else "the checkpointed update recomputes each layer", ip: "the engine keeps no merged copy"}
            for changes in tries:
                t = _try(cfg, changes + [("memory.placement", "resident")], shapes, usable)
                if t["fits"]:
                    notes.append(f"resident fits with {_overrides(dict(changes))} (peak {t['peak_gib']:.2f} GiB): "
                                 f"{' and '.join(gain[c] for c in changes)}, where swap moves a role on and off the "
                                 "device every phase")
                    break
    else:
        notes.append("host RAM figures are tensors only: the Python process itself (libraries) comes on top")
    out = {
        "device": x.device, "dtype": x.dtype, "budget_gib": _gib(budget), "budget_source": source,
        "margin": cfg.memory.margin, "usable_gib": _gib(usable), "models": models_out,
        "workload": workload(x), "evaluate_workload": eval_workload(x),
        "placement": {"requested": cfg.memory.placement, "chosen": chosen, "why": why},
        "placements": placements, "phases": placements[chosen]["phases"],
        "peak_gib": _gib(sel["peak"]), "peak_phase": sel["peak_phase"], "loop_peak_gib": _gib(sel["loop"]),
        "headroom_gib": _gib(usable - sel["peak"]),
        "feasible": sel["peak"] <= usable, "suggestions": [], "notes": notes,
    }
    if not out["feasible"]:
        out["suggestions"] = suggestions(cfg, shapes, usable)
    if x.device == "cpu":  # what `opd run` (and `opd doctor`) decide from this plan now
        out["host_check"] = host_check(cfg, out, shapes)
        h = out["host_check"]
        notes.append(f"`opd run` checks the peak against the host memory available when it starts: now "
                     f"{h['budget_gib']:.2f} GiB ({h['budget_source']}): "
                     + (h["message"] if h["verdict"] != "ok" else
                        f"fits (refused past it, a warning within {h['band']:.0%} of it)"))
    return out


def decide(cfg, defer: bool = False) -> tuple[str, str] | None:
    """(placement, why) for a run, before any weights load: a refused placement is an error; on CUDA
    an infeasible plan is a warning (the estimate is an estimate; OOM retries and swap still apply);
    on the CPU a peak past the host memory available is an error and one near it a warning
    (`host_check`). defer: None where the plan cannot be made yet (shapes unreadable before prepare
    fetched the models' config files): the session decides after prepare."""
    if cfg.memory.placement != "auto":
        check_placement(cfg, cfg.memory.placement)
    try:
        est = estimate(cfg)
    except UserError as e:  # shapes unreadable (an unusual architecture): the plan cannot decide
        if defer:
            return None
        if cfg.memory.placement != "auto":
            return cfg.memory.placement, "requested"
        print(f"warning: no memory plan ({e}); placement resident", file=sys.stderr)
        return "resident", "no plan"
    if est["device"] == "cpu":
        h = est["host_check"]
        if h["verdict"] == "refuse":
            raise UserError(h["message"])
        if h["verdict"] == "warn":
            print(f"warning: {h['message']}", file=sys.stderr)
    elif not est["feasible"]:
        print(f"warning: {infeasible_message(est)}", file=sys.stderr)
    return est["placement"]["chosen"], est["placement"]["why"]


def preflight(cfg) -> tuple[str, str] | None:
    """`opd run` before prepare: on the CPU `decide` now, before any weights are read or written (None
    where shapes are unreadable yet); on CUDA None: the session decides at its first model load."""
    return decide(cfg, defer=True) if _target(cfg)[0] == "cpu" else None


def host_check(cfg, est: dict, shapes: dict | None = None) -> dict:
    """CPU: the planned peak against the host memory budget (`host_budget`: available now, or
    memory.vram_gib). verdict "refuse" past the budget, "warn" within HOST_BAND of it (or
    memory.margin, if larger), else "ok"; the message names the settings that would clear the band."""
    b, source = host_budget(cfg)
    budget, peak = b / GIB, est["peak_gib"]
    band = max(HOST_BAND, cfg.memory.margin)
    out = {"budget_gib": _gib(b), "budget_source": source, "band": band, "verdict": "ok", "message": ""}
    near = (1 - band) * budget
    if peak <= near:
        return out
    sug = suggestions(cfg, {} if shapes is None else shapes, near * GIB)
    fixes = _fixes(sug)
    what = f"planned host memory peak {peak:.2f} GiB ({est['peak_phase']}, placement {est['placement']['chosen']})"
    have = f"{budget:.2f} GiB " + ("(memory.vram_gib)" if source == "memory.vram_gib" else
                                   f"available ({source.removeprefix('detected: ')})")
    if peak > budget:
        tried = f"; even {_overrides(sug[0]['set'])} needs {sug[0]['peak_gib']:.2f} GiB" if sug and not fixes else ""
        out.update(verdict="refuse", message=(
            f"{what} > {have}; " + (f"fits with: {fixes}" if fixes else "no change tried fits (nf4, chunk, batch "
                                    "size, held-out prompts)" + tried + "; use a smaller pair or a larger machine")
            + "; to run anyway set memory.vram_gib to the GiB this run may take (checked instead of what is "
            "available now)"))
    else:
        out.update(verdict="warn", message=(
            f"{what} is within {band:.0%} of the {have}: another process, or the estimate's error, can exhaust it"
            + (f"; more room with: {fixes}" if fixes else "")))
    return out


def _overrides(changes: dict) -> str:
    """Settings as the command line takes them (true/false, not Python's True/False)."""
    return " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in changes.items())


def _fixes(sug: list[dict]) -> str:
    return "; ".join(f"{_overrides(s['set'])} ({s['peak_gib']:.2f} GiB, {s['placement']})" for s in sug if s["fits"])


def infeasible_message(est: dict) -> str:
    sug = est["suggestions"]
    fix = _fixes(sug)
    tried = "" if fix or not sug else f"; even {_overrides(sug[0]['set'])} needs {sug[0]['peak_gib']:.2f} GiB"
    return (f"plan infeasible: peak {est['peak_gib']:.2f} GiB ({est['peak_phase']}, placement "
            f"{est['placement']['chosen']}) > {est['usable_gib']:.2f} GiB usable of {est['budget_gib']:.2f} GiB "
            f"({est['budget_source']}, memory.margin {est['margin']}); "
            + (f"fits with: {fix}" if fix else "no change tried fits (chunk, nf4, swap, batch size, held-out "
               "prompts)" + tried + "; use a smaller pair or a larger device"))
