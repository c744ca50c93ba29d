"""stages/engine/kernels.py on CPU, through Triton's interpreter (TRITON_INTERPRET=1, read when the
kernel is defined, hence a fresh process): `project` against its fp64 reference within the bounds
derived in tests/kernel_cases.py, and decoder.fused_layer against decoder.layer. fp16: the
interpreter rounds to bf16 by truncation, unlike the GPU (bf16 runs in tests/gpu/test_gpu_kernels.py)."""
from __future__ import annotations


import pytest
import torch

from stages.engine import decoder, kernels
import interpreter  # (tests/)
import layer_cases  # (tests/: the rows the interpreter subprocess computes are judged here)

SCRIPT = """
import json, sys
sys.path.insert(0, "tests")
import torch
from stages.engine import decode_attention, kernels
import kernel_cases, layer_cases
kernels.usable = lambda rows, dtype, device, act: True  # (CPU tensors: the interpreter runs the kernel)
decode_attention.usable = lambda T, mask, dtype, device, D: decode_attention.ATTENTION and T == 1 and mask.is_floating_point()
out = {"project": [kernel_cases.check(kernels.project, "cpu", torch.float16, kernel_cases.CPU_SHAPES, s) for s in range(3)],
       "layer": [layer_cases.compare("cpu", torch.float16, qwen3=q, bias=b, seed=s, float_mask=f)
                 for s, (q, b, f) in enumerate([(False, False, False), (True, False, True), (False, True, True)])],
       # one block holding the whole cache (the seed's), then 16-position blocks: three, row 1's first
       # masked whole; each with a program per query head, then per kv head (its heads in one tile)
       "attention": [layer_cases.attention("cpu", torch.float16, qwen3=q, seed=s, block=blk, per_kv=kv)
                     for s, (q, blk, kv) in enumerate([(False, None, False), (True, None, False), (False, 16, False),
                                                        (True, 16, False), (False, 32, False), (False, None, True),
                                                        (True, 16, True), (False, 16, True)])]}
# the new token at a block's first and last position (16-position blocks)
out["attention"] += [layer_cases.attention("cpu", torch.float16, seed=9 + s, block=16, per_kv=kv, slot=slot)
                     for s, (slot, kv) in enumerate([(32, False), (31, False), (32, True), (31, True)])]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def interpreted():
    return interpreter.run(SCRIPT)


def test_project_within_its_derived_bounds(interpreted):
    for run in interpreted["project"]:
        assert run["bad"] == [], run
        # every flag combination the decoder uses, at several programs per matrix
        assert {lbl.split(" ", 1)[1] for lbl in run["cases"]} == {
            "plain", "norm+bias", "resid", "norm+glu", "glu+bias+resid"}
    # not vacuous: most outputs identical, a few a rounding step apart
    assert all(run["share"] < 0.05 for run in interpreted["project"])


def test_fused_layer_matches_layer(interpreted):
    # each projection agrees to a few ulps (above); wired wrongly (a weight, a residual, the gate
    # order) the layer's output would differ by O(1) of its magnitude, not by a few ulps of it
    for row in interpreted["layer"]:
        assert row["stream"] <= 8 * row["eps"], row
        assert row["cache"] <= 8 * row["eps"], row


def test_rope_attention_writes_the_cache_and_is_within_one_ulp_of_sdpa(interpreted):
    for row in interpreted["attention"]:
        assert layer_cases.attention_ok(row), row
    assert {(row["block"], row["per_kv"]) for row in interpreted["attention"]} >= {(None, False), (16, False), (None, True), (16, True)}


def test_cpu_decoding_never_takes_the_kernels():
    silu = torch.nn.functional.silu
    assert not kernels.usable(2, torch.bfloat16, "cpu", silu)  # CPU: the decoder's own layer
    assert not kernels.usable(2, torch.float32, "cuda", silu) and not kernels.usable(17, torch.bfloat16, "cuda", silu)
    if kernels.triton is not None:  # (the 16-row boundary: MAX_ROWS rows take the kernels on CUDA)
        assert kernels.usable(kernels.MAX_ROWS, torch.bfloat16, "cuda", silu)
    assert not kernels.usable(2, torch.bfloat16, "cuda", torch.nn.functional.gelu)


def test_chunked_cumsum_is_the_scan_to_fp32_rounding():
    # the chunk arithmetic itself (on CUDA the draw takes it; on CPU _cumsum is the plain scan)
    g = torch.Generator().manual_seed(0)
    for V in (1024, 1025, 3000, 49152):
        p = torch.softmax(torch.randn(3, V, generator=g) * 3, -1)
        ref = p.double().cumsum(-1)
        got = decoder.chunked_cumsum(p, 1024)
        assert got.shape == p.shape and got.is_contiguous()
        assert float((got.double() - ref).abs().max()) < V * 2.0 ** -24  # fp32 sums of terms <= 1
    p = torch.rand(3, 5000)
    assert torch.equal(decoder._cumsum(p), p.cumsum(-1))  # CPU: the plain scan


def test_project_refuses_layouts_it_cannot_read():
    x = torch.zeros(2, 8, dtype=torch.float16)
    w = torch.zeros(8, 6, dtype=torch.float16).t()  # [6, 8], not contiguous
    with pytest.raises(RuntimeError, match="w must be"):
        kernels.project(x, w, None, None, None, 1e-5, False)
    with pytest.raises(RuntimeError, match="resid must be"):
        kernels.project(x, w.contiguous(), None, None, torch.zeros(2, 5, dtype=torch.float16), 1e-5, False)


def test_cache_key_soon_leaves_triton_its_key_computed_on_a_thread_of_its_own():
    """The first kernel launch of a process finds Triton's cache key (a hash of libtriton.so)
    computed already, on the opd-triton-key thread, and the same key as computed in line."""
    from triton.runtime.cache import triton_key

    triton_key.cache_clear()
    t = kernels.cache_key_soon()
    assert t.name == "opd-triton-key"
    t.join(timeout=120)
    assert not t.is_alive() and triton_key.cache_info().currsize == 1
    key = triton_key()
    assert triton_key.cache_info().hits == 1  # the launch's call: a cache hit, nothing hashed again
    triton_key.cache_clear()
    assert triton_key() == key
