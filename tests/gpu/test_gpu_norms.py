"""stages/weights/norms.py on CUDA: a model loaded there computes its RMSNorms with torch's fused
kernel (one launch for the normalised row, one for the weight's multiply, where transformers' formula
launches about seven), and its teacher-forced forward and LoRA gradients stay within one rounding of
the normalised rows of transformers' own."""
from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from stages.engine import lmhead
from stages.run.config import ModelCfg
from stages.weights import models, norms
from engine_models import PAD, tiny, with_trained_lora

pytestmark = pytest.mark.gpu


def _kernels(fn) -> int:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in p.key_averages() if e.device_type.name == "CUDA")


def test_a_cuda_load_fuses_the_norms_within_one_rounding(tmp_path):
    tiny("tiny-qwen3", initializer_range=0.05).save_pretrained(tmp_path)
    fused = models.load(tmp_path, ModelCfg(), torch.device("cuda"), torch.bfloat16)
    plain = models.load(tmp_path, ModelCfg(), torch.device("cuda"), torch.bfloat16)
    n = 0
    for m in plain.modules():
        if type(m).__name__ in norms.FORMULA:
            del m.forward  # back to transformers' own
            n += 1
    assert n == 4 * fused.config.num_hidden_layers + 1
    norm = fused.model.layers[0].input_layernorm
    x = torch.randn(4, 64, fused.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    assert _kernels(lambda: norm(x)) <= 2 < _kernels(lambda: plain.model.layers[0].input_layernorm(x))
    g = torch.Generator().manual_seed(0)
    p = lmhead.pack([[1, *torch.randint(3, 4000, (k,), generator=g).tolist()] for k in (9, 4, 13)],
                    [torch.randint(3, 4000, (k,), generator=g).tolist() for k in (6, 11, 3)],
                    [[1] * k for k in (6, 11, 3)], PAD, "cuda")
    out = {}
    for name, base in (("fused", fused), ("plain", plain)):
        m = with_trained_lora(base, scale=0.02)
        models.set_training(m, True)
        h = lmhead.hidden(m, p)  # [n, H]
        (h.float() ** 2).mean().backward()
        out[name] = h.detach(), {k: q.grad for k, q in models.trainable(m)}
    (hf, gf), (hp, gp) = out["fused"], out["plain"]
    # bf16: a norm's row may round one step apart, and each later layer carries that on: a few bf16
    # steps of the hidden state's scale, not more
    scale = hp.float().abs().amax()
    assert (hf.float() - hp.float()).abs().max() <= 8 * 2 ** -7 * scale
    for k in gp:
        s = gp[k].float().abs().max().clamp_min(1e-6)
        assert torch.allclose(gf[k].float() / s, gp[k].float() / s, atol=5e-2), k
