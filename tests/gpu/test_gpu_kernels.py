"""stages/engine/kernels.py on the GPU, bf16: `project` within the bounds derived in
tests/kernel_cases.py at the decode step's real widths (SmolLM2-360M, Qwen3-0.6B), bit-identical
from call to call, decoder.fused_layer against decoder.layer, and the compiled decode step of the
rollout engine really launching the kernels (the engine tests in test_gpu_engine.py check what it
samples: greedy == generate, log-probs == a teacher-forced recompute)."""
from __future__ import annotations

import pytest
import torch

from stages.engine import decoder, kernels, sampler
import kernel_cases
import layer_cases
from engine_models import PROMPTS, tiny, with_trained_lora

pytestmark = pytest.mark.gpu


def test_project_bf16_within_its_derived_bounds_and_deterministic():
    for seed in range(3):
        run = kernel_cases.check(kernels.project, "cuda", torch.bfloat16, kernel_cases.GPU_SHAPES, seed)
        print(seed, {k: (f"{e:.3g}", f"{d:.4f}") for k, (e, d) in run["cases"].items()})  # (over the bound, share differing)
        assert run["bad"] == [], {k: run["cases"][k] for k in run["bad"]}
        assert run["share"] < 0.05, run["share"]  # most outputs identical (tests/kernel_cases.py)
    for _, args in kernel_cases.cases("cuda", torch.bfloat16, kernel_cases.GPU_SHAPES):
        assert torch.equal(kernels.project(*args), kernels.project(*args))  # one program per output, fixed order


def test_fused_layer_matches_layer_bf16():
    for seed, (q, b) in enumerate([(False, False), (True, False), (False, True)]):
        for fm in (False, True):  # (the float mask: rope_attention instead of rope_cache + SDPA)
            row = layer_cases.compare("cuda", torch.bfloat16, H=15, KV=5, D=64, I=2560, L=40, qwen3=q, bias=b, seed=seed,
                                      float_mask=fm)
            assert row["stream"] <= 8 * row["eps"] and row["cache"] <= 8 * row["eps"], row


def test_rope_attention_bf16_writes_the_cache_and_is_within_one_ulp_of_sdpa():
    # the seed's cache in one block, Qwen3's heads over several (its cache of 640 in five of 128), and
    # 16-position blocks where row 1's first is masked whole
    # and each with a program per kv head (the kernel past decode_attention.ATTN_KV_ROWS rows)
    for seed, (H, KV, D, L, q, blk) in enumerate([(15, 5, 64, 192, False, None), (16, 8, 128, 640, True, None),
                                                  (6, 2, 64, 40, False, 16), (16, 8, 128, 128, True, 16)]):
        for per_kv in (False, True):
            row = layer_cases.attention("cuda", torch.bfloat16, B=4, H=H, KV=KV, D=D, L=L, qwen3=q, seed=seed, block=blk,
                                        per_kv=per_kv)
            assert layer_cases.attention_ok(row), row


def test_chunked_cumsum_close_to_the_plain_scan():
    p = torch.softmax(torch.randn(4, 49152, device="cuda") * 3, -1)
    a, b = decoder._cumsum(p), p.cumsum(-1)
    assert (a - b).abs().max() < 1e-5 and bool((a[:, 1:] >= a[:, :-1] - 1e-7).all())
    q = torch.softmax(torch.randn(3, 151936, device="cuda"), -1)  # not a multiple of the chunk
    assert (decoder._cumsum(q) - q.cumsum(-1)).abs().max() < 1e-5


def test_compiled_decode_step_launches_the_kernels():
    m = with_trained_lora(tiny(initializer_range=0.05), scale=0.02).to("cuda", torch.bfloat16)
    eng = sampler.Engine(m, use_graphs=True, compile=True)
    eng.generate(PROMPTS, 8, eos=2, pad=2, seed=3)  # capture
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        a = eng.generate(PROMPTS, 8, eos=2, pad=2, seed=3)
        torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    assert eng.compile and any("_project" in n for n in names), sorted(names)[:40]
    assert any("_rope_attention" in n for n in names), sorted(names)[:40]  # (the float mask and a cache that fits)
    b = eng.generate(PROMPTS, 8, eos=2, pad=2, seed=3)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    assert any("_chunk_stats" in n for n in names) and any("_pick" in n for n in names)  # the draw (draw.py)
    many = PROMPTS * 6  # 18 rows, past kernels.MAX_ROWS: the compiled cuBLAS layer with rope_attention per kv head
    eng.generate(many, 8, eos=2, pad=2, seed=3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        eng.generate(many, 8, eos=2, pad=2, seed=3)
        torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    assert any("_rope_attention_kv" in n for n in names), sorted(names)[:40]


def test_fast_step_over_in_place_weights_samples_what_the_copy_does():
    """memory.merge_in_place with the decode kernels: the weights are views into the flat buffer
    (decoder.fuse_projections), the same values as the copy's merged tensors, and each kernel sums
    in a fixed order, so both engines sample the same tokens and log-probs, bit for bit; also at
    kernels.MAX_ROWS rows and one past it (where the compiled cuBLAS layer takes over)."""
    from stages.engine import decoder

    def model(fused):
        torch.manual_seed(0)
        m = tiny(initializer_range=0.05).to("cuda", torch.bfloat16)
        if fused:
            decoder.fuse_projections(m)
        return with_trained_lora(m, scale=0.02)

    copy, inplace = model(False), model(True)
    for rows in (3, kernels.MAX_ROWS, kernels.MAX_ROWS + 1):
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(rows)]
        a = sampler.Engine(copy, use_graphs=True, compile=True).generate(prompts, 8, eos=2, pad=2, seed=7)
        e = sampler.Engine(inplace, use_graphs=True, compile=True)
        b = e.generate(prompts, 8, eos=2, pad=2, seed=7)
        assert e.compile and torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs), rows


def test_programmatic_dependent_launch_samples_what_plain_launches_do():
    """kernels.PDL: each kernel loads its weights while the one before still runs and waits for it
    before reading activations. A wait in the wrong place would read a half-written row and show
    as tokens or log-probs that differ from plain launches, or from one replay to the next."""
    if not kernels.pdl(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs compute capability 9.0 (Hopper) or later")
    m = with_trained_lora(tiny(initializer_range=0.05), scale=0.02).to("cuda", torch.bfloat16)
    runs = {}
    for on in (False, True):
        kernels.PDL = on  # (read when the decode step is captured)
        try:
            eng = sampler.Engine(m, use_graphs=True, compile=True)
            runs[on] = [eng.generate(PROMPTS, 16, eos=2, pad=2, seed=5) for _ in range(3)]
            assert eng.compile, on  # (a failed capture falls back to the eager step with a warning)
        finally:
            kernels.PDL = True
    for r in runs[True] + runs[False][1:]:
        assert torch.equal(r.tokens, runs[False][0].tokens) and torch.equal(r.logprobs, runs[False][0].logprobs)
