"""stages/weights/imports.py: third-party imports with one import-time cost deferred, each in a fresh
subprocess (a process imports a module once): the cost is gone at import, the deferred piece still
runs where it is used, and what it computes is the same as with the plain import."""
from __future__ import annotations

import subprocess
import sys

from side import env_with

from stages.weights import models

DEFERRED = r"""
import hashlib, sys
import torch
from stages.weights import imports
made = []
real = torch.compile
torch.compile = lambda fn=None, **kw: (made.append(kw), real(fn, **kw))[1]  # counts the compiles made
recorder = torch.compile
if sys.argv[1] == "deferred":
    imports.bitsandbytes()
import peft  # noqa: F401  (imports bitsandbytes itself when it is not imported yet)
import bitsandbytes.functional as F
from bitsandbytes.backends.default import ops
assert torch.compile is recorder  # restored
imported = "torch._inductor.compile_fx" in sys.modules
n_import = len(made)
w = torch.randn(256, 128, generator=torch.Generator().manual_seed(0), dtype=torch.bfloat16)
q, st = F.quantize_4bit(w, quant_type="nf4")
d = F.dequantize_4bit(q, st)
# the default backend's compiled kernel, called directly: a deferred one compiles at this first call
code = F.get_4bit_type("nf4", device="cpu")
direct = ops._dequantize_4bit_compute(q.view(torch.uint8).reshape(-1), st.absmax, code, st.blocksize, st.shape,
                                      torch.float32)
print(imported, n_import, len(made), hashlib.sha256(d.float().numpy().tobytes()).hexdigest(),
      bool(torch.equal(direct.to(torch.bfloat16), d)))
"""


def run(script: str, how: str, env=None) -> list[str]:
    r = subprocess.run([sys.executable, "-c", script, how], capture_output=True, text=True, timeout=300,
                       cwd=models.ROOT, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.split()


def test_bitsandbytes_imports_without_inductor_and_computes_the_same_bytes():
    """peft imports bitsandbytes, whose import wraps its default kernels in torch.compile, which
    imports Inductor (~0.7 s) in every training process; imports.bitsandbytes defers each
    compile to its first call: no Inductor at import, the same dequantised bytes, and the kernel
    still compiled (once) when it is first called."""
    out = {how: run(DEFERRED, how) for how in ("plain", "deferred")}
    imported, at_import, total, digest, same = out["deferred"]
    assert imported == "False" and at_import == "0" and int(total) >= 1 and same == "True", out
    assert out["plain"][0] == "True" and int(out["plain"][1]) >= 1  # what it saves: Inductor, compiles at import
    assert digest == out["plain"][3]  # the same dequantised NF4 weights either way


GENERATION = r"""
import copy, sys
import torch
import transformers
from stages.weights import imports
assert transformers.__version__ == "5.17.0", transformers.__version__
if sys.argv[1] == "deferred":
    imports.transformers_generation()
from transformers import AutoModelForCausalLM, LlamaConfig
at_load = "sklearn" in sys.modules or "scipy" in sys.modules
torch.manual_seed(0)
target = AutoModelForCausalLM.from_config(LlamaConfig(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=16, max_position_embeddings=128)).eval()
assistant = copy.deepcopy(target)  # the target with its head perturbed: drafts it accepts, and some it rejects
with torch.no_grad():
    assistant.lm_head.weight.add_(torch.randn(16, 32, generator=torch.Generator().manual_seed(1)))
assistant.generation_config.assistant_confidence_threshold = 0.4
# assisted generation is roc_curve's one user: after each round the assistant's confidence threshold
# is set from the ROC of its draft probabilities against the target's acceptances
import transformers.generation.candidate_generator as cg
thresholds, update = [], cg.AssistedCandidateGenerator.update_candidate_strategy
def recorded(self, *a):
    update(self, *a)
    thresholds.append(float(self.assistant_generation_config.assistant_confidence_threshold))
cg.AssistedCandidateGenerator.update_candidate_strategy = recorded
ids = target.generate(torch.tensor([[1, 2, 3, 4]]), assistant_model=assistant, do_sample=False,
                      max_new_tokens=60, min_new_tokens=60, pad_token_id=0)
print(at_load, "sklearn" in sys.modules, ",".join(f"{t:.6f}" for t in thresholds), ",".join(map(str, ids[0].tolist())))
"""


def test_transformers_generation_defers_scikit_learn_and_assisted_generation_still_adapts():
    """transformers 5.17 (the GPU machine's) imports scikit-learn and scipy with its generation
    code, for assisted generation's adaptive threshold alone: 3.2 s of the H200's first update.
    Deferred, loading a model imports neither; assisted generation still imports scikit-learn,
    adapts the threshold to the same value and generates the same tokens as with the plain import."""
    env = env_with("transformers-5.17")
    plain, deferred = run(GENERATION, "plain", env), run(GENERATION, "deferred", env)
    assert plain[0] == "True" and deferred[0] == "False", (plain, deferred)  # at load: the cost, then none
    assert deferred[1] == "True"  # imported where it is used
    adapted = plain[2].split(",")
    assert len(set(adapted)) > 1 and deferred[2] == plain[2], (plain, deferred)  # the ROC steps ran, the same
    assert deferred[3] == plain[3] and len(plain[3].split(",")) == 64


LOSSES = r"""
import sys
import torch
import transformers
from stages.weights import imports
assert transformers.__version__ == "5.17.0", transformers.__version__
if sys.argv[1] == "deferred":
    imports.transformers()
from transformers import AutoModelForCausalLM, LlamaConfig
AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=16))
at_load = "scipy" in sys.modules
from transformers.loss.loss_for_object_detection import HungarianMatcher
# DETR's matcher: the one user of scipy's linear_sum_assignment, on a batch where the assignment is not the diagonal
g = torch.Generator().manual_seed(0)
outputs = {"logits": torch.randn(2, 7, 5, generator=g), "pred_boxes": torch.rand(2, 7, 4, generator=g) * 0.5 + 0.25}
targets = [{"class_labels": torch.randint(0, 5, (n,), generator=g), "boxes": torch.rand(n, 4, generator=g) * 0.5 + 0.25}
           for n in (4, 6)]
idx = HungarianMatcher(class_cost=1, bbox_cost=5, giou_cost=2)(outputs, targets)
print(at_load, "scipy" in sys.modules, "|".join(",".join(map(str, q.tolist() + t.tolist())) for q, t in idx))
"""


def test_transformers_defers_scipy_and_detr_matching_still_assigns_the_same():
    """transformers imports every loss module with its model classes, and the object-detection ones
    import scipy where it is installed (0.38 s of the H200's first update). Deferred, loading a model
    imports no scipy; the DETR matcher, its user, still imports it and assigns the same pairs."""
    env = env_with("transformers-5.17")
    plain, deferred = run(LOSSES, "plain", env), run(LOSSES, "deferred", env)
    assert plain[0] == "True" and deferred[0] == "False", (plain, deferred)  # at load: the cost, then none
    assert deferred[1] == "True"  # imported where it is used
    pairs = plain[2].split("|")
    assert len(pairs) == 2 and [len(p.split(",")) for p in pairs] == [8, 12], plain  # 4 and 6 matches
    assert deferred[2] == plain[2]
