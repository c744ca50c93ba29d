"""Real families through the whole pipeline on the CPU (issue #44, item 4): Qwen2 (q/k/v biases, an
untied LM head) and Qwen3 (per-head q/k RMSNorm, head_dim set apart from hidden / heads) as tiny random
student/teacher pairs (conf/arch/tiny-qwen*.json, tests/families.py); and a GGUF file's path as a model
name. The GPU fast path (decode kernels, CUDA graphs) of the same: tests/gpu/test_gpu_families.py."""
from __future__ import annotations

import json

import pytest
import torch

import families
from engine_models import PAD, PROMPTS, hf_greedy, tiny, with_trained_lora
from families import FAMILIES, Run
from stages.engine import decoder, graphs, sampler
from stages.engine.sampling import Sampling
from support import ROOT, TINY, opd

UPDATES = 2
TEMPERATURE = 0.7


def test_the_tiny_pairs_are_the_families_they_name():
    """conf/arch/tiny-qwen*.json build what they claim, at tiny-llama's vocabulary (SmolLM2's tokenizer),
    and the engine and the padded teacher-forced layout take them (no fallback)."""
    llama = json.loads((ROOT / "conf/arch/tiny-llama.json").read_text())
    for family in FAMILIES:
        for name in (f"tiny-{family}", f"tiny-{family}-teacher"):
            spec = json.loads((ROOT / "conf/arch" / f"{name}.json").read_text())
            assert spec["vocab_size"] == llama["vocab_size"] and spec["eos_token_id"] == llama["eos_token_id"], name
            m = tiny(name)
            assert m.config.model_type == family and sampler.supported(m) is None and graphs.layout_ok(m), name
            a = m.model.layers[0].self_attn
            if family == "qwen2":
                assert all(p.bias is not None for p in (a.q_proj, a.k_proj, a.v_proj)) and a.o_proj.bias is None
                assert m.lm_head.weight.data_ptr() != m.model.embed_tokens.weight.data_ptr()  # untied head
            else:
                assert a.q_norm.weight.shape == (32,) and a.q_proj.bias is None
                assert m.config.head_dim == 32 != m.config.hidden_size // m.config.num_attention_heads


@pytest.mark.parametrize("in_place", [False, True], ids=["copy", "in_place"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_a_lora_equals_transformers_generate(family, in_place):
    """The engine's greedy decode equals transformers' `generate` for the family's student with a
    non-trivial LoRA on all seven projections and (Qwen2) non-zero q/k/v biases: the biases survive the
    LoRA merge into the sampling weights, and (in_place: memory.merge_in_place) the re-homing of the
    projections into one flat buffer (decoder.fuse_projections) and the merge into the weights themselves.
    Not vacuous: the same engine without the biases decodes other tokens."""
    base = families.model(family)
    if in_place:
        decoder.fuse_projections(base)
    m = with_trained_lora(base)
    eng = sampler.make(m, use_graphs=False)
    assert eng is not None and eng.in_place == in_place
    for got, want in zip([w["qkv_bias"] for w in eng.W["layers"]], families.qkv_biases(m)):
        assert (got is None) == (want is None) == (family != "qwen2")
        assert got is None or torch.equal(got, want)
    n = 12
    out = eng.generate(PROMPTS, n, eos=-1, pad=PAD, seed=0, sampling=Sampling(greedy=True))  # eos=-1: never stop
    for b, p in enumerate(PROMPTS):
        assert out.tokens[b].tolist() == hf_greedy(m, p, n), (family, b)  # (in place: the pristine base again)
    if family == "qwen2":
        for w in eng.W["layers"]:
            w["qkv_bias"] = None
        dropped = eng.generate(PROMPTS, n, eos=-1, pad=PAD, seed=0, sampling=Sampling(greedy=True))
        assert not torch.equal(dropped.tokens, out.tokens)


def test_a_bias_the_engine_does_not_add_falls_back_to_transformers(capsys):
    """An o_proj bias (attention_bias of Qwen3 and Llama) or an MLP bias (mlp_bias): the functional decoder
    adds q/k/v biases only, so such a model samples through transformers (with the warning), not through
    an engine that would drop them."""
    for name, over in (("tiny-qwen3", {"attention_bias": True}), ("tiny-llama", {"mlp_bias": True})):
        m = with_trained_lora(tiny(name, **over))
        assert "bias" in (sampler.supported(m) or "") and sampler.make(m, use_graphs=True) is None, name
        assert "transformers fallback" in capsys.readouterr().err


# decoder.fused_layer through Triton's interpreter (tests/interpreter.py: a fresh process), at the head dim
# of tiny-qwen2-teacher and tiny-llama-teacher (96 / 4 = 24): on CPU decode_attention.usable is false,
# as on CUDA for a head dim that is no power of two
NOT_A_POWER_OF_TWO = """
import json, sys
sys.path.insert(0, "tests")
import torch
from stages.engine import kernels
import layer_cases
kernels.usable = lambda rows, dtype, device, act: True  # (CPU tensors: the interpreter runs the kernel)
print(json.dumps([layer_cases.compare("cpu", torch.float16, H=4, KV=2, D=24, seed=s, qwen3=q, bias=b, float_mask=f)
                  for s, (q, b, f) in enumerate([(False, True, False), (True, False, True)])]))
"""


def test_fused_decode_layer_takes_a_head_dim_that_is_no_power_of_two():
    """The compiled decode step's layer (decoder.fused_layer, the Triton projections) where the attention
    kernels cannot serve the head dim (theirs must be a power of two: rope_cache's and rope_attention's
    aranges): SDPA attends, and the layer agrees with decoder.layer to a few ulps. (It took
    kernels.rope_cache before, which Triton refuses for such a head dim, "arange's range must be a power
    of 2": on CUDA the engine's capture then fell back to the eager step with a warning, for the 24-dim
    teachers' greedy answers in evaluate.)"""
    import interpreter

    for row in interpreter.run(NOT_A_POWER_OF_TWO):
        assert row["stream"] <= 8 * row["eps"] and row["cache"] <= 8 * row["eps"], row


def test_qwen2_sampled_logprobs_with_biases_match_transformers(monkeypatch):
    """The log-probs the engine records while sampling a Qwen2 with non-zero biases and a LoRA, against
    transformers' forward (the end-to-end runs below start from transformers' zero biases)."""
    m = with_trained_lora(families.model("qwen2"))
    eng = sampler.make(m, use_graphs=False)
    out = eng.generate(PROMPTS, 8, eos=2, pad=PAD, seed=3, sampling=Sampling(TEMPERATURE))
    resp = [out.tokens[b, :int(out.lengths[b])].tolist() for b in range(len(PROMPTS))]
    rec = [out.logprobs[b, :int(out.lengths[b])].tolist() for b in range(len(PROMPTS))]
    families.check_logprobs(m, PROMPTS, resp, rec, TEMPERATURE, PAD, monkeypatch, "qwen2 with biases")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """One working dir for this module's runs: each its own run view (run=NAME), one store (the
    tokenizer made once)."""
    d = tmp_path_factory.mktemp("families")
    (d / "conf").symlink_to(ROOT / "conf")
    return d


@pytest.mark.parametrize("family", FAMILIES)
def test_opd_run_samples_with_the_engine_and_its_logprobs_are_transformers(family, work, monkeypatch):
    """A tiny `opd run` of the family's pair: it completes (every step's policy, finite history and
    evaluation), the rollout engine sampled (no transformers fallback), and the log-probs step 2's
    rollout recorded are those of plain transformers + PEFT running policy 1 (the store's base, update
    1's adapter) on the sampled tokens. Qwen2 runs with memory.merge_in_place (the engine merges into
    the student's own fused weights)."""
    extra = ["memory.merge_in_place=true"] if family == "qwen2" else []
    r = opd("run", *families.overrides(family), f"train.updates={UPDATES}", f"rollout.temperature={TEMPERATURE}",
            f"run={family}", *extra, cwd=work)
    assert "evaluate:" in r.stdout and "transformers fallback" not in r.stderr, r.stderr
    assert "merge_in_place: no fast rollout engine" not in r.stderr, r.stderr
    run = Run(work, family)
    run.check_finished(UPDATES)
    assert run.config["student"]["name"] == f"arch:tiny-{family}" and run.config["memory"]["merge_in_place"] == bool(extra)
    cfg = json.loads((run.model_dir("student") / "config.json").read_text())
    assert cfg["model_type"] == family and cfg.get("head_dim", 16) == (32 if family == "qwen3" else 16)
    rows = run.rollout(2)
    assert {x["policy_version"] for x in rows} == {1} and len(rows) == 4
    model = run.policy(1)
    families.check_logprobs(model, [x["prompt_ids"] for x in rows], [x["response_ids"] for x in rows],
                   [x["sample_logprobs"] for x in rows], TEMPERATURE, PAD, monkeypatch, f"opd run {family}")


# ---- a GGUF file's path as a model name ----

def write_gguf(model, path) -> None:
    """A Llama as llama.cpp's converter writes it (F32 tensors, q/k rows in its interleaved rotary order,
    the hyper-parameters under llama.*), with the embedded GGUF's tokenizer (SmolLM2's: tiny-llama's vocabulary)."""
    import gguf

    from stages.weights import models

    c, w = model.config, gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    for key, f in gguf.GGUFReader(models.gguf_path()).fields.items():
        if key.startswith("tokenizer."):
            w.add_key_value(key, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)

    def permute(t, heads):  # convert_hf_to_gguf.py's LlamaModel.permute (transformers' loader undoes it)
        return t.reshape(heads, 2, t.shape[0] // heads // 2, -1).transpose(1, 2).reshape(t.shape)

    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    for key, t in model.state_dict().items():
        if key == "lm_head.weight" and c.tie_word_embeddings:
            continue
        mod = key.removesuffix(".weight")
        if mod.startswith("model.layers."):
            i, mod = mod.split(".", 3)[2:]
            t = permute(t, c.num_attention_heads) if mod == "self_attn.q_proj" else \
                permute(t, c.num_key_value_heads) if mod == "self_attn.k_proj" else t
            name = f"blk.{i}.{names[mod]}.weight"
        else:
            name = f"{names[mod]}.weight"
        w.add_tensor(name, t.float().contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_gguf_file_path_is_a_model_name(work, tmp_path):
    """student.name=/path/to/model.gguf: prepare dequantises the file as it does the embedded model (the
    store's weights are the ones written, bit for bit; its tokenizer is the embedded one, so it pairs
    with an arch: teacher), and the run goes through. A `.gguf` name that is no file is refused by name."""
    pytest.importorskip("gguf")
    from safetensors.torch import load_file

    src = tiny("tiny-llama")
    g = tmp_path / "tiny.gguf"
    write_gguf(src, g)
    over = [o for o in TINY if not o.startswith("student.")] + [f"student.name={g}", "student.keep_layers=0"]
    opd("run", *over, "train.updates=1", "run=gguf", cwd=work)
    run = Run(work, "gguf")
    run.check_finished(1)
    d = run.model_dir("student")
    assert json.loads((d / "config.json").read_text())["model_type"] == "llama"
    got = load_file(d / "model.safetensors")
    want = {k: v for k, v in src.state_dict().items() if k != "lm_head.weight"}  # (tied: saved once)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    r = opd("stage", "prepare", *over[:-2], f"student.name={tmp_path / 'missing.gguf'}", cwd=work, check=False)
    assert r.returncode != 0 and "no such GGUF file" in r.stderr, r.stderr
