"""`opd plan`: shapes without weights, the byte arithmetic against hand-computed figures (tiny
configs and the real SmolLM2-360M/1.7B shapes), placement choice, refusals and suggestions, the
activation formula against autograd's saved tensors, and the CUDA probe (gpu)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stages import cli
from stages.run import codepaths, config
from stages.memory import phases, plan, shapes
from stages.run.config import ROOT, LoraCfg, ModelCfg
from stages.errors import UserError
from support import TOKENIZER

GIB = 2**30
TINY = ["student.name=arch:tiny-llama", "student.init=random", "student.keep_layers=0",
        "teacher.name=arch:tiny-llama-teacher", "teacher.init=random", "objective.topk=8", *TOKENIZER]
# the seed workload of ANCHORS.md: SmolLM2-360M student, SmolLM2-1.7B teacher, 128 + 64 tokens, 4 prompts
SEED = ["student.name=arch:smollm2-360m", "student.init=random", "student.keep_layers=0",
        "teacher.name=arch:smollm2-1.7b", "teacher.init=random", "data.max_prompt_tokens=128",
        "rollout.max_new_tokens=64", "rollout.batch_size=4", "runtime.device=cuda", "memory.vram_gib=16", *TOKENIZER]


def cfg(*over):
    return config.compose(list(over))


def item(est, phase, prefix, placement="resident", role="student"):
    ph = est["placements"][placement]["phases"]
    hits = [i["bytes"] for i in ph[phase]["items"] if i["component"].startswith(prefix) and i["role"] == role]
    assert len(hits) == 1, (phase, prefix, [i["component"] for i in ph[phase]["items"]])
    return hits[0]


# ---- shapes ----

def test_shapes_from_arch_and_gguf_header():
    s = shapes.shape_of(ModelCfg(name="arch:smollm2-360m", init="random"), "student")
    assert (s.vocab, s.hidden, s.inter, s.layers, s.heads, s.kv_heads, s.head_dim, s.tied) == \
        (49152, 960, 2560, 32, 15, 5, 64, True)
    e = shapes.shape_of(ModelCfg(name="embedded", keep_layers=15), "student")  # SmolLM2-135M, header only
    assert (e.vocab, e.hidden, e.inter, e.layers, e.heads, e.kv_heads, e.head_dim, e.tied) == \
        (49152, 576, 1536, 15, 9, 3, 64, True)
    assert "GGUF" in e.source


def test_parameter_counts_match_the_published_models():
    # HF model cards: SmolLM2-360M 361,821,120 and SmolLM2-1.7B 1,711,376,384 parameters
    assert shapes.shape_of(ModelCfg(name="arch:smollm2-360m", init="random"), "s").params() == 361_821_120
    assert shapes.shape_of(ModelCfg(name="arch:smollm2-1.7b", init="random"), "t").params() == 1_711_376_384
    # tiny-llama: 2 x (64*64 + 2*64*32 + 64*64 + 3*64*128) + 49152*64 + 2*2*64 + 64 (tied head)
    assert shapes.shape_of(ModelCfg(name="arch:tiny-llama", init="random"), "s").params() == 3_219_776


def test_keep_layers_beyond_the_model_is_refused():
    with pytest.raises(UserError, match=r"student.keep_layers' = 40; the model has only 32"):
        shapes.shape_of(ModelCfg(name="arch:smollm2-360m", init="random", keep_layers=40), "student")


# ---- byte arithmetic, by hand ----

def test_tiny_weights_lora_and_activation_bytes_by_hand():
    s = shapes.shape_of(ModelCfg(name="arch:tiny-llama", init="random"), "s")
    lora = LoraCfg(r=16)
    assert shapes.weight_bytes(s, "none", False, 4) == 3_219_776 * 4
    # nf4: 73,728 linear weights at 0.5 B + one fp32 absmax per 64 (4,608 B); the rest fp32
    assert shapes.weight_bytes(s, "nf4", False, 4) == 36_864 + 4_608 + 3_146_048 * 4
    # double quant: uint8 absmax per 64 (1,152 B) + an fp32 per 256 blocks (18 B)
    assert shapes.weight_bytes(s, "nf4", True, 4) == 36_864 + 1_152 + 18 + 3_146_048 * 4
    # int8: 1 B per weight + an fp32 scale per output row (2 x 512 rows)
    assert shapes.weight_bytes(s, "int8", False, 2) == 73_728 + 4_096 + 3_146_048 * 2
    # LoRA r16 on 7 projections: 16 x (sum of in+out = 1,024) per layer, 2 layers
    assert shapes.lora_params(s, lora) == 32_768
    # saved activations per token and layer: fp32 16H + 16q + 16I + 28r; bf16 28H + 12q + 10I + 28r
    assert shapes.saved_per_token_layer(s, lora, 4) == 16 * 64 + 16 * 64 + 16 * 128 + 28 * 16 == 4_544
    assert shapes.saved_per_token_layer(s, lora, 2) == 28 * 64 + 12 * 64 + 10 * 128 + 28 * 16 == 4_288
    # the engine's weights: q/k/v and gate/up are fused (copies) even where LoRA does not reach
    assert shapes.engine_copy_bytes(s, LoraCfg(r=16, target_modules=["q_proj", "v_proj"]), 4) == \
        2 * (4_096 + 2_048 + 2_048 + 8_192 + 8_192) * 4
    assert shapes.engine_copy_bytes(s, lora, 4) == 73_728 * 4
    # LoRA on q and v only (bf16): norms 8H + attention 4q*2 + MLP 3I*2 + 2 fp32 input copies + 2 x 4r
    assert shapes.saved_per_token_layer(s, LoraCfg(r=16, target_modules=["q_proj", "v_proj"]), 2) == \
        8 * 64 + 8 * 64 + 6 * 128 + 2 * 4 * 64 + 2 * 4 * 16


def test_seed_workload_components_by_hand():
    est = plan.estimate(cfg(*SEED))
    assert est["device"] == "cuda" and est["dtype"] == "bf16" and est["budget_source"] == "memory.vram_gib"
    w = est["workload"]
    assert (w["sequences"], w["prompt_bucket"], w["new_tokens"], w["tokens"], w["chunk"]) == (4, 128, 64, 768, 256)
    assert item(est, "update", "weights (bf16)") == 361_821_120 * 2
    assert item(est, "update", "weights (bf16)", role="teacher") == 1_711_376_384 * 2
    # the engine's merged copy: every decoder projection (314,572,800 weights) in bf16
    assert item(est, "rollout", "rollout engine weights") == 314_572_800 * 2
    # KV cache: 2 x 32 layers x 4 seqs x 5 kv heads x (128 + 64) x 64 x 2 B = 30 MiB, held once, in
    # the captured prefill's and decode step's pool, which stays resident in every phase (no per-call copy)
    kv = 31_457_280
    assert not [i for i in est["placements"]["resident"]["phases"]["rollout"]["items"]
                if i["component"].startswith("KV cache of this call")]
    # that pool's scratch: the larger of the prefill's (4 x 128 tokens' activations + fp32 attention
    # scores [4, 15, 128, 192] x2 + the GQA-repeated k/v) and a decode step's
    gqa = 2 * 4 * 15 * 192 * 64 * 2
    prefill = 4 * 128 * (2 * 960 + 3 * 2560) * 2 + 2 * 4 * 15 * 128 * 192 * 4 + gqa
    assert prefill > gqa + 4 * (2 * 960 + 3 * 2560) * 2
    pool = 4 * 49152 * (2 + 16) + prefill
    assert item(est, "score", "captured prefill + decode graphs") == kv + pool
    # phase totals: held items add up, one-at-a-time transients count their largest
    eager = plan.estimate(cfg(*SEED, "runtime.cuda_graphs=false"))
    sc = eager["placements"]["resident"]["phases"]["score"]["items"]
    fwd = item(eager, "score", "forward activations", role="teacher")
    assert fwd == 768 * (2 * 2048 + 3 * 8192) * 2 + 768 * 2048 * 2
    # the plan reports GiB rounded to 4 decimals of integer byte counts: the same rounding, exactly
    assert eager["placements"]["resident"]["phases"]["score"]["total_gib"] == round(
        (sum(i["bytes"] for i in sc if not i["one_at_a_time"]) + max(fwd, 3 * 256 * 49152 * 4)) / GIB, 4)
    # CUDA graphs of the teacher-forced forwards (the default): each graph's pool stays allocated, so
    # the teacher's forward and the student's saved activations + backward scratch are held in every phase
    t_pool = item(est, "rollout", "captured scoring forward", role="teacher")
    s_pool = item(est, "score", "captured update forward")
    assert t_pool == fwd
    # per token and layer: two fp32 norm inputs (8 x 960), SDPA's q, k, v, output (4 x 960 x 2), the MLP's
    # gate, act, up (3 x 2560 x 2), and what the LoRA kernels keep: the three bf16 inputs the projections
    # read (attention's and the MLP's normed inputs, 960 x 2 each; the MLP's product, 2560 x 2; the
    # attention output is SDPA's own) and lora_A's fp32 [16] output per projection (7 x 64)
    a = 8 * 960 + 4 * 960 * 2 + 3 * 2560 * 2 + (2 * 960 + 2560) * 2 + 7 * 64
    assert a == 40_128
    assert s_pool == 768 * (32 * a + 3_840) + 768 * (2 * 960 + 3 * 2560) * 4  # saved + backward scratch
    tot = lambda e, ph: sum(i["bytes"] for i in e["placements"]["resident"]["phases"][ph]["items"]  # noqa: E731
                            if not i["one_at_a_time"])
    assert tot(est, "rollout") - tot(eager, "rollout") == t_pool + s_pool
    # swap moves the models: their graphs go with each move, nothing held across the loop's phases
    assert all("captured scoring" not in i["component"] for name, ph in est["placements"]["swap"]["phases"].items()
               if name in phases.LOOP for i in ph["items"])
    # one score chunk: 3 fp32 [256, 49152] tensors; one loss chunk: 4
    assert item(est, "score", "logits chunk", role="teacher") == 3 * 256 * 49152 * 4
    assert item(est, "update", "loss chunk") == 4 * 256 * 49152 * 4 + 256 * 960 * 2  # + grad of [n, H]
    # saved activations: 768 tokens x (32 x 40,128 + 4 x 960) B; PEFT's LoRA keeps each projection's input
    # in fp32 instead (3 x 960 + 960 + 2 x 960 + 2560, x 4 B: 64,448 per token and layer in all)
    assert item(eager, "update", "saved activations") == 768 * (32 * a + 3_840)
    assert item(eager, "update", "saved activations (768 tokens x 32 layers; LoRA kernels: bf16 inputs)")
    peft = plan.estimate(cfg(*SEED, "runtime.cuda_graphs=false", "runtime.lora_kernels=false"))
    assert item(peft, "update", "saved activations") == 768 * (32 * 64_448 + 3_840)
    assert item(peft, "update", "saved activations (768 tokens x 32 layers; PEFT's LoRA: fp32 inputs)")
    assert a + (6 * 960 + 2560) * 4 - (2 * 960 + 2560) * 2 == 64_448
    # activation checkpointing: each layer keeps its bf16 input; the backward recomputes one layer
    # (eager: without graphs; captured, one graph pool holds both and stays allocated between updates)
    ck_eager = plan.estimate(cfg(*SEED, "train.activation_checkpointing=true", "runtime.cuda_graphs=false"))
    assert item(ck_eager, "update", "checkpointed layer inputs") == 768 * (32 * 960 * 2 + 3_840)
    assert item(ck_eager, "update", "backward: one layer") == 768 * a + 768 * (2 * 960 + 3 * 2560) * 4
    ck = plan.estimate(cfg(*SEED, "train.activation_checkpointing=true"))
    assert item(ck, "update", "captured update forward + backward") == item(ck, "rollout", "captured update") == \
        768 * (32 * 960 * 2 + 3_840) + 768 * a + 768 * (2 * 960 + 3 * 2560) * 4
    assert ck["placements"]["resident"]["peak_gib"] < est["placements"]["resident"]["peak_gib"] - 0.8  # (32 - 1 layers' saved)
    lora = 8_683_520 * 4  # r16 x (1920 + 1280 + 1280 + 1920 + 3 x 3520) per layer x 32, fp32
    assert item(est, "update", "AdamW") == 2 * lora
    # swap: the teacher is not on the device during update, nor the engine's copy
    sw = est["placements"]["swap"]["phases"]["update"]["items"]
    assert not [i for i in sw if i["role"] == "teacher" or "engine" in i["component"]]
    tot = est["placements"]["resident"]["phases"]
    assert est["peak_gib"] == max(p["total_gib"] for p in tot.values()) and est["peak_phase"] == "evaluate"
    assert est["loop_peak_gib"] == tot["update"]["total_gib"] == max(tot[ph]["total_gib"] for ph in phases.LOOP)


def test_merge_in_place_drops_the_engine_copy_from_every_phase():
    ck = plan.estimate(cfg(*SEED, "train.activation_checkpointing=true"))
    own = plan.estimate(cfg(*SEED, "train.activation_checkpointing=true", "memory.merge_in_place=true"))
    copy = item(ck, "rollout", "rollout engine weights")
    assert copy == 314_572_800 * 2
    assert not [i for i in own["phases"]["rollout"]["items"] if "engine weights" in i["component"]]  # no copy
    for ph in ("rollout", "score", "update"):  # exactly the copy's bytes less, in every phase
        a, b = (e["placements"]["resident"]["phases"][ph]["total_gib"] for e in (ck, own))
        assert abs((a - b) * GIB - copy) <= GIB * 1e-4, ph
    assert own["loop_peak_gib"] < 4.6 < ck["loop_peak_gib"]  # the seed target with checkpointing (README): the loop
    assert any("pristine copy, 0.59 GiB, stays in host memory, pinned (1.00 GiB of page-locked memory" in n
               for n in own["notes"])
    # a LoRA on the LM head: the engine's head is a merged copy in either mode
    head = plan.estimate(cfg(*SEED, "memory.merge_in_place=true", "lora.target_modules=[q_proj,lm_head]"))
    assert item(head, "rollout", "rollout engine weights: the student's own") == 49152 * 960 * 2
    # an NF4 student is not suggested beside merge_in_place (validation refuses the pair)
    assert not any("student.quant" in t["set"] for t in plan.estimate(cfg(
        *[o for o in SEED if not o.startswith("memory.vram")], "memory.vram_gib=5.2", "memory.merge_in_place=true",
        "memory.placement=resident"))["suggestions"])
    assert own["models"]["student"]["rollout_engine"] == "fast (LoRA merged into the student's own weights)"
    # on CPU the host copy is in the same memory: it counts where the engine's copy did
    cpu = plan.estimate(cfg(*SEED[:-2], "runtime.device=cpu", "memory.merge_in_place=true"))
    assert item(cpu, "rollout", "rollout engine weights: the student's own") == 314_572_800 * 4
    # the merge-in-place suggestion of an infeasible plan (evaluate's peak: swap does not lower it)
    tight = plan.estimate(cfg(*[o for o in SEED if not o.startswith("memory.vram")], "memory.vram_gib=8.8",
                              "train.activation_checkpointing=true", "memory.placement=resident"))
    assert {"memory.merge_in_place": True} in [t["set"] for t in tight["suggestions"] if t["fits"]]
    assert "peak 8.21 GiB (evaluate, placement resident)" in plan.infeasible_message(tight)
    assert "fits with: memory.merge_in_place=true (7.62 GiB, resident); student.quant=nf4" in \
        plan.infeasible_message(tight)  # as the command line takes it
    assert not any("memory.placement" in t["set"] for t in tight["suggestions"])


def test_totals_are_the_sum_of_their_items():
    est = plan.estimate(cfg(*SEED, "student.quant=nf4", "teacher.quant=nf4"))
    for p in est["placements"].values():
        for ph in p.get("phases", {}).values():
            held = sum(i["bytes"] for i in ph["items"] if not i["one_at_a_time"])
            alt = max((i["bytes"] for i in ph["items"] if i["one_at_a_time"]), default=0)
            assert ph["total_gib"] == round((held + alt) / GIB, 4)  # integer bytes, the plan's own rounding
    # NF4 student: the engine samples from a dense copy of every projection (more than bf16's fused copies)
    assert est["models"]["student"]["rollout_engine"] == "fast (dense copy of the NF4 base, merged LoRA)"
    # (with LoRA on all 7 projections bf16 copies them all too; with fewer, bf16 shares o/down, NF4 cannot)
    few = "lora.target_modules=[q_proj,v_proj]"
    nf4, plain = plan.estimate(cfg(*SEED, few, "student.quant=nf4")), plan.estimate(cfg(*SEED, few))
    assert item(nf4, "rollout", "rollout engine weights") == item(est, "rollout", "rollout engine weights") > \
        item(plain, "rollout", "rollout engine weights")
    # int8 student: no copy, transformers fallback with its prompt logits
    i8 = plan.estimate(cfg(*SEED, "student.quant=int8"))
    assert i8["models"]["student"]["rollout_engine"] == "transformers fallback"
    assert item(i8, "rollout", "prefill logits") == 4 * 128 * 49152 * 2
    # NF4 without the dense copies (dense_copy=false): no engine weights in any phase, the teacher's greedy
    # engine of evaluation gone too; sampled through transformers as int8 is
    small = plan.estimate(cfg(*SEED, "student.quant=nf4", "teacher.quant=nf4", "student.dense_copy=false",
                              "teacher.dense_copy=false"))
    assert small["models"]["student"]["rollout_engine"] == "transformers fallback"
    assert item(small, "rollout", "prefill logits") == 4 * 128 * 49152 * 2
    phases = small["placements"]["resident"]["phases"]
    assert not [i for ph in phases.values() for i in ph["items"] if "engine weights" in i["component"]]
    copy = item(est, "rollout", "rollout engine weights")
    t_copy = item(est, "evaluate", "evaluation's greedy engine weights", role="teacher")
    total = lambda e, ph: e["placements"]["resident"]["phases"][ph]["total_gib"] * GIB  # noqa: E731
    # the copy less; the fallback's own buffers (dynamic cache, prompt logits) about the graphs it drops
    assert abs(total(small, "rollout") - (total(est, "rollout") - copy)) < 0.1 * GIB
    # the 2 GiB card: NF4 alone does not fit (evaluation's greedy engine of the teacher), without the
    # dense copies and the captured graphs' pools it does, and the infeasible plan says so
    tight = plan.estimate(cfg(*[o for o in SEED if not o.startswith("memory.vram")], "memory.vram_gib=2",
                              "student.quant=nf4", "teacher.quant=nf4", "train.activation_checkpointing=true",
                              "train.chunk=128", "data.num_eval=4", "eval.max_new_tokens=8", "memory.placement=resident"))
    assert not tight["feasible"] and [t["set"] for t in tight["suggestions"]] == \
        [{"student.dense_copy": False, "teacher.dense_copy": False, "runtime.cuda_graphs": False}]
    assert "fits with: teacher.dense_copy=false student.dense_copy=false runtime.cuda_graphs=false (1.65 GiB, " \
        "resident)" in \
        plan.infeasible_message(tight)
    assert total(small, "evaluate") < total(est, "evaluate") - copy - t_copy


def test_nf4_rungs_keep_the_students_sampling_copy_while_cheaper_changes_fit(monkeypatch):
    """The NF4 ladder, cheapest first: the teacher's dense copy (evaluation's), then the captured graphs,
    the student's copy (its rollout) last. At 3.5 GiB the seed pair fits as NF4 without the teacher's
    copy and without graphs, and keeps the student's fast sampler; graphs off is never offered alone."""
    over = [*[o for o in SEED if not o.startswith("memory.vram")], "memory.vram_gib=3.5",
            "train.activation_checkpointing=true", "memory.placement=resident"]
    est = plan.estimate(cfg(*over))
    want = {"student.quant": "nf4", "teacher.quant": "nf4", "teacher.dense_copy": False, "runtime.cuda_graphs": False}
    assert [t["set"] for t in est["suggestions"]] == [want]
    assert est["suggestions"][0]["peak_gib"] <= 3.5 * 0.9
    rungs = [dict(c) for label, g in plan._variants(cfg(*over)) if label == "quant" for c in g]
    assert rungs.index(want) < rungs.index({**want, "student.dense_copy": False})
    # without bitsandbytes no NF4 rung, and no rung of graphs off alone
    monkeypatch.setattr(plan, "_bitsandbytes", lambda: False)
    assert [c for label, g in plan._variants(cfg(*over)) if label == "quant" for c in g] == []
    # where no role replays graphs (the CPU; compiled layers) turning them off is not offered
    cpu = [o.replace("runtime.device=cuda", "runtime.device=cpu") for o in over]
    for no_graphs in (cfg(*cpu, "student.quant=nf4"), cfg(*over, "student.quant=nf4", "runtime.compile_layers=true")):
        assert not any("runtime.cuda_graphs" in dict(c) for _, g in plan._variants(no_graphs) for c in g)
    assert any("runtime.cuda_graphs" in dict(c) for _, g in plan._variants(cfg(*over, "student.quant=nf4")) for c in g)


def test_activation_formula_matches_autograd_saved_tensors():
    """Bytes autograd saves per layer and token (measured through saved_tensors_hooks, one layer
    against two) equal the plan's formula within 3%, in fp32 and bf16."""
    from engine_models import tiny

    from stages.engine import lmhead
    from stages.weights import lora

    def saved(dtype, layers):
        m = tiny("tiny-llama-teacher", num_hidden_layers=layers).to(dtype).requires_grad_(False)
        s = lora.add(m, LoraCfg(r=16), 1)
        p = lmhead.pack([[1] + list(range(100, 130)), [1] + list(range(200, 220))], [[5] * 9, [6] * 9],
                        [[1] * 9, [1] * 9], 2, "cpu")
        seen, params = {}, {q.untyped_storage().data_ptr() for q in s.parameters()}

        def pack_hook(x):
            seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
            return x

        s.train()
        with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda x: x):
            lmhead.hidden(s, p)
        return sum(v for k, v in seen.items() if k not in params), p.ids.numel()

    sh = shapes.shape_of(ModelCfg(name="arch:tiny-llama-teacher", init="random"), "t")
    for dtype, nbytes in ((torch.float32, 4), (torch.bfloat16, 2)):
        (one, t), (two, _) = saved(dtype, 1), saved(dtype, 2)
        per = (two - one) / t
        # Not a rounding tolerance: both sides are exact integer byte counts (no seed or CPU dependence).
        # The formula leaves out small per-layer bookkeeping tensors (here it is 2.8% under in fp32,
        # 1.7% in bf16); 3% is the accuracy the README states for `opd plan`.
        assert per == pytest.approx(shapes.saved_per_token_layer(sh, LoraCfg(r=16), nbytes), rel=0.03), dtype


# ---- placements ----

def test_auto_picks_resident_then_swap_then_refuses_with_fixes():
    big = plan.estimate(cfg(*SEED))
    assert big["placement"]["chosen"] == "resident" and big["feasible"] and big["headroom_gib"] > 0
    # evaluate holds both roles under every placement: swap lowers the training loop's peak, not the run's
    res, sw = big["placements"]["resident"], big["placements"]["swap"]
    assert sw["loop_peak_gib"] < res["loop_peak_gib"] and sw["peak_gib"] == res["peak_gib"]
    assert sw["peak_phase"] == res["peak_phase"] == "evaluate"
    mid = plan.estimate(cfg(*SEED, f"memory.vram_gib={(sw['loop_peak_gib'] + res['loop_peak_gib']) / 2 / 0.9:.3f}"))
    assert mid["placement"]["chosen"] == "swap" and not mid["feasible"]  # of equal peaks, the one whose loop fits
    assert "its training loop 3.33 GiB fits, evaluate does not" in mid["placement"]["why"]
    # an update larger than the evaluation (eager, 16 prompts): there swap makes the run fit
    wide = [*SEED, "runtime.cuda_graphs=false", "rollout.batch_size=16"]
    e = plan.estimate(cfg(*wide))
    res, sw = e["placements"]["resident"]["peak_gib"], e["placements"]["swap"]["peak_gib"]
    assert sw < res and e["placements"]["resident"]["peak_phase"] == "update"
    mid = plan.estimate(cfg(*wide, f"memory.vram_gib={(sw + res) / 2 / 0.9:.3f}"))
    assert mid["placement"]["chosen"] == "swap" and mid["feasible"] and "swap keeps one role" in mid["placement"]["why"]
    small = plan.estimate(cfg(*SEED, "memory.vram_gib=8"))
    assert not small["feasible"] and small["suggestions"]
    for sug in small["suggestions"]:  # every suggested setting really fits
        assert sug["fits"]
        again = plan.estimate(cfg(*SEED, "memory.vram_gib=8", *[f"{k}={v}" for k, v in sug["set"].items()]))
        assert again["feasible"], sug
    assert {"student.quant", "teacher.quant"} <= {k for s in small["suggestions"] for k in s["set"]}
    tiny = plan.estimate(cfg(*SEED, "memory.vram_gib=1"))  # nothing fits: the strongest combination, named
    assert [s["fits"] for s in tiny["suggestions"]] == [False]
    assert "no change tried fits" in plan.infeasible_message(tiny) and "rollout.batch_size=1" in \
        plan.infeasible_message(tiny)


def test_shared_backbone_is_one_copy_and_auto_prefers_it():
    same = ["student.name=arch:smollm2-360m", "student.init=random", "student.keep_layers=0",
            "teacher.name=arch:smollm2-360m", "teacher.init=random", "runtime.device=cuda", "memory.vram_gib=16",
            "runtime.cuda_graphs=false"]  # (the graph pools, which differ by the teacher's forward, aside)
    est = plan.estimate(cfg(*same))
    assert est["placement"]["chosen"] == "shared_backbone"
    sh, res = est["placements"]["shared_backbone"], est["placements"]["resident"]
    # two figures each rounded to 4 decimals (<= 5e-5 off; the float64 division and subtraction add
    # ~1e-16): their difference is within 1e-4 of the one bf16 copy of the weights it saves
    assert abs(res["peak_gib"] - sh["peak_gib"] - 361_821_120 * 2 / GIB) <= 1e-4 + 1e-12


@pytest.mark.parametrize("over,needle", [
    (["memory.placement=swap", "student.quant=nf4"], "use memory.placement=resident"),
    (["memory.placement=swap", "teacher.quant=int8"], "teacher.quant=int8 is a bitsandbytes-quantized role"),
    (["memory.placement=shared_backbone"], "bases differ (student.name="),
    (["memory.placement=swap", "memory.merge_in_place=true"], "would undo its weights' fused layout"),
])
def test_refused_placements(over, needle):
    with pytest.raises(UserError) as e:
        plan.estimate(cfg(*TINY, *over))
    assert needle in str(e.value) and "\n" not in str(e.value)


# ---- the command ----

def run_cli(capsys, *argv):
    code = cli.main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_prints_the_table_and_writes_json(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    code, out, err = run_cli(capsys, *SEED, "--out", str(tmp_path / "plan.json"))
    assert code == 0, err
    assert "update total" in out and "placement: resident" in out and "headroom" in out
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["feasible"] and data["placement"]["chosen"] == "resident" and set(data["phases"]) == set(phases.PHASES)


def test_cli_infeasible_exits_2_with_numbers_and_fixes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    code, out, err = run_cli(capsys, *SEED, "memory.vram_gib=8", "--out", str(tmp_path / "plan.json"))
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "plan infeasible: peak" in err and "memory.vram_gib" in err and "fits with:" in err and "nf4" in err
    assert json.loads((tmp_path / "plan.json").read_text())["feasible"] is False


@pytest.mark.parametrize("over,needle", [
    (["memory.vram_gib=0"], "memory.vram_gib"),
    (["memory.vram_gib=-4"], "memory.vram_gib"),
    (["memory.chunk_floor=0"], "memory.chunk_floor"),
    (["memory.margin=1.5"], "memory.margin"),
    (["memory.placement=everywhere"], "memory.placement"),
    (["student.double_quant=true"], "student.double_quant"),
    (["teacher.dense_copy=false"], "teacher.dense_copy"),
    (["memory.placement=swap", "student.quant=nf4"], "memory.placement=resident"),
    (["memory.placement=shared_backbone"], "shared_backbone"),
])
def test_cli_bad_input_is_one_line_exit_2(monkeypatch, capsys, over, needle):
    monkeypatch.chdir(ROOT)
    code, _, err = run_cli(capsys, *TINY, *over)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and needle in err, err


def test_nf4_without_bitsandbytes_is_refused(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(plan, "_bitsandbytes", lambda: False)
    code, _, err = run_cli(capsys, *TINY, "teacher.quant=nf4")
    assert code == 2 and "teacher.quant" in err and "bitsandbytes" in err, err


# ---- the probe (CUDA) ----

@pytest.mark.gpu
def test_probe_runs_zero_updates_is_cached_and_near_the_plan(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "conf").symlink_to(ROOT / "conf")
    argv = [*TINY, "rollout.max_new_tokens=16", "--probe", "--out", str(tmp_path / "plan.json")]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    data = json.loads((tmp_path / "plan.json").read_text())
    pr = data["probe"]
    assert pr["optimizer_updates"] == 0 and not pr["cached"] and "measured GiB" in out
    assert set(pr["phases"]) >= {"rollout", "score", "update"}
    assert not (tmp_path / "artifacts/store/update").exists()  # nothing but the measurement published
    code, _, err = run_cli(capsys, *argv)
    assert code == 0 and json.loads((tmp_path / "plan.json").read_text())["probe"]["cached"], err


@pytest.mark.gpu
@pytest.mark.parametrize("quant", [[], ["student.quant=nf4", "teacher.quant=nf4"]])
def test_plan_within_15_percent_of_measured_on_the_seed_shapes(tmp_path, monkeypatch, capsys, quant):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "conf").symlink_to(ROOT / "conf")
    over = [o for o in SEED if not o.startswith("memory.vram_gib")]
    code, _, err = run_cli(capsys, *over, *quant, "memory.placement=resident", "--probe",
                           "--out", str(tmp_path / "plan.json"))
    assert code == 0, err
    data = json.loads((tmp_path / "plan.json").read_text())
    ratios = {ph: r["ratio"] for ph, r in data["probe"]["phases"].items()}
    peak = max(r["peak_allocated_gib"] for r in data["probe"]["phases"].values())  # (the loop's: no evaluate)
    assert abs(data["loop_peak_gib"] / peak - 1) <= 0.15, (data["loop_peak_gib"], peak, ratios)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_probe_without_cuda_is_one_line_exit_2(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    code, out, err = run_cli(capsys, *TINY, "--probe")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "--probe measures on CUDA" in err, err


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux: per-phase peak RSS")
def test_cpu_phase_peak_counts_what_the_process_keeps():
    """session.phase resets the peak before each phase (CUDA: reset_peak_memory_stats; CPU: VmHWM).
    On CPU the process keeps freed memory for reuse (stages/memory/hostmem.py): a later phase's peak
    RSS still holds what an earlier one freed, and the record says how much of it is free heap."""
    from stages.memory import hostmem
    from stages.session import phase

    hostmem.reset_rss_peak()
    # the resident set now, less the free heap it holds (an earlier test's freed memory, which the
    # phase's 256 MiB may reuse without growing the resident set)
    before = (hostmem.rss_peak() - (hostmem.free_heap_bytes() or 0)) / 2**30
    big, small = {}, {}
    with phase(torch.device("cpu"), big):
        x = torch.ones(64 * 2**20)  # 256 MiB
        del x
    with phase(torch.device("cpu"), small):
        y = torch.ones(1024)
        del y
    assert big["peak_rss_gib"] - before > 0.2, (before, big)  # the phase's own 256 MiB are in its peak
    if hostmem._applied:  # kept: the small phase's resident set still holds them, as free heap
        assert abs(small["peak_rss_gib"] - big["peak_rss_gib"]) < 0.05 and small["heap_free_gib"] >= 0.24, (big, small)
    else:  # glibc's default gave them back: the small phase's peak is its own
        assert big["peak_rss_gib"] - small["peak_rss_gib"] > 0.2, (big, small)


def test_graphed_roles_are_one_rule_for_the_plan_and_the_session():
    """codepaths.graphed_roles decides which roles replay CUDA graphs; the plan's pools follow it."""
    roles = lambda *o: codepaths.graphed_roles(cfg(*SEED, *o), "cuda")  # noqa: E731
    assert roles() == {"student", "teacher"} and codepaths.graphed_roles(cfg(*SEED), "cpu") == set()
    assert roles("runtime.cuda_graphs=false") == roles("runtime.compile_layers=true") == set()
    assert roles("lora.dropout=0.05") == {"teacher"}
    assert roles("train.activation_checkpointing=true") == {"student", "teacher"}  # the backward recomputes, captured
    # NF4 is captured (a dequantize kernel and a matmul per projection); int8 is not (its outliers are
    # found on the host every forward)
    assert roles("teacher.quant=nf4") == roles("student.quant=nf4") == {"student", "teacher"}
    assert roles("teacher.quant=int8") == {"student"} and roles("student.quant=int8") == {"teacher"}
    i8 = plan.estimate(cfg(*SEED, "teacher.quant=int8"))
    items = [i["component"] for i in i8["placements"]["resident"]["phases"]["rollout"]["items"]]
    assert any(c.startswith("captured update forward") for c in items)
    assert not any(c.startswith("captured scoring forward") for c in items)


def test_swap_chosen_notes_that_checkpointing_keeps_both_roles_resident():
    """auto picks swap when resident does not fit; when resident with activation checkpointing (or
    merging in place, or both) would fit (a small cost on CUDA next to moving a role every phase), the
    plan says so with the peak it would have; not when none of them fits. (Evaluate holds both roles
    under every placement, so a swap run that fits has an evaluation that fits resident too.)"""
    wide = [*SEED, "runtime.cuda_graphs=false", "rollout.batch_size=16"]  # the update is the loop's peak
    est = plan.estimate(cfg(*wide, "memory.vram_gib=9.5"))
    ck = plan.estimate(cfg(*wide, "memory.vram_gib=9.5", "train.activation_checkpointing=true",
                           "memory.placement=resident"))
    assert est["placement"]["chosen"] == "swap" and est["feasible"] and ck["feasible"]
    note = [n for n in est["notes"] if n.startswith("resident fits with train.activation_checkpointing=true")]
    assert note == [f"resident fits with train.activation_checkpointing=true (peak {ck['peak_gib']:.2f} GiB): "
                    "the checkpointed update recomputes each layer, where swap moves a role on and off the "
                    "device every phase"]
    # the seed workload at 5.5 GiB: swap (its loop fits), evaluate does not fit under any placement: no note
    tight = plan.estimate(cfg(*SEED, "memory.vram_gib=5.5"))
    assert tight["placement"]["chosen"] == "swap" and not tight["feasible"]
    assert not any(n.startswith("resident fits") for n in tight["notes"])


def test_the_teacher_sampler_is_counted_in_the_rollout_and_the_student_engine_is_not():
    """rollout.sampler=teacher: rollout.teacher_sampler builds an engine on the teacher for each rollout
    (every projection dequantized for an NF4 teacher; none with teacher.dense_copy=false: transformers'
    buffers instead); the student samples only in evaluation, so its engine is in no phase of the loop."""
    off = ["rollout.sampler=teacher", "objective.name=nll", "teacher.quant=nf4"]
    est = plan.estimate(cfg(*SEED, *off))
    T = shapes.shape_of(cfg(*SEED).teacher, "teacher")
    assert item(est, "rollout", "rollout engine weights for this rollout", role="teacher") == \
        shapes.plain_engine_bytes(T, 2, dense=True)
    ph = est["placements"]["resident"]["phases"]
    for p in ("rollout", "score", "update"):
        assert not [i for i in ph[p]["items"] if i["role"] == "student" and "engine" in i["component"]], p
    assert item(est, "evaluate", "rollout engine weights")  # evaluation's greedy answers build it
    small = plan.estimate(cfg(*SEED, *off, "teacher.dense_copy=false"))
    items = small["placements"]["resident"]["phases"]["rollout"]["items"]
    assert not [i for i in items if "engine" in i["component"]]
    assert item(small, "rollout", "prefill logits", role="teacher") == 4 * 128 * 49152 * 2
    total = lambda e: e["placements"]["resident"]["phases"]["rollout"]["total_gib"] * GIB  # noqa: E731
    # the dense copy less; transformers' buffers about the graphs they replace
    assert abs(total(small) - (total(est) - shapes.plain_engine_bytes(T, 2, dense=True))) < 0.1 * GIB
