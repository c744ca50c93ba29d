"""bitsandbytes NF4/int8 on CPU: QLoRA update steps change the adapter with a finite loss, quantized
teachers score, NF4 LoRA gradients equal the dequantized model's (also after an eval forward: the
CPU inference repacking has no autograd), quant joins exactly the digests it changes, and a
missing bitsandbytes is a one-line error."""
from __future__ import annotations

import json
import sys

import pytest
import torch
from support import seeds, session
from safetensors.torch import load_file

from stages import train
from stages.engine import lmhead
from stages.engine.sampling import Sampling
from stages.weights import lora, models
from stages.run.config import LoraCfg, ModelCfg
from stages.errors import UserError


@pytest.mark.parametrize("over", [
    ["student.quant=nf4", "teacher.quant=int8"],
    ["student.quant=int8", "teacher.quant=nf4", "teacher.double_quant=true"],
    ["student.quant=nf4", "student.dense_copy=false", "teacher.quant=nf4", "teacher.dense_copy=false"],
])
def test_quantized_lora_update_changes_the_adapter_with_finite_loss(work, over):
    sess = session(work, *over)
    train.ensure_policy(sess, 1)
    init = load_file(sess.policy_dir(0) / "adapter" / "adapter_model.safetensors")
    d = sess.policy_dir(1)
    after = load_file(d / "adapter" / "adapter_model.safetensors")
    st = json.loads((d / "state.json").read_text())
    assert torch.isfinite(torch.tensor(st["loss"])) and st["loss"] > 0 and st["grad_norm"] > 0
    changed = {n for n in init if not torch.equal(init[n], after[n])}
    # step 1 starts from B = 0, so A's gradient (through B) is zero: every B moves, A waits a step
    assert changed == {n for n in init if "lora_B" in n} and len(changed) == 14
    # NF4 samples with the engine from a dense copy (none with dense_copy=false); int8 (LLM.int8 quantizes
    # activations) through transformers
    assert (sess.models.engine() is not None) == ("student.quant=nf4" in over and "student.dense_copy=false" not in over)
    q = sess.models.student().get_base_model().model.layers[0].self_attn.q_proj.base_layer
    assert type(q).__name__ == ("Linear4bit" if "student.quant=nf4" in over else "Linear8bitLt")
    sc = json.loads((sess.store.path("score", sess.chain.score(1)) / "state.json").read_text())
    assert sc["selected_positions"] > 0


def _grads(model_dir, quant, warm, seed=0):
    base = models.load(model_dir, ModelCfg(quant=quant), torch.device("cpu"), torch.float32)
    return base, _lora_grads(base, warm, seed)


def _lora_grads(base, warm, seed=0):
    s = lora.add(base, LoraCfg(r=4, alpha=8), 1)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in s.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    p = lmhead.pack([[1, 5, 6, 7, 8]], [[9, 10, 11]], [[1, 1, 1]], 2, "cpu")
    if warm:  # what rollout/score do before an update: an eval forward without grad
        with torch.no_grad():
            lmhead.hidden(s, p)
    s.train()
    h = lmhead.hidden(s, p)
    torch.nn.functional.linear(h, lmhead.head_weight(s)).logsumexp(-1).sum().backward()
    return {n: q.grad.clone() for n, q in s.named_parameters() if q.requires_grad}


@pytest.mark.parametrize("seed", seeds(1))
def test_nf4_lora_gradients_equal_the_dequantized_models(work, seed):
    import bitsandbytes.functional as bf

    sess = session(work)
    d = sess.models.model_dir("student")
    qbase, got = _grads(d, "nf4", warm=True, seed=seed)
    ref = models.load(d, ModelCfg(), torch.device("cpu"), torch.float32)
    with torch.no_grad():  # the same weights, dequantized into a plain fp32 model
        for name, mod in qbase.named_modules():
            if type(mod).__name__ == "Linear4bit":
                w = bf.dequantize_4bit(mod.weight.data, mod.weight.quant_state)  # qbase carries LoRA wrappers
                ref.get_submodule(name.replace(".base_layer", "")).weight.copy_(w)
    want = _lora_grads(ref, warm=False, seed=seed)
    assert set(got) == set(want)
    for n in want:
        # bit for bit: bitsandbytes' CPU path dequantizes NF4 to fp32 (code * absmax: one correctly
        # rounded product per weight, the same dequantize_4bit call that built the reference) and runs
        # the same fp32 F.linear on those numbers, so forward and backward are the same ops on the
        # same values (a fused 4-bit CPU GEMM, if bitsandbytes loaded one, would need a bound instead)
        assert torch.equal(got[n], want[n]), n
    first = [n for n in want if "layers.0.self_attn.q_proj.lora_A" in n][0]
    assert want[first].norm() > 0.1  # the earliest adapter gets its gradient through the 4-bit base


def test_nf4_student_samples_with_the_engine_as_transformers_would(work):
    """The engine's dense copy of an NF4 base samples what the QLoRA model computes: greedy tokens
    equal transformers' greedy decoding of the 4-bit model (LoRA unmerged there), and sampled
    log-probs equal a teacher-forced recompute through the 4-bit forward (fp32 on CPU: the dequantized
    weights are the very numbers bitsandbytes' forward multiplies with)."""
    from stages.engine import sampler

    sess = session(work)
    base = models.load(sess.models.model_dir("student"), ModelCfg(quant="nf4"), torch.device("cpu"), torch.float32)
    s = lora.add(base, LoraCfg(r=4, alpha=8), 1)
    with torch.no_grad():  # a non-trivial adapter: merging it must matter
        g = torch.Generator().manual_seed(0)
        for n, p in s.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    eng = sampler.make(s, use_graphs=False)
    assert eng is not None
    prompts = [[1, 500, 600, 700, 800], [1, 42], [1, 9000, 9001, 9002]]
    got = eng.generate(prompts, 10, eos=-1, pad=2, seed=0, sampling=Sampling(greedy=True))
    ref = sampler.hf_generate(s, prompts, 10, eos=-1, pad=2, seed=0, sampling=Sampling(greedy=True))
    assert torch.equal(got.tokens, ref.tokens)
    out = eng.generate(prompts, 10, eos=-1, pad=2, seed=3)
    resp = [out.tokens[b].tolist() for b in range(len(prompts))]
    p = lmhead.pack(prompts, resp, [[1] * len(r) for r in resp], 2, "cpu")
    with torch.no_grad():
        lp, *_ = lmhead.score_positions(lmhead.hidden(s, p), lmhead.head_weight(s), p.targets, 64, 0,
                                        want_topk=False)
    # fp32, ~1e-5 per logit from summation order (merged LoRA vs its separate branch, the functional
    # decoder vs transformers'), log-softmax over 49k entries: well inside 1e-3
    assert (lp - out.logprobs.reshape(-1)).abs().max() < 1e-3


def test_int8_student_keeps_the_transformers_fallback(work, capsys):
    from stages.engine import sampler

    sess = session(work)
    base = models.load(sess.models.model_dir("student"), ModelCfg(quant="int8"), torch.device("cpu"), torch.float32)
    assert sampler.make(lora.add(base, LoraCfg(r=4, alpha=8), 1), use_graphs=False) is None
    assert "int8 base" in capsys.readouterr().err


def test_nf4_without_the_dense_copy_samples_through_transformers_unwarned(work, capsys):
    from stages.engine import sampler

    sess = session(work)
    mcfg = ModelCfg(quant="nf4", dense_copy=False)
    base = lora.add(models.load(sess.models.model_dir("student"), mcfg, torch.device("cpu"), torch.float32),
                    LoraCfg(r=4, alpha=8), 1)
    capsys.readouterr()
    assert sampler.make(base, use_graphs=False) is None
    assert capsys.readouterr().err == ""  # the user's choice, not a fallback to warn about
    assert sampler.supported(base) is None  # (the fast path could run it: the choice is the setting's)


def test_quant_joins_the_digests_it_changes(work):
    plain = session(work)
    s_nf4 = session(work, "student.quant=nf4")
    t_nf4 = session(work, "teacher.quant=nf4")
    t_dq = session(work, "teacher.quant=nf4", "teacher.double_quant=true")
    # a quantized student samples and trains differently
    assert s_nf4.chain.rollout(1) != plain.chain.rollout(1) and s_nf4.chain.update(1) != plain.chain.update(1)
    # a quantized teacher scores differently, but the first rollout is reused (cross-run reuse)
    assert t_nf4.chain.rollout(1) == plain.chain.rollout(1)
    assert t_nf4.chain.score(1) != plain.chain.score(1) != t_dq.chain.score(1) != t_nf4.chain.score(1)
    # sampling NF4 through transformers (dense_copy=false) joins the stages that sample with that role:
    # the student's rollouts and evaluation, not the teacher's scores; the teacher's: evaluation only
    s_small = session(work, "student.quant=nf4", "student.dense_copy=false")
    assert s_small.chain.rollout(1) != s_nf4.chain.rollout(1) and s_small.chain.evaluate() != s_nf4.chain.evaluate()
    t_small = session(work, "teacher.quant=nf4", "teacher.dense_copy=false")
    assert t_small.chain.score(2) == t_nf4.chain.score(2) and t_small.chain.evaluate() != t_nf4.chain.evaluate()
    # placement and memory settings change nothing that is computed
    other = session(work, "memory.placement=resident", "memory.chunk_floor=4", "memory.vram_gib=64")
    assert other.chain.update(2) == plain.chain.update(2)


def test_missing_bitsandbytes_is_a_one_line_error(work, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` now fails
    sess = session(work, "student.quant=nf4", "memory.placement=resident")
    with pytest.raises(UserError) as e:
        models.load(sess.models.model_dir("student"), sess.cfg.student, sess.device, sess.dtype)
    assert "bitsandbytes" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("student_dense,teacher_dense", [(True, False), (False, True)])
def test_the_shared_teacher_samples_as_teacher_dense_copy_says(work, student_dense, teacher_dense):
    """Under shared_backbone the teacher is a view of the student's NF4 base with a state of its own:
    teacher.dense_copy decides how it samples (evaluation, rollout.sampler=teacher), not the student's."""
    from stages.engine import sampler
    from stages.memory import placement

    sess = session(work, "teacher.name=arch:tiny-llama", "teacher.init=random", "memory.placement=shared_backbone",
                   "student.quant=nf4", "teacher.quant=nf4", f"student.dense_copy={str(student_dense).lower()}",
                   f"teacher.dense_copy={str(teacher_dense).lower()}")
    student, teacher = sess.models.student(), sess.models.teacher()
    assert isinstance(teacher, placement.SharedTeacher)
    assert (sampler.make(student, use_graphs=False) is not None) == student_dense
    assert (sampler.make(teacher, use_graphs=False) is not None) == teacher_dense


def test_sampling_over_4bit_weights_joins_the_teacher_sampler_and_tooleval(work):
    plain = session(work, "rollout.sampler=teacher", "objective.name=nll", "teacher.quant=nf4")
    small = session(work, "rollout.sampler=teacher", "objective.name=nll", "teacher.quant=nf4",
                    "teacher.dense_copy=false")
    assert small.chain.rollout(1) != plain.chain.rollout(1)
    student = session(work, "rollout.sampler=teacher", "objective.name=nll", "teacher.quant=nf4",
                      "student.quant=nf4", "student.dense_copy=false")  # (the student does not sample)
    dense = session(work, "rollout.sampler=teacher", "objective.name=nll", "teacher.quant=nf4", "student.quant=nf4")
    assert student.chain.rollout(1) == dense.chain.rollout(1)
    tool = ["env.name=calculator", "student.quant=nf4"]
    a, b = session(work, *tool), session(work, *tool, "student.dense_copy=false")
    pol = a.chain.policy(1)
    assert a.chain.tooleval("update", pol) != b.chain.tooleval("update", pol)
