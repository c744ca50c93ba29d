"""The padded layout of CUDA's teacher-forced forwards (stages/engine/graphs.py), checked on CPU:
the mask it builds, and that padding to the bucket with an explicit mask computes the unpadded
forward's values at every real position (each side within its own derived fp32 bound). The graph
capture and replay themselves need CUDA: tests/gpu/test_gpu_graphs.py."""
from __future__ import annotations

import pytest
import torch

import numerics
from stages.engine import graphs, lmhead
from stages.weights import models
from support import seeds
from engine_models import PAD, tempered_logprob, tiny, with_trained_lora


def test_padded_mask_is_causal_over_real_keys_and_the_length_a_bucket_multiple():
    ids = torch.tensor([[5, 6, 7, 0], [5, 6, 0, 0]])
    attn = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    pid, mask = graphs.padded(ids, attn, pad=9)
    Tb = graphs.BUCKET
    assert pid.shape == (2, Tb) and mask.shape == (2, 1, Tb, Tb) and mask.dtype == torch.bool
    assert pid[0, :4].tolist() == [5, 6, 7, 0] and (pid[:, 4:] == 9).all()
    want = torch.zeros(2, Tb, Tb, dtype=torch.bool)
    for b, n in enumerate((3, 2)):
        for i in range(Tb):
            for j in range(min(i + 1, n)):
                want[b, i, j] = True  # key j visible from query i: j <= i and j a real token
    assert torch.equal(mask[:, 0], want)
    assert graphs.padded(torch.zeros(1, Tb + 1, dtype=torch.long), torch.ones(1, Tb + 1, dtype=torch.long))[0] \
        .shape == (1, 2 * Tb)  # one past a bucket: the next multiple


@pytest.mark.parametrize("seed", seeds(1))
def test_padded_forward_equals_the_unpadded_one_at_real_positions(seed, monkeypatch):
    model = with_trained_lora(tiny(seed=seed))
    base = models.base_of(model)
    g = torch.Generator().manual_seed(seed)
    prompts = [[1, *torch.randint(3, 4000, (n,), generator=g).tolist()] for n in (9, 4, 13)]
    resp = [torch.randint(3, 4000, (n,), generator=g).tolist() for n in (6, 11, 3)]
    p = lmhead.pack(prompts, resp, [[1] * len(r) for r in resp], PAD, "cpu")
    import transformers.masking_utils as mu

    # tracing needs transformers' mask builder not to branch on the data (the unpadded side's mask)
    monkeypatch.setattr(mu, "_ignore_causal_mask_sdpa", lambda *a, **k: False)
    head = tempered_logprob(lmhead.head_weight(model), p.targets, 1.0)
    padded = lambda: graphs.hidden(base, base.model, p.ids, p.attn, use_graphs=False)[p.rows, p.cols]  # noqa: E731
    plain = lambda: base.model(input_ids=p.ids, attention_mask=p.attn).last_hidden_state[p.rows, p.cols]  # noqa: E731
    with torch.no_grad():
        got_pad, got_plain = head(padded()), head(plain())
    ref_pad, b_pad = numerics.fp32_bound_through(padded, head)
    ref_plain, b_plain = numerics.fp32_bound_through(plain, head)
    numerics.check(got_pad, ref_pad, b_pad, "padded layout")
    numerics.check(got_plain, ref_plain, b_plain, "unpadded forward")
    # one exact value: the pads are never attended by a real position (float64 rounding apart)
    numerics.check(ref_pad, ref_plain, (b_pad + b_plain) * numerics.U64 / numerics.U32, "padded vs unpadded, exact")


def test_padded_length_is_the_runs_unless_the_input_is_longer():
    ids, attn = torch.ones(2, 70, dtype=torch.long), torch.ones(2, 70, dtype=torch.long)
    assert graphs.padded(ids, attn, length=192)[0].shape == (2, 192)  # the run's length: one shape all run
    assert graphs.padded(ids, attn, length=64)[0].shape == (2, 128)  # longer: its own bucket multiple
    assert graphs.bucket(192) == 192 and graphs.bucket(193) == 256


def test_the_layout_is_for_llama_family_models_on_sdpa_only():
    assert graphs.layout_ok(tiny())  # Llama on SDPA: the explicit boolean mask is what SDPA takes
    eager = tiny()
    eager.config._attn_implementation = "eager"  # eager attention would add a boolean mask as 0/1
    assert not graphs.layout_ok(eager)
    assert not graphs.layout_ok(tiny(model_type="mistral"))  # (its sliding window would be lost)


def test_params_at_sees_a_moved_or_replaced_parameter_and_drop_forgets_the_module_list():
    """params_at (asked before every replay) keeps the module list, not the addresses: a parameter
    whose storage moved, or a Parameter put in another's place, still changes what it returns; a
    module added later shows only after graphs.drop (memory.move calls it before any move)."""
    m = with_trained_lora(tiny())
    inner = m.get_base_model().model
    at = graphs.params_at(inner)
    assert at == tuple(p.data_ptr() for p in inner.parameters())
    assert graphs.params_at(inner) == at  # nothing moved: the same addresses
    w = inner.layers[0].self_attn.q_proj.base_layer.weight
    w.data = w.data.clone()  # storage moved (as Module.to does)
    moved = graphs.params_at(inner)
    assert moved != at and w.data_ptr() in moved
    norm = inner.layers[1].input_layernorm
    norm.weight = torch.nn.Parameter(norm.weight.detach().clone())  # a new Parameter object
    assert norm.weight.data_ptr() in graphs.params_at(inner)
    inner.layers[0].extra = torch.nn.Linear(2, 2)  # a module added after the list was kept
    assert inner.layers[0].extra.weight.data_ptr() not in graphs.params_at(inner)
    graphs.drop(models.base_of(m))
    assert graphs.params_at(inner) == tuple(p.data_ptr() for p in inner.parameters())
