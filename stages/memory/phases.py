"""The memory model of a run: what each phase (a training step's rollout, score, update; and
evaluate) holds under a placement, in bytes, from the models' shapes and our config (weight-free;
stages/memory/plan.py chooses).

What each phase holds (steady state, step >= 2; bytes; s = bytes of the compute dtype):
  rollout  student weights + LoRA (fp32) + the engine's weights (s) + static KV cache
           2 * layers * B * kv_heads * (prompt_bucket + max_new) * head_dim * s + prefill
           activations B * P * (2H + 3I) * s + attention scores + sampling buffers [B, V] fp32 (with
           CUDA graphs all of it in the captured prefill's and decode step's one pool, which stays)
  score    teacher weights + forward activations t * max(2H + 3I, 2H + 5 q_dim) * s + hidden
           states + one chunk of logits: 3 * chunk * V * 4 (log_softmax, exp, product for entropy)
  update   student weights + LoRA + grads (fp32) + saved activations t * (layers * a + 4H)
           (a per token and layer, `saved_per_token_layer`; with train.activation_checkpointing
           t * (layers * H * s + 4H) plus one layer's t * a recomputed in the backward) + backward
           scratch t * (2H + 3I) * 4 or the loss chunk 4 * chunk * V * 4, whichever is larger
           (eager); a captured update's pool holds its activations and backward scratch together,
           across phases, and the loss chunk comes on top
  evaluate what the loop keeps (student, its LoRA state and engine, teacher, graph pools) + the
           teacher's greedy engine, kept for the whole evaluation (fused q/k/v and gate/up copies,
           `plain_engine_bytes`) + one at a time: each role's greedy decode of the E = data.num_eval
           held-out prompts at once (KV cache 2 * layers * E * kv_heads * (P + eval.max_new_tokens)
           * head_dim * s + the larger of prefill and sampling buffers; CUDA graphs: kept in the
           engine's pool), then the held-out KL: both roles' hidden states [E * max_new, H] + the
           larger of a forward over the E answers and a KL chunk 5 * eval.chunk * V * 4 (teacher
           and student log-softmax, exp, difference, product; fp32). Every placement holds both
           roles here (stages/evaluate.py: the teacher's accessor brings it back beside the
           student, and its greedy engine keeps its copies on the device); shared_backbone, one copy
The student's LoRA grads and AdamW moments (2 x fp32) stay resident between steps, as does the
engine's copy (q/k/v and gate/up fused, targeted o/down merged); with memory.merge_in_place there is
no copy on the device (the engine merges into the student's own weights and restores them from host memory). Under resident every phase also
holds the idle role; under swap it waits in host memory (with its moments and engine); under
shared_backbone the teacher is the student's base (no second copy). t = B * (P + max_new).
The activation terms were checked against autograd's saved tensors (CPU, real SmolLM2-360M
widths): within 1% for bf16 and fp32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .. import objectives
from ..run.codepaths import graphed_roles, lora_kernels
from ..engine.graphs import BUCKET as FORWARD_BUCKET
from .shapes import (
    Shape,
    dequant_bytes,
    engine_copy_bytes,
    forward_bytes,
    head_copy_bytes,
    lora_params,
    plain_engine_bytes,
    pristine_bytes,
    saved_per_token_layer,
    weight_bytes,
)

PHASES = ("rollout", "score", "update", "evaluate")
LOOP = PHASES[:3]  # a training step's phases
ENGINE_TYPES = {"llama", "qwen2", "qwen3", "mistral"}  # stages/engine/sampler.py SUPPORTED (no torch import here)
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
        """The fast rollout engine runs (merged LoRA copy, static KV cache; an NF4 base from a dense copy)
        or the transformers fallback (int8; NF4 with dense_copy=false)."""
        return engine_runs(self.S, self.cfg.student)


def in_place(x: Ctx) -> bool:
    """memory.merge_in_place takes effect: the engine samples from the student's own weights."""
    return x.engine and x.cfg.student.quant == "none" and x.cfg.memory.merge_in_place


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
    T = -(-(P + N) // FORWARD_BUCKET) * FORWARD_BUCKET if x.device == "cuda" else P + N  # the padded layout
    return {"sequences": B, "prompt_tokens": P, "prompt_bucket": -(-P // 16) * 16 if graphs else P,
            "new_tokens": N, "tokens": B * T, "response_positions": n, "head_positions": n_sel,
            "chunk": min(cfg.train.chunk, n_sel), "vocab": x.S.vocab, "cuda_graphs": graphs}


def eval_workload(x: Ctx) -> dict:
    """Evaluation's shapes (stages/evaluate.py): every held-out prompt (at most data.num_eval) in one
    greedy batch, then teacher-forced over prompt + answer; on CUDA padded to the forward bucket
    (at least the run's forward length, Session.forward_length)."""
    cfg = x.cfg
    E, P, N = cfg.data.num_eval, cfg.data.max_prompt_tokens, cfg.eval.max_new_tokens
    graphs = x.device == "cuda" and cfg.rollout.cuda_graphs
    T = max(_bucket(P + cfg.rollout.max_new_tokens), _bucket(P + N)) if x.device == "cuda" else P + N
    n = E * N
    return {"prompts": E, "prompt_tokens": P, "prompt_bucket": -(-P // 16) * 16 if graphs else P, "new_tokens": N,
            "tokens": E * T, "response_positions": n, "chunk": min(cfg.eval.chunk, n), "cuda_graphs": graphs}


def _bucket(n: int) -> int:
    return -(-n // FORWARD_BUCKET) * FORWARD_BUCKET


def teacher_samples(cfg) -> bool:
    """rollout.sampler=teacher (the off-policy control): the teacher samples the loop's rollouts."""
    return getattr(cfg.rollout, "sampler", "student") == "teacher"


def engine_runs(sh: Shape, mcfg) -> bool:
    """The fast engine samples from this model (stages/engine/sampler.py `supported`), else the
    transformers fallback (int8, NF4 with dense_copy=false, other architectures)."""
    return sh.model_type in ENGINE_TYPES and engine_weights(mcfg)


def engine_weights(mcfg) -> bool:
    """The role's weights are ones the engine samples from: dense, or NF4 with its dense copy."""
    return mcfg.quant == "none" or mcfg.quant == "nf4" and getattr(mcfg, "dense_copy", True)


def decode_bytes(sh: Shape, B: int, Pb: int, N: int, s: int, top_p: float = 1.0) -> dict:
    """One fast-engine generate of B prompts (padded to Pb) for N new tokens: its static KV cache,
    sampling buffers [B, V] (head output + fp32 logits/logp/probs, + the cdf under top-p), the
    prefill's activations + fp32 attention scores (+ k/v repeated for GQA's math SDPA), a decode
    step's scratch."""
    L = Pb + N
    gqa = 2 * B * sh.heads * L * sh.head_dim * s if sh.heads != sh.kv_heads else 0  # math SDPA repeats k/v
    return {"kv": 2 * sh.layers * B * sh.kv_heads * L * sh.head_dim * s,
            "pick": B * sh.vocab * (s + 16 + (21 if top_p < 1 else 0)),
            "prefill": B * Pb * (2 * sh.hidden + 3 * sh.inter) * s + 2 * B * sh.heads * Pb * L * 4 + gqa,
            "step": gqa + B * (2 * sh.hidden + 3 * sh.inter) * s}


def _greedy(role: str, sh: Shape, quant: str, fast: bool, e: dict, s: int) -> list:
    """Evaluation's greedy answers of one role, all held-out prompts at once."""
    B, P, Pb, N = e["prompts"], e["prompt_tokens"], e["prompt_bucket"], e["new_tokens"]
    if fast:
        d = decode_bytes(sh, B, Pb, N, s)
        kv = f"KV cache [{sh.layers}, 2, {B}, {sh.kv_heads}, {Pb + N}, {sh.head_dim}]"
        if e["cuda_graphs"]:  # captured at this shape; the pool stays while the engine does
            return [(role, f"captured greedy decode of {B} held-out prompts (graph pool, kept): {kv} + the larger "
                     "scratch", d["kv"] + d["pick"] + max(d["prefill"], d["step"]), False)]
        return [(role, f"greedy decode of {B} held-out prompts: {kv} + the larger of prefill and sampling buffers",
                 d["kv"] + max(d["prefill"], d["pick"]), True)]
    kv = 2 * sh.layers * B * sh.kv_heads * (P + N) * sh.head_dim * s
    return [(role, f"greedy decode of {B} held-out prompts (transformers): dynamic KV cache + prefill logits "
             f"[{B}, {P}, {sh.vocab}] + the larger of prefill activations and sampling buffers",
             kv + B * P * sh.vocab * s + max(forward_bytes(sh, B * P, s), B * sh.vocab * (s + 16))
             + dequant_bytes(sh, quant, B * P, s), True)]


def _captured(role: str, sh: Shape, B: int, Pb: int, N: int, s: int, top_p: float, what: str) -> tuple:
    """The engine's captured prefill and decode step: their static KV cache and the pool of the larger scratch."""
    d = decode_bytes(sh, B, Pb, N, s, top_p)
    return (role, f"captured prefill + decode graphs{what}: static KV cache [{sh.layers}, 2, {B}, {sh.kv_heads}, "
            f"{Pb + N}, {sh.head_dim}] + the larger of the two scratches", d["kv"] + d["pick"] + max(d["prefill"], d["step"]),
            False)


def _call_buffers(role: str, sh: Shape, quant: str, fast: bool, graphs: bool, B: int, P: int, Pb: int, N: int,
                  s: int, top_p: float) -> list:
    """One rollout generate's own buffers: the fast engine's (none with graphs: the captured pool holds
    them), or the transformers fallback's (dynamic cache, LoRA unmerged, logits of every prompt position)."""
    d = decode_bytes(sh, B, Pb, N, s, top_p)
    if fast:
        return [] if graphs else [
            (role, f"KV cache of this call [{sh.layers}, 2, {B}, {sh.kv_heads}, {Pb + N}, {sh.head_dim}]", d["kv"], False),
            (role, f"prefill activations ({B} x {Pb} tokens) + attention scores", d["prefill"], True),
            (role, "sampling buffers [B, V] fp32", d["pick"], True)]
    return [(role, f"KV cache (dynamic) [{sh.layers}, {B}, {sh.kv_heads}, {P + N}, {sh.head_dim}] x2",
             2 * sh.layers * B * sh.kv_heads * (P + N) * sh.head_dim * s, False),
            (role, f"prefill logits [{B}, {P}, {sh.vocab}]", B * P * sh.vocab * s, False),
            (role, f"prefill activations ({B} x {P} tokens)", forward_bytes(sh, B * P, s), True),
            (role, "sampling buffers [B, V] fp32", d["pick"], True),
            (role, "quantized matmul scratch", dequant_bytes(sh, quant, B * P, s), False)]


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
    if not x.engine:
        eng = []
    elif in_place(x):  # the student's own weights: on CUDA no copy, unless LoRA targets the head (a merged copy);
        # on CPU the pristine copy of the projections lives in the same memory
        held = ([] if x.device == "cuda" else ["their pristine copy"]) + \
            (["the LM head's merged copy"] if head_copy_bytes(S, cfg.lora, s) else [])
        eng = [("student", f"rollout engine weights: the student's own, LoRA merged in place for each rollout "
                f"({' + '.join(held)})", (0 if x.device == "cuda" else pristine_bytes(S, s))
                + head_copy_bytes(S, cfg.lora, s), False)]
    else:
        eng = [("student", "rollout engine weights (fused q/k/v, gate/up; merged LoRA"
                + ("; every projection dequantized from NF4)" if sq == "nf4" else ")"),
                engine_copy_bytes(S, cfg.lora, s, dense=sq == "nf4"), False)]
    big = max(i * o for i, o in S.proj().values())
    remerge = []
    if x.engine and w["cuda_graphs"]:  # the captured prefill and decode step keep their static state and pool
        eng.append(_captured("student", S, B, Pb, N, s, cfg.rollout.top_p, " (one pool)"))
        # the captured LoRA re-merge (sampler.Engine.refresh) keeps its scratch (not under swap); an NF4
        # projection is dequantized to the compute dtype first
        nf4 = sq == "nf4"
        remerge = [("student", "captured LoRA re-merge (graph pool: fp32 merge of one projection"
                    + (", dequantized from NF4)" if nf4 else ")"), 3 * big * 4 + (big * s if nf4 else 0), False)]
    eng_kept, eng = eng + remerge, eng + ([] if moves else remerge)  # (evaluate keeps the engine whatever moves)
    teach = [("teacher", "weights: the student's base (shared, counted once)", 0, False)] if shared else \
        [("teacher", f"weights ({_label(tq, tdq, x.dtype)})", weight_bytes(T, tq, tdq, s), False)]
    # CUDA graphs of the teacher-forced forwards: each graph's pool keeps its forward's memory at
    # fixed addresses while the role stays on the device, so every phase holds it; under swap a role's
    # graphs are freed before each move (its own phase holds about what eager does: the capture's
    # passes, one at a time)
    graphed_all = graphed_roles(cfg, x.device)  # (under swap the loop's phases hold none: `t_pool`, `s_pool`)
    tquant = sq if shared else tq
    t_fwd = forward_bytes(T, t, s) + t * T.hidden * s  # the teacher's forward activations + hidden states
    kern = lora_kernels(cfg, "student", x.device)
    a, scratch = saved_per_token_layer(S, cfg.lora, s, kern), t * (2 * S.hidden + 3 * S.inter) * 4
    saved = t * (S.layers * a + 4 * S.hidden)  # the student's saved activations (update)
    ckpt = getattr(cfg.train, "activation_checkpointing", False)
    ck_inputs = t * (S.layers * S.hidden * s + 4 * S.hidden)  # checkpointed: each layer keeps only its input
    # a graphed NF4 role's pool keeps the dequantized projection its capture allocated, too
    t_dq, s_dq = dequant_bytes(T, tquant, t, s), dequant_bytes(S, sq, t, s)
    t_pool_all = [("teacher", "captured scoring forward (graph pool: activations + hidden states"
                   + (" + a dequantized projection)" if tquant == "nf4" else ")"), t_fwd + t_dq, False)] \
        if "teacher" in graphed_all else []
    held, what = (ck_inputs + t * a, "checkpointed layer inputs + one layer recomputed") if ckpt else \
        (saved, "saved activations")
    s_pool_all = [("student", f"captured update forward + backward (graph pool: {what} + backward scratch"
                   + (" + a dequantized projection)" if sq == "nf4" else ")"), held + scratch + s_dq, False)] \
        if "student" in graphed_all else []
    t_pool, s_pool = ([], []) if moves else (t_pool_all, s_pool_all)
    out: dict[str, list] = {}

    if teacher_samples(cfg):  # rollout.teacher_sampler: an engine on the teacher for each rollout, dropped
        # after it; the student samples only in evaluation, which builds its engine (eng_kept)
        eng, tf = [], engine_runs(T, cfg.teacher)
        tg = x.device == "cuda" and cfg.rollout.cuda_graphs and tf
        tPb = -(-P // 16) * 16 if tg else P
        ro = ([] if moves else stud) + teach  # (swap: the teacher's phase, the student in host memory)
        if tf:
            ro.append(("teacher", "rollout engine weights for this rollout (fused q/k/v, gate/up"
                       + ("; every projection dequantized from NF4)" if tquant == "nf4" else ")"),
                       plain_engine_bytes(T, s, dense=tquant == "nf4"), False))
        if tg:
            ro.append(_captured("teacher", T, B, tPb, N, s, cfg.rollout.top_p, " for this rollout"))
        ro += _call_buffers("teacher", T, tquant, tf, tg, B, P, tPb, N, s, cfg.rollout.top_p)
    else:
        ro = stud + eng + ([] if moves else teach)
        if x.engine and moves:  # the engine is rebuilt inside each rollout: fp32 scratch of one merge
            ro.append(("student", "engine build scratch (fp32 merge of one projection)", 3 * big * 4, True))
        ro += _call_buffers("student", S, sq, x.engine, w["cuda_graphs"], B, P, Pb, N, s, cfg.rollout.top_p)
    out["rollout"] = ro + t_pool + s_pool

    sc = ([] if moves else stud + eng) + teach
    sc += t_pool or [("teacher", f"forward activations ({t} tokens) + last hidden states [{t}, H]", t_fwd, True)]
    sc += s_pool + [("teacher", f"logits chunk [{c}, {V}] fp32 x3 (log_softmax, exp, entropy term)", 3 * c * V * 4, True),
                    ("teacher", f"selected hidden states [{n}, H]", n * T.hidden * s, False),
                    ("teacher", "log-probs, entropy, top-k ids and log-probs", n * (8 + 12 * k), False),
                    ("teacher", "quantized matmul scratch", 0 if t_pool else t_dq, False)]
    out["score"] = sc

    full = "full" in objectives.needs(cfg.objective)
    up = stud + ([] if moves else eng + teach + t_pool)
    if s_pool:
        up += s_pool
    elif ckpt:
        up += [("student", f"checkpointed layer inputs ({t} tokens x {S.layers} layers)", ck_inputs, False),
               ("student", "backward: one layer's activations recomputed + scratch", t * a + scratch, True)]
    else:
        lora_path = "LoRA kernels: bf16 inputs" if kern else "PEFT's LoRA: fp32 inputs"  # (codepaths.lora_kernels)
        up += [("student", f"saved activations ({t} tokens x {S.layers} layers; {lora_path})", saved, False),
               ("student", "backward scratch (one layer)", scratch, True)]
    up += [("student", f"loss chunk [{c}, {V}] fp32 x4" + (" + teacher logits" if full else "")
            + f" + hidden-state grad [{n}, H]", (5 if full else 4) * c * V * 4 + n * S.hidden * s, True),
           ("student", "quantized matmul scratch", 0 if s_pool else s_dq, False)]
    out["update"] = up

    # evaluate (stages/evaluate.py): the loop's holdings stay (every placement: see the docstring), the
    # teacher's greedy engine stays for the whole evaluation; greedy answers of the teacher, then of
    # policy 0 and policy K, one after another, then the held-out KL of each
    e = eval_workload(x)
    te, ne, ce = e["tokens"], e["response_positions"], e["chunk"]
    t_fast = engine_runs(T, cfg.teacher)  # (shared_backbone: the student's quant, the teacher's dense_copy)
    ev = stud + eng_kept + teach + t_pool_all + s_pool_all
    if t_fast:
        ev.append(("teacher", "evaluation's greedy engine weights (fused q/k/v, gate/up"
                   + ("; every projection dequantized from NF4)" if tquant == "nf4" else ")"),
                   plain_engine_bytes(T, s, dense=tquant == "nf4"), False))
    ev += _greedy("teacher", T, tquant, t_fast, e, s) + _greedy("student", S, sq, x.engine, e, s)
    fwd = {"teacher": forward_bytes(T, te, s) + te * T.hidden * s,  # activations + hidden states
           "student": forward_bytes(S, te, s) + te * S.hidden * s}
    for role in ("teacher", "student"):  # a captured no-grad forward at evaluation's shape keeps its pool
        if role in graphed_all:
            ev.append((role, f"captured held-out forward ({te} tokens; graph pool, kept): activations + hidden "
                       "states", fwd[role], False))
    loose = [fwd[r] for r in ("teacher", "student") if r not in graphed_all]
    ev += [("student", f"held-out KL: both roles' hidden states [{ne}, H] + the larger of "
            + ("a forward's activations + hidden states and " if loose else "")
            + f"a KL chunk [{ce}, {V}] fp32 x5", ne * (T.hidden + S.hidden) * s + max(loose + [5 * ce * V * 4]), True),
           ("teacher", "quantized matmul scratch", dequant_bytes(T, tquant, te, s), False),
           ("student", "quantized matmul scratch", dequant_bytes(S, sq, te, s), False)]
    out["evaluate"] = ev

    return {ph: [i for i in items if i[2] or "shared" in i[1]] for ph, items in out.items()}


def phase_total(items) -> int:
    """Held items add up; of the one-after-another (alt) items only the largest counts."""
    return sum(b for *_, b, alt in items if not alt) + max((b for *_, b, alt in items if alt), default=0)
