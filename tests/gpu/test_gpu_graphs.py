"""CUDA graphs of the teacher-forced forwards and of the engine's LoRA re-merge (stages/engine/graphs.py,
sampler.Engine.refresh): a replay computes what the eager padded forward computes, reads this call's
inputs and parameters (not the captured ones), repeats to the bit, and trains the same LoRA grads."""
from __future__ import annotations

import pytest
import torch

from stages.engine import lmhead, sampler
from stages.weights import models
from stages.weights.state import state
from engine_models import PAD, tiny, with_trained_lora

pytestmark = pytest.mark.gpu


def _batch(seed: int, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    prompts = [[1, *torch.randint(3, 4000, (n,), generator=g).tolist()] for n in (9, 4, 13)]
    resp = [torch.randint(3, 4000, (n,), generator=g).tolist() for n in (6, 11, 3)]
    return lmhead.pack(prompts, resp, [[1] * len(r) for r in resp], PAD, device)


def _model(dtype):
    return with_trained_lora(tiny(initializer_range=0.05), scale=0.02).to("cuda", dtype)


def _hidden_and_grads(model, p, graphed: bool, train: bool):
    state(model).use_graphs = graphed
    models.set_training(model, train)
    named = models.trainable(model)
    for _, q in named:
        q.grad = None
    with torch.set_grad_enabled(train):
        h = lmhead.hidden(model, p)  # [n, H]
        if train:
            (h.float() ** 2).mean().backward()
    return h.detach().clone(), {n: q.grad.clone() for n, q in named if q.grad is not None}


@pytest.mark.parametrize("dtype,ckpt", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True),
                                        (torch.bfloat16, True)])
def test_graphed_forward_and_backward_match_eager_and_repeat_exactly(dtype, ckpt):
    torch.backends.cuda.matmul.allow_tf32 = False
    m = _model(dtype)
    if ckpt:  # the captured backward recomputes each layer (train.activation_checkpointing)
        models.enable_activation_checkpointing(models.base_of(m), preserve_rng_state=False)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    # checkpointing took effect: an eager training step runs each layer's forward again in the backward
    # (counted on the MLP's forward: the recompute bypasses module hooks)
    mlp, calls = models.base_of(m).model.layers[0].mlp, []
    fwd = mlp.forward
    mlp.forward = lambda *a, **k: calls.append(1) or fwd(*a, **k)
    _hidden_and_grads(m, _batch(0), False, True)
    del mlp.forward  # back to the class's
    assert len(calls) == (2 if ckpt else 1), calls
    for train in (False, True):
        for seed in (0, 1):  # the second batch (same bucket) replays: it must read the new ids
            p = _batch(seed)
            he, ge = _hidden_and_grads(m, p, False, train)
            hg, gg = _hidden_and_grads(m, p, True, train)
            hg2, gg2 = _hidden_and_grads(m, p, True, train)
            assert torch.equal(hg, hg2) and all(torch.equal(gg[k], gg2[k]) for k in gg)  # replay repeats
            # capture may pick other cuBLAS algorithms than eager: the same values to rounding
            assert torch.allclose(hg.float(), he.float(), **tol), (train, seed, (hg.float() - he.float()).abs().max())
            if train:
                assert gg.keys() == ge.keys() and len(gg) == len(models.trainable(m))
                for k in gg:
                    scale = ge[k].float().abs().max().clamp_min(1e-6)
                    assert torch.allclose(gg[k].float() / scale, ge[k].float() / scale, **tol), k
    held = state(m).graphs
    assert {k[0] for k in held if k != "params"} == {"train", "infer"}  # one graph per mode and shape
    # the parameters change (an optimizer step): the replay reads them, not a captured copy
    with torch.no_grad():
        for _, q in models.trainable(m):
            q.add_(0.01 * torch.randn_like(q))
    p = _batch(0)
    he, _ = _hidden_and_grads(m, p, False, False)
    hg, _ = _hidden_and_grads(m, p, True, False)
    assert torch.allclose(hg.float(), he.float(), **tol)
    # the model moves (placement swap): its graphs are dropped and captured again at the new addresses
    m.to("cpu").to("cuda")
    hg3, _ = _hidden_and_grads(m, p, True, False)
    assert torch.equal(hg3, hg)


@pytest.mark.parametrize("ckpt,double_quant,inter", [(False, False, 128), (True, False, 128), (False, True, 192)])
def test_nf4_graphs_match_eager_and_repeat_exactly(tmp_path, ckpt, double_quant, inter):
    """An NF4 base (bitsandbytes' kernels per projection, forward and backward) replays what its eager
    forward computes: codepaths.graphed_roles captures NF4 roles. inter=192: gate/up of 64 -> 192 take
    bitsandbytes' fused 4-bit GEMM in the no-grad forward at these 192 rows on Hopper (its heuristic
    for short K), the dequantize + matmul fallback elsewhere; double_quant: the nested scales."""
    pytest.importorskip("bitsandbytes")
    from stages.run.config import ModelCfg

    tiny(initializer_range=0.05, intermediate_size=inter).save_pretrained(tmp_path)
    base = models.load(tmp_path, ModelCfg(quant="nf4", double_quant=double_quant), torch.device("cuda"),
                       torch.bfloat16)
    assert type(models.base_of(base).model.layers[0].mlp.up_proj).__name__ == "Linear4bit"
    m = with_trained_lora(base, scale=0.02)
    if ckpt:
        models.enable_activation_checkpointing(models.base_of(m), preserve_rng_state=False)
    tol = dict(atol=2e-2, rtol=2e-2)  # bf16 compute: capture may pick other cuBLAS algorithms than eager
    for train in (False, True):
        for seed in (0, 1):  # the second batch replays the first's graph with new ids
            p = _batch(seed)
            he, ge = _hidden_and_grads(m, p, False, train)
            hg, gg = _hidden_and_grads(m, p, True, train)
            hg2, gg2 = _hidden_and_grads(m, p, True, train)
            assert torch.equal(hg, hg2) and all(torch.equal(gg[k], gg2[k]) for k in gg)
            assert torch.allclose(hg.float(), he.float(), **tol), (train, seed, (hg.float() - he.float()).abs().max())
            if train:  # every adapter, the first layer's through the 4-bit layers above it
                assert gg.keys() == ge.keys() and len(gg) == len(models.trainable(m))
                for k in gg:
                    scale = ge[k].float().abs().max().clamp_min(1e-6)
                    assert torch.allclose(gg[k].float() / scale, ge[k].float() / scale, **tol), k
                    assert gg[k].abs().max() > 0, k
    assert {k[0] for k in state(m).graphs if k != "params"} == {"train", "infer"}


def test_engine_refresh_replays_the_merge_a_fresh_engine_makes():
    m = _model(torch.bfloat16)
    eng = sampler.Engine(m, use_graphs=True)
    assert eng._refresh is not None  # the construction's weights came from the captured merge
    for step in range(3):  # three policy versions: each refresh replays, a fresh engine captures anew
        with torch.no_grad():
            for _, q in models.trainable(m):
                q.add_(0.01 * torch.randn_like(q))
        eng.refresh(m)
        fresh = sampler.Engine(m, use_graphs=True)
        eager = sampler.Engine(m, use_graphs=False)
        for a, b, c in zip(eng.W["layers"], fresh.W["layers"], eager.W["layers"]):
            for k in ("qkv", "o_proj", "gate_up", "down_proj"):
                assert torch.equal(a[k], b[k]), (step, k)  # what a resumed process samples from
                assert torch.allclose(a[k].float(), c[k].float(), atol=1e-2, rtol=1e-2), (step, k)


def test_an_nf4_engine_refresh_replays_the_merge_a_fresh_engine_makes(tmp_path):
    """An NF4 student's engine merges into its dense copy by a captured graph (dequantize + LoRA per
    projection): refreshes replay it, a fresh engine's weights come from it, eager within bf16."""
    pytest.importorskip("bitsandbytes")
    from stages.run.config import ModelCfg

    tiny(initializer_range=0.05).save_pretrained(tmp_path)
    m = with_trained_lora(models.load(tmp_path, ModelCfg(quant="nf4"), torch.device("cuda"), torch.bfloat16),
                          scale=0.02)
    eng = sampler.Engine(m, use_graphs=True)
    assert eng.nf4 and eng._refresh is not None
    for step in range(3):
        with torch.no_grad():
            for _, q in models.trainable(m):
                q.add_(0.01 * torch.randn_like(q))
        eng.refresh(m)
        fresh, eager = sampler.Engine(m, use_graphs=True), sampler.Engine(m, use_graphs=False)
        for a, b, c in zip(eng.W["layers"], fresh.W["layers"], eager.W["layers"]):
            for k in ("qkv", "o_proj", "gate_up", "down_proj"):
                assert torch.equal(a[k], b[k]), (step, k)
                assert torch.allclose(a[k].float(), c[k].float(), atol=1e-2, rtol=1e-2), (step, k)


def test_in_place_engine_restores_the_base_before_the_next_forward_reads_it():
    """memory.merge_in_place: a forward right after generate (no score between) reads the pristine
    base, because it waits on the device for the side stream's copy back (decoder.base_ready). At
    SmolLM2-360M widths the copy (0.59 GiB) outlasts the host's launch of that forward, so a missing
    wait would read merged weights."""
    from stages.engine import decoder

    torch.manual_seed(0)
    m = tiny("smollm2-360m", initializer_range=0.02).to("cuda", torch.bfloat16)
    decoder.fuse_projections(m)
    m = with_trained_lora(m, scale=0.02)
    state(m).use_graphs = False
    p = _batch(0)
    with torch.no_grad():
        ref = lmhead.hidden(m, p)
    eng = sampler.Engine(m, use_graphs=True)  # in place: the model is fused
    for seed in range(3):
        eng.generate([[1, 5, 6, 7]] * 4, 8, eos=-1, pad=PAD, seed=seed)
        with torch.no_grad():
            h = lmhead.hidden(m, p)
        assert torch.equal(h, ref), seed
    base = models.base_of(m)
    torch.cuda.synchronize()
    assert torch.equal(state(base).flat.cpu(), state(base).pristine)


def test_a_merge_enqueued_ahead_samples_what_a_merge_at_generate_does():
    """sampler.Engine.premerge (memory.merge_in_place, right after an update): the captured merge
    replayed ahead of the next generate, which then samples the same tokens and log-probs as one that
    merges itself; a forward or a new adapter that reaches the weights first gets the pristine base
    (decoder.base_ready, Engine.refresh), and the base is pristine after every rollout."""
    from stages.engine import decoder

    torch.manual_seed(0)
    m = tiny("smollm2-360m", initializer_range=0.02).to("cuda", torch.bfloat16)
    decoder.fuse_projections(m)
    m = with_trained_lora(m, scale=0.02)
    base = models.base_of(m)
    state(base).use_graphs = False
    prompts, kw, p = [[1, 5, 6, 7]] * 4, dict(eos=-1, pad=PAD, seed=1), _batch(0)
    with torch.no_grad():
        ref_h = lmhead.hidden(m, p)
    eng = sampler.Engine(m, use_graphs=True)
    assert not eng.premerge()  # nothing captured yet: the first generate captures the merge
    ref = eng.generate(prompts, 8, **kw)
    assert eng.premerge() and not eng.premerge()  # (once: already merged)
    got = eng.generate(prompts, 8, **kw)
    assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.logprobs, ref.logprobs)
    assert eng.premerge()
    with torch.no_grad():
        assert torch.equal(lmhead.hidden(m, p), ref_h)  # undone before the forward read the weights
    assert eng.premerge()
    with torch.no_grad():  # a new policy version in the same buffers, as an optimizer step leaves it
        for n, q in m.named_parameters():
            if "lora_B" in n:
                q.add_(0.01)
    eng.refresh()
    new = eng.generate(prompts, 8, **kw)  # merges the new version (the stale merge was undone)
    again = eng.generate(prompts, 8, **kw)
    assert torch.equal(new.logprobs, again.logprobs) and not torch.equal(new.logprobs, ref.logprobs)
    torch.cuda.synchronize()
    assert torch.equal(state(base).flat.cpu(), state(base).pristine)
