"""`opd plan`: a weight-free memory plan. Reads only the models' config files (config.json, the
embedded GGUF's header, conf/arch/*.json) and our config, estimates the peak memory of every phase
under every placement, picks one (memory.placement=auto) and refuses an infeasible plan naming
the settings that would make it fit. `--probe` (CUDA) puts measured peaks beside the estimates.

What each phase holds (steady state, step >= 2; bytes; s = bytes of the compute dtype):
  rollout  student weights + LoRA (fp32) + the engine's weights (s) + static KV cache
           2 * layers * B * kv_heads * (prompt_bucket + max_new) * head_dim * s (with CUDA graphs
           twice: the captured step's static copy stays, each call prefills a fresh one) + prefill
           activations B * P * (2H + 3I) * s + attention scores + sampling buffers [B, V] fp32
  score    teacher weights + forward activations t * max(2H + 3I, 2H + 5 q_dim) * s + hidden
           states + one chunk of logits: 3 * chunk * V * 4 (log_softmax, exp, product for entropy)
  update   student weights + LoRA + grads (fp32) + saved activations t * (layers * a + 4H)
           (a per token and layer, `saved_per_token_layer`; with train.activation_checkpointing
           t * (layers * H * s + 4H) plus one layer's t * a recomputed in the backward) + backward
           scratch t * (2H + 3I) * 4 or the loss chunk 4 * chunk * V * 4, whichever is larger
The student's LoRA grads and AdamW moments (2 x fp32) stay resident between steps, as does the
engine's copy (q/k/v and gate/up fused, targeted o/down merged). Under resident every phase also
holds the idle role; under swap it waits in host memory (with its moments and engine); under
shared_backbone the teacher is the student's base (no second copy). t = B * (P + max_new).
The activation terms were checked against autograd's saved tensors (CPU, real SmolLM2-360M
widths): within 1% for bf16 and fp32.
"""
from __future__ import annotations

import copy
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError
from .memory import GIB
from .shapes import (Shape, dequant_bytes, engine_copy_bytes, forward_bytes, lora_params, saved_per_token_layer,
                     shape_of, weight_bytes)

PLACEMENTS = ("resident", "swap", "shared_backbone")
PHASES = ("rollout", "score", "update")
ENGINE_TYPES = {"llama", "qwen2", "qwen3", "mistral"}  # stages/sampler.py SUPPORTED (no torch import here)
ENV_TOOL_TOKENS = 32  # assumed tokens of one tool message per turn (env rollouts): the env decides


# ---- the workload and the phases ----

@dataclass
class Ctx:
    cfg: object
    device: str  # cuda | cpu (the target: planning for CUDA needs no GPU here)
    dtype: str
    s: int
    S: Shape
    T: Shape

    @property
    def engine(self) -> bool:
        """The fast rollout engine runs (merged LoRA copy, static KV cache) or the transformers fallback."""
        return self.S.model_type in ENGINE_TYPES and self.cfg.student.quant == "none"


def workload(x: Ctx) -> dict:
    cfg, r = x.cfg, x.cfg.rollout
    B, P = r.batch_size * r.n, cfg.data.max_prompt_tokens
    env = getattr(cfg, "env", None)
    N = env.max_turns * (env.max_tokens_per_turn + ENV_TOOL_TOKENS) if env is not None and env.name \
        else r.max_new_tokens
    graphs = x.device == "cuda" and r.cuda_graphs and x.engine
    n = B * N
    sel, n_sel = getattr(cfg, "selection", None), n
    if sel is not None and sel.mode == "uniform_ratio":
        n_sel = max(1, math.ceil(n * sel.ratio))
    elif sel is not None and sel.mode == "uniform_budget" and sel.budget:
        n_sel = min(n, sel.budget)
    return {"sequences": B, "prompt_tokens": P, "prompt_bucket": -(-P // 16) * 16 if graphs else P,
            "new_tokens": N, "tokens": B * (P + N), "response_positions": n, "head_positions": n_sel,
            "chunk": min(cfg.train.chunk, n_sel), "vocab": x.S.vocab, "cuda_graphs": graphs}


def _label(quant: str, dq: bool, dtype: str) -> str:
    return {"none": dtype, "nf4": "nf4 + double quant" if dq else "nf4", "int8": "int8"}[quant]


def phases(x: Ctx, placement: str) -> dict[str, list[tuple[str, str, int, bool]]]:
    """(role, component, bytes, alt) held during each phase under `placement`. Items with alt=True
    happen one after another within the phase (e.g. forward activations, then a logits chunk): only
    the largest of them counts toward the phase's peak (`total`)."""
    cfg, S, T, s = x.cfg, x.S, x.T, x.s
    w = workload(x)
    B, P, Pb, N, t = w["sequences"], w["prompt_tokens"], w["prompt_bucket"], w["new_tokens"], w["tokens"]
    n, c, V, k = w["head_positions"], w["chunk"], S.vocab, cfg.objective.topk
    moves = placement == "swap" and x.device != "cpu"  # on CPU the "device" is host memory
    shared = placement == "shared_backbone"
    sq, tq = cfg.student.quant, cfg.teacher.quant
    sdq, tdq = getattr(cfg.student, "double_quant", False), getattr(cfg.teacher, "double_quant", False)
    lora = lora_params(S, cfg.lora) * 4
    stud = [("student", f"weights ({_label(sq, sdq, x.dtype)})", weight_bytes(S, sq, sdq, s), False),
            ("student", "LoRA (fp32)", lora, False),
            ("student", "LoRA grads (fp32, kept from the last update)", lora, False),
            ("student", "AdamW moments (2 x fp32, resident between steps)", 2 * lora, False)]
    L = Pb + N
    kv = 2 * S.layers * B * S.kv_heads * L * S.head_dim * s
    pick = B * V * (s + 16 + (21 if cfg.rollout.top_p < 1 else 0))  # head output + fp32 logits/logp/probs/cdf
    gqa = 2 * B * S.heads * L * S.head_dim * s if S.heads != S.kv_heads else 0  # math SDPA repeats k/v
    eng = [("student", "rollout engine weights (fused q/k/v, gate/up; merged LoRA)",
            engine_copy_bytes(S, cfg.lora, s), False)] if x.engine else []
    if x.engine and w["cuda_graphs"]:  # the captured decode step keeps its static state and pool
        eng.append(("student", f"captured decode graph: static KV cache [{S.layers}, {B}, {S.kv_heads}, {L}, "
                    f"{S.head_dim}] x2 + pool", kv + pick + gqa + B * (2 * S.hidden + 3 * S.inter) * s, False))
    teach = [("teacher", "weights: the student's base (shared, counted once)", 0, False)] if shared else \
        [("teacher", f"weights ({_label(tq, tdq, x.dtype)})", weight_bytes(T, tq, tdq, s), False)]
    out: dict[str, list] = {}

    ro = stud + eng + ([] if moves else teach)
    if x.engine:
        if moves:  # the engine is rebuilt inside each rollout: fp32 scratch of one merge
            big = max(i * o for i, o in S.proj().values())
            ro.append(("student", "engine build scratch (fp32 merge of one projection)", 3 * big * 4, True))
        ro += [("student", f"KV cache of this call [{S.layers}, {B}, {S.kv_heads}, {L}, {S.head_dim}] x2"
                + (" (copied into the graph's)" if w["cuda_graphs"] else ""), kv, False),
               ("student", f"prefill activations ({B} x {Pb} tokens) + attention scores",
                B * Pb * (2 * S.hidden + 3 * S.inter) * s + 2 * B * S.heads * Pb * L * 4 + gqa, True),
               ("student", "sampling buffers [B, V] fp32", pick, True)]
    else:  # transformers fallback: dynamic cache, LoRA unmerged, logits of every prompt position
        ro += [("student", f"KV cache (dynamic) [{S.layers}, {B}, {S.kv_heads}, {P + N}, {S.head_dim}] x2",
                2 * S.layers * B * S.kv_heads * (P + N) * S.head_dim * s, False),
               ("student", f"prefill logits [{B}, {P}, {V}]", B * P * V * s, False),
               ("student", f"prefill activations ({B} x {P} tokens)", forward_bytes(S, B * P, s), True),
               ("student", "sampling buffers [B, V] fp32", pick, True),
               ("student", "quantized matmul scratch", dequant_bytes(S, sq, B * P, s), False)]
    out["rollout"] = ro

    sc = ([] if moves else stud + eng) + teach
    tquant = sq if shared else tq
    sc += [("teacher", f"forward activations ({t} tokens) + last hidden states [{t}, H]",
            forward_bytes(T, t, s) + t * T.hidden * s, True),
           ("teacher", f"logits chunk [{c}, {V}] fp32 x3 (log_softmax, exp, entropy term)", 3 * c * V * 4, True),
           ("teacher", f"selected hidden states [{n}, H]", n * T.hidden * s, False),
           ("teacher", "log-probs, entropy, top-k ids and log-probs", n * (8 + 12 * k), False),
           ("teacher", "quantized matmul scratch", dequant_bytes(T, tquant, t, s), False)]
    out["score"] = sc

    full = "full" in _needs(cfg)
    a, scratch = saved_per_token_layer(S, cfg.lora, s), t * (2 * S.hidden + 3 * S.inter) * 4
    up = stud + ([] if moves else eng + teach)
    if getattr(cfg.train, "activation_checkpointing", False):  # each layer keeps only its input
        up += [("student", f"checkpointed layer inputs ({t} tokens x {S.layers} layers)",
                t * (S.layers * S.hidden * s + 4 * S.hidden), False),
               ("student", "backward: one layer's activations recomputed + scratch", t * a + scratch, True)]
    else:
        up += [("student", f"saved activations ({t} tokens x {S.layers} layers)",
                t * (S.layers * a + 4 * S.hidden), False),
               ("student", "backward scratch (one layer)", scratch, True)]
    up += [("student", f"loss chunk [{c}, {V}] fp32 x4" + (" + teacher logits" if full else "")
            + f" + hidden-state grad [{n}, H]", (5 if full else 4) * c * V * 4 + n * S.hidden * s, True),
           ("student", "quantized matmul scratch", dequant_bytes(S, sq, t, s), False)]
    out["update"] = up

    return {ph: [i for i in items if i[2] or "shared" in i[1]] for ph, items in out.items()}


def phase_total(items) -> int:
    """Held items add up; of the one-after-another (alt) items only the largest counts."""
    return sum(b for *_, b, alt in items if not alt) + max((b for *_, b, alt in items if alt), default=0)


def _needs(cfg) -> set:
    from . import objectives

    return objectives.needs(cfg.objective)


# ---- placements ----

BASE_KEYS = ("name", "revision", "init", "keep_layers", "quant", "double_quant", "trust_remote_code", "tokenizer")


def refusal(cfg, placement: str) -> str | None:
    """Why `placement` cannot run this config (None: it can). Weight-free."""
    if placement == "swap":
        for role in ("student", "teacher"):
            q = getattr(cfg, role).quant
            if q != "none":
                return (f"memory.placement=swap: {role}.quant={q} is a bitsandbytes-quantized role whose weights "
                        f"cannot move to host memory and back; use memory.placement=resident (or {role}.quant=none)")
    if placement == "shared_backbone":
        diff = [k for k in BASE_KEYS if getattr(cfg.student, k, None) != getattr(cfg.teacher, k, None)]
        if diff:
            d = ", ".join(f"student.{k}={getattr(cfg.student, k)!r} vs teacher.{k}={getattr(cfg.teacher, k)!r}"
                          for k in diff)
            return (f"memory.placement=shared_backbone needs the teacher to be the student's base, but the bases "
                    f"differ ({d}); use memory.placement=resident or swap")
        if getattr(cfg, "teacher_mode", "raw") == "protocol_sft":
            return ("memory.placement=shared_backbone: teacher_mode=protocol_sft gives the teacher its own adapter; "
                    "a shared backbone here only disables the student's; use memory.placement=resident or swap")
    return None


def check_placement(cfg, placement: str) -> None:
    why = refusal(cfg, placement)
    if why:
        raise UserError(why)


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
        res[p] = {"phases": ph, "totals": tot, "peak": tot[worst], "peak_phase": worst}
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
    best = min(ok, key=g)
    return best, f"nothing fits {usable / GIB:.2f} GiB usable; {best} needs the least ({g(best):.2f} GiB)"


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
    if cfg.memory.vram_gib is not None:
        return int(cfg.memory.vram_gib * GIB), "memory.vram_gib"
    from .memory import device_total

    return device_total(device)


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


def _variants(cfg):
    """Groups of single changes that lower the peak, most specific first: (label, [(key, value)])."""
    if cfg.memory.placement != "auto":
        yield "placement", [[("memory.placement", p)] for p in PLACEMENTS if p != cfg.memory.placement]
    if not getattr(cfg.train, "activation_checkpointing", True):
        yield "checkpointing", [[("train.activation_checkpointing", True)]]
    chunks, c = [], cfg.train.chunk // 2
    while c >= max(1, cfg.memory.chunk_floor):
        chunks.append([("train.chunk", c)])
        c //= 2
    yield "chunk", chunks
    q = [[(f"{role}.quant", "nf4")] for role in ("student", "teacher")
         if getattr(cfg, role).quant == "none" and _bitsandbytes()]
    yield "quant", q + ([q[0] + q[1]] if len(q) == 2 else [])
    bs, b = [], cfg.rollout.batch_size // 2
    while b >= 1:
        bs.append([("rollout.batch_size", b)])
        b //= 2
    yield "batch", bs


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
        if group and label not in ("placement", "checkpointing"):
            strongest += group[-1]
    if not out and strongest:
        out.append(_try(cfg, strongest, shapes, usable))
    return out


def _gib(b: float) -> float:
    return round(b / GIB, 4)


def _bitsandbytes() -> bool:
    import importlib.util

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
    models_out["student"]["rollout_engine"] = "fast (merged LoRA)" if x.engine else "transformers fallback"
    placements = {}
    for p, r in ev.items():
        if "refused" in r:
            placements[p] = {"refused": r["refused"]}
            continue
        placements[p] = {
            "peak_gib": _gib(r["peak"]), "peak_phase": r["peak_phase"], "feasible": r["peak"] <= usable,
            "phases": {ph: {"total_gib": _gib(r["totals"][ph]),
                            "items": [{"role": ro, "component": what, "gib": _gib(b), "bytes": int(b),
                                       "one_at_a_time": alt} for ro, what, b, alt in items]}
                       for ph, items in r["phases"].items()}}
    notes = ["steady state (step >= 2): step 1 has no LoRA grads, Adam moments or (rollout) teacher yet",
             "after each update the engine re-merges in place, one projection at a time (fp32 scratch)",
             "evaluate is not planned: it holds both roles' weights (no gradients, no optimizer)"]
    if cfg.memory.placement == "swap" and x.device == "cpu":
        notes.append("on CPU the device is host memory: swap moves nothing")
    if getattr(getattr(cfg, "env", None), "name", None):
        notes.append(f"env rollouts: response = max_turns x (max_tokens_per_turn + {ENV_TOOL_TOKENS} assumed "
                     "tool tokens)")
    if x.device == "cuda":
        notes.append("CUDA context and allocator fragmentation are outside these figures: memory.margin covers them")
    else:
        notes.append("host RAM figures are tensors only: the Python process itself (libraries) comes on top")
    out = {
        "device": x.device, "dtype": x.dtype, "budget_gib": _gib(budget), "budget_source": source,
        "margin": cfg.memory.margin, "usable_gib": _gib(usable), "models": models_out, "workload": workload(x),
        "placement": {"requested": cfg.memory.placement, "chosen": chosen, "why": why},
        "placements": placements, "phases": placements[chosen]["phases"],
        "peak_gib": _gib(sel["peak"]), "peak_phase": sel["peak_phase"], "headroom_gib": _gib(usable - sel["peak"]),
        "feasible": sel["peak"] <= usable, "suggestions": [], "notes": notes,
    }
    if not out["feasible"]:
        out["suggestions"] = suggestions(cfg, shapes, usable)
    return out


def decide(cfg) -> tuple[str, str]:
    """(placement, why) for a run, before any weights load: a refused placement is an error; an
    infeasible plan is a warning (the estimate is an estimate; OOM retries and swap still apply)."""
    if cfg.memory.placement != "auto":
        check_placement(cfg, cfg.memory.placement)
    try:
        est = estimate(cfg)
    except UserError as e:  # shapes unreadable (an unusual architecture): the plan cannot decide
        if cfg.memory.placement != "auto":
            return cfg.memory.placement, "requested"
        print(f"warning: no memory plan ({e}); placement resident", file=sys.stderr)
        return "resident", "no plan"
    if not est["feasible"]:
        print(f"warning: {infeasible_message(est)}", file=sys.stderr)
    return est["placement"]["chosen"], est["placement"]["why"]


def infeasible_message(est: dict) -> str:
    sug = est["suggestions"]
    fix = "; ".join(f"{' '.join(f'{k}={v}' for k, v in s['set'].items())} ({s['peak_gib']:.2f} GiB, "
                    f"{s['placement']})" for s in sug if s["fits"])
    tried = "" if fix or not sug else \
        f"; even {' '.join(f'{k}={v}' for k, v in sug[0]['set'].items())} needs {sug[0]['peak_gib']:.2f} GiB"
    return (f"plan infeasible: peak {est['peak_gib']:.2f} GiB ({est['peak_phase']}, placement "
            f"{est['placement']['chosen']}) > {est['usable_gib']:.2f} GiB usable of {est['budget_gib']:.2f} GiB "
            f"({est['budget_source']}, memory.margin {est['margin']}); "
            + (f"fits with: {fix}" if fix else "no change tried fits (chunk, nf4, swap, batch size)" + tried
               + "; use a smaller pair or a larger device"))


# ---- output ----

def render(est: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

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
    from .cli import _config

    cfg = _config(args)
    est = estimate(cfg)
    if est["feasible"] and (getattr(args, "probe", False) or cfg.memory.probe):
        from . import probe

        est["probe"] = probe.run(cfg, est)
    render(est)
    if getattr(args, "out", None):
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(est, indent=2, sort_keys=True) + "\n")
        print(f"wrote {out}")
    if not est["feasible"]:
        raise UserError(infeasible_message(est))
    return est
