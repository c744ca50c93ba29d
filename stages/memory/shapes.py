"""Model shapes without weights, and the bytes of their parts: the numbers `opd plan` needs (hidden
size, layers, heads, vocab, tied embeddings) from a model's config file only: conf/arch/NAME.json,
a Hugging Face directory's config.json (local dir or the local hub cache), or the embedded model's
GGUF header.
"""
from __future__ import annotations

import functools
import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from ..weights import models
from ..errors import UserError

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NF4_BLOCK = 64  # bitsandbytes 4-bit: one absmax per 64 weights (fp32; uint8 + 1/256 fp32 with double quant)

# ---- model shapes, weight-free ----

@dataclass(frozen=True)
class Shape:
    source: str
    model_type: str
    vocab: int
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qk_norm: bool
    attn_bias: bool

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def proj(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each decoder-layer projection."""
        H, I = self.hidden, self.inter
        return {"q_proj": (H, self.q_dim), "k_proj": (H, self.kv_dim), "v_proj": (H, self.kv_dim),
                "o_proj": (self.q_dim, H), "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)}

    def linear_params(self) -> int:  # per layer
        return sum(i * o for i, o in self.proj().values())

    def other_params(self) -> int:
        """Embedding, untied head, norms, q/k norms, attention biases: never quantized."""
        L, H = self.layers, self.hidden
        n = self.vocab * H * (1 if self.tied else 2) + L * 2 * H + H
        n += L * 2 * self.head_dim if self.qk_norm else 0
        n += L * (self.q_dim + 2 * self.kv_dim) if self.attn_bias else 0
        return n

    def params(self) -> int:
        return self.layers * self.linear_params() + self.other_params()


_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class _GGUF:
    """Just enough of a GGUF v2/v3 reader for the header: key/values and tensor names. (The gguf
    package's reader also parses every token string into numpy: seconds; this walks them.)"""

    def __init__(self, buf):
        self.b, self.o = buf, 0

    def num(self, fmt: str):
        v = struct.unpack_from("<" + fmt, self.b, self.o)[0]
        self.o += struct.calcsize("<" + fmt)
        return v

    def string(self) -> str:
        n = self.num("Q")
        self.o += n
        return bytes(self.b[self.o - n:self.o]).decode("utf-8", "replace")

    def value(self, t: int):
        if t in _SCALAR:
            return self.num(_SCALAR[t])
        if t == 8:
            return self.string()
        et, n = self.num("I"), self.num("Q")  # array: only its length is needed
        if et in _SCALAR:
            size = struct.calcsize("<" + _SCALAR[et])
            self.o += n * size
        else:
            for _ in range(n):
                self.value(et)
        return ("array", n)


@functools.lru_cache(maxsize=8)
def gguf_config(path: Path) -> dict:
    """A config.json-like dict from a GGUF file's header (no tensor data read)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            r = _GGUF(m)
            if bytes(m[:4]) != b"GGUF":
                raise UserError(f"{path}: not a GGUF file")
            r.o = 4
            if r.num("I") < 2:
                raise UserError(f"{path}: GGUF version 1 is not supported")
            n_tensors, n_kv = r.num("Q"), r.num("Q")
            kv = {}
            for _ in range(n_kv):
                key = r.string()
                kv[key] = r.value(r.num("I"))
            names = set()
            for _ in range(n_tensors):
                names.add(r.string())
                nd = r.num("I")
                r.o += 8 * nd + 4 + 8  # dims, type, offset
    except (OSError, struct.error) as e:
        raise UserError(f"{path}: unreadable GGUF header ({e})") from None
    arch = kv.get("general.architecture", "llama")
    g = lambda k, d=None: kv.get(f"{arch}.{k}", d)  # noqa: E731
    heads = g("attention.head_count")
    toks = kv.get("tokenizer.ggml.tokens")
    conf = {"model_type": arch, "vocab_size": g("vocab_size") or (toks[1] if toks else None),
            "hidden_size": g("embedding_length"), "intermediate_size": g("feed_forward_length"),
            "num_hidden_layers": g("block_count"), "num_attention_heads": heads,
            "num_key_value_heads": g("attention.head_count_kv", heads),
            "tie_word_embeddings": "output.weight" not in names}
    if g("attention.key_length"):
        conf["head_dim"] = g("attention.key_length")
    return conf


# Hugging Face ids whose shapes ship in conf/arch/ (the builtin pairs): a plan for them needs no
# download at all. A cached config.json of the id (any revision asked for) comes first.
SHIPPED = {"HuggingFaceTB/SmolLM2-360M-Instruct": "smollm2-360m", "HuggingFaceTB/SmolLM2-1.7B-Instruct": "smollm2-1.7b",
           "Qwen/Qwen3-0.6B": "qwen3-0.6b", "Qwen/Qwen3-1.7B": "qwen3-1.7b"}


def _cached_config(name: str, revision: str | None) -> Path | None:
    """config.json of a hub id in the local Hugging Face cache (only that file need be there)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(name, "config.json", revision=revision)
    except Exception:  # not a valid repo id (e.g. a missing local path): no cache entry
        return None
    return Path(hit) if isinstance(hit, str) else None


def model_config(mcfg, role: str) -> tuple[dict, str]:
    """(config dict, where it came from) for a model name; reads no weights and downloads nothing:
    conf/arch/, the embedded GGUF's header, a local dir's config.json, the hub cache's config.json,
    else the shapes shipped for a builtin id."""
    name = mcfg.name
    if name.startswith("arch:"):
        return models.arch_config(name[5:]), f"conf/arch/{name[5:]}.json"
    if name == "embedded" or (g := models.gguf_file(name)) is not None:
        p = models.gguf_path() if name == "embedded" else g
        return gguf_config(p), f"{p.name} (GGUF header)"
    p = Path(name)
    if not p.is_dir():
        cached = _cached_config(name, mcfg.revision)
        if cached is not None:
            return json.loads(cached.read_text()), f"{name} config.json (Hugging Face cache)"
        if name in SHIPPED:
            return models.arch_config(SHIPPED[name]), f"conf/arch/{SHIPPED[name]}.json (shipped shapes of {name})"
        raise UserError(f"model '{name}': no shapes for it here (not a local directory, no config.json in the "
                        f"Hugging Face cache, none shipped in conf/arch/); fetch its config.json first: "
                        f"hf download {name} config.json")
    f = p / "config.json"
    if not f.is_file():
        raise UserError(f"model '{name}': {f} not found; expected a Hugging Face model directory")
    try:
        return json.loads(f.read_text()), str(f)
    except ValueError as e:
        raise UserError(f"{f}: not valid JSON ({e})") from None


def shape_of(mcfg, role: str) -> Shape:
    conf, source = model_config(mcfg, role)
    if "hidden_size" not in conf and isinstance(conf.get("text_config"), dict):
        conf = conf["text_config"]  # a multimodal wrapper: the language model's shapes
    need = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    for k in need:
        if not isinstance(conf.get(k), int) or conf[k] <= 0:
            raise UserError(f"{source}: key '{k}' = {conf.get(k)!r}; expected a positive integer "
                            f"(a decoder config with {', '.join(need)})")
    layers, heads = conf["num_hidden_layers"], conf["num_attention_heads"]
    if mcfg.keep_layers:
        if mcfg.keep_layers > layers:
            raise UserError(f"key '{role}.keep_layers' = {mcfg.keep_layers}; the model has only {layers} layers")
        layers = mcfg.keep_layers  # prune_layers keeps that many, evenly spaced (distinct)
    mtype = conf.get("model_type", "?")
    return Shape(source=source, model_type=mtype, vocab=conf["vocab_size"], hidden=conf["hidden_size"],
                 inter=conf["intermediate_size"], layers=layers, heads=heads,
                 kv_heads=conf.get("num_key_value_heads") or heads,
                 head_dim=conf.get("head_dim") or conf["hidden_size"] // heads,
                 tied=bool(conf.get("tie_word_embeddings", False)), qk_norm=mtype.startswith("qwen3"),
                 attn_bias=bool(conf.get("attention_bias", mtype == "qwen2")))


# ---- bytes of each component ----

def weight_bytes(sh: Shape, quant: str, double_quant: bool, s: int) -> int:
    """Weights as loaded: linear layers of the decoder in `quant`, everything else in the compute dtype
    (transformers never quantizes embeddings, norms or the output head)."""
    lin = sh.layers * sh.linear_params()
    if quant == "nf4":
        absmax = lin / NF4_BLOCK * ((1 + 4 / 256) if double_quant else 4)
        return int(lin * 0.5 + absmax) + sh.other_params() * s
    if quant == "int8":  # LLM.int8: int8 weights + one fp32 scale per output row
        rows = sh.layers * sum(o for _, o in sh.proj().values())
        return lin + 4 * rows + sh.other_params() * s
    return (lin + sh.other_params()) * s


def targets(sh: Shape, lora) -> list[str]:
    t = [m for m in lora.target_modules if m in PROJ or m == "lm_head"]
    if not t:
        raise UserError(f"key 'lora.target_modules' = {list(lora.target_modules)}: none is a projection of a "
                        f"{sh.model_type} model ({', '.join(PROJ)}, lm_head)")
    return t


def lora_params(sh: Shape, lora) -> int:
    tg, proj = targets(sh, lora), sh.proj()
    n = sh.layers * sum(lora.r * (i + o) for name, (i, o) in proj.items() if name in tg)
    return n + (lora.r * (sh.hidden + sh.vocab) if "lm_head" in tg else 0)


# decoder.sampling_weights concatenates q/k/v and gate/up (one matmul each per decode step): new tensors
FUSED = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def engine_copy_bytes(sh: Shape, lora, s: int, dense: bool = False) -> int:
    """The engine's own weights: q/k/v and gate/up fused (always a copy) plus a merged (base + LoRA
    delta) copy of o_proj/down_proj/lm_head where LoRA targets them; the rest is shared, not copied.
    dense: an NF4 base, every projection dequantized into a copy (the head is never quantized)."""
    tg, proj = targets(sh, lora), sh.proj()
    n = sh.layers * sum(i * o for name, (i, o) in proj.items() if dense or name in FUSED or name in tg)
    return n * s + head_copy_bytes(sh, lora, s)


def plain_engine_bytes(sh: Shape, s: int, dense: bool = False) -> int:
    """A fast engine over a model without LoRA (evaluation's greedy teacher): only q/k/v and gate/up
    are copied (fused); o/down and the head are the model's own. dense: an NF4 base, every
    projection dequantized into a copy."""
    return sh.layers * sum(i * o for name, (i, o) in sh.proj().items() if dense or name in FUSED) * s


def head_copy_bytes(sh: Shape, lora, s: int) -> int:
    """The engine's merged copy of the LM head, where LoRA targets it (otherwise it reads the model's)."""
    return sh.vocab * sh.hidden * s if "lm_head" in targets(sh, lora) else 0


def pristine_bytes(sh: Shape, s: int) -> int:
    """memory.merge_in_place: the host copy of every decoder layer's projections (decoder.fuse_projections)."""
    return sh.layers * sum(i * o for i, o in sh.proj().values()) * s


def saved_per_token_layer(sh: Shape, lora, s: int, kernels: bool = False) -> int:
    """Bytes autograd keeps per token and decoder layer for the LoRA backward (no checkpointing).

    Two RMSNorms keep an fp32 copy of their input (8H); SDPA keeps q and k, v repeated to all heads
    (transformers repeats them under a padding mask) and its output (4 q_dim s); the MLP keeps gate,
    act(gate) and up (3I s); Qwen3's q/k norms keep fp32 copies. Each LoRA layer keeps its input in
    fp32 (PEFT casts the input to the fp32 adapter's dtype: with a bf16 base every targeted
    projection makes its own copy; in fp32 the inputs are shared tensors) and lora_A's output [r]. With
    `kernels` (stages/weights/lora_kernels.py) the input is kept as it is, one tensor per input shared
    by the projections that read it."""
    H, I, qd, r = sh.hidden, sh.inter, sh.q_dim, lora.r
    b = 8 * H + 4 * qd * s + 3 * I * s
    b += (qd + sh.kv_dim) * 4 if sh.qk_norm else 0
    inputs = {"q_proj": ("attn_in", H), "k_proj": ("attn_in", H), "v_proj": ("attn_in", H),
              "o_proj": ("attn_out", qd), "gate_proj": ("mlp_in", H), "up_proj": ("mlp_in", H),
              "down_proj": ("mlp_mid", I)}
    seen: set[str] = set()
    for name in targets(sh, lora):
        if name not in inputs:
            continue
        key, width = inputs[name]
        b += 4 * r
        if kernels:
            if key != "attn_out" and key not in seen:
                b += s * width
                seen.add(key)
        elif s != 4:
            b += 4 * width
        elif key != "attn_out" and key not in seen:  # fp32 attn_out is SDPA's own (kept) output
            b += 4 * width
            seen.add(key)
    return b


def forward_bytes(sh: Shape, tokens: int, s: int) -> int:
    """Peak transient of a no-grad forward: one layer's residual + normed input + its MLP
    (act(gate), up, product) or attention (q, k, v repeated, output), whichever is larger."""
    return tokens * max(2 * sh.hidden + 3 * sh.inter, 2 * sh.hidden + 5 * sh.q_dim) * s


def dequant_bytes(sh: Shape, quant: str, tokens: int, s: int) -> int:
    """A quantized matmul's scratch: NF4 dequantizes one projection to the compute dtype; int8 holds an
    int32 output."""
    big = max(i * o for i, o in sh.proj().values())
    if quant == "nf4":
        return big * s
    if quant == "int8":
        return tokens * max(o for _, o in sh.proj().values()) * 4
    return 0
