"""Model folders that transformers 4.56-4.57 and 5.x read to the same model and tokenizer.

verl 0.8.0's vLLM extra pins vllm<=0.12, which needs transformers<5, so the bundle's base/ and
teacher/ are read by transformers 4.x on the cluster; our store holds what transformers 5 wrote.
Two differences change what 4.x computes, silently or not:

  config.json            5.x keeps RoPE in `rope_parameters` {rope_type, rope_theta, ...}; 4.x reads
                         only top-level `rope_theta` (+ `rope_scaling` for scaled types) and otherwise
                         falls back to its default theta (10,000): same weights, different logits.
  tokenizer_config.json  5.x names its generic class `TokenizersBackend` (no such class in 4.x: the
                         tokenizer does not load) and writes extra special tokens as a list under
                         `extra_special_tokens`, where 4.x expects a dict (a list is 4.x's
                         `additional_special_tokens`).

So each folder is copied with both forms written: `rope_parameters` stays (5.x reads it first) and
`rope_theta`/`rope_scaling` are added with the same values; the tokenizer class becomes the 4.x
class of the same behaviour (`PreTrainedTokenizerFast` reads tokenizer.json as it is, as
`TokenizersBackend` does). After writing, 5.x re-reads the folder and must get the same RoPE as
before. A folder whose form 4.x cannot be told (an architecture whose 4.x config we have not
checked, per-layer RoPE, no tokenizer.json) is refused: UserError, naming the file and the key.
tests/verl/test_transformers4.py loads a bundle under transformers 4.57 and compares logits and ids.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..errors import UserError

# model_type -> 4.x config class reads top-level rope_theta/rope_scaling exactly as written here
# (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config in transformers 4.57; the logits test covers
# llama and qwen3 with scaled RoPE). Others are refused rather than guessed.
CHECKED_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# RoPE types 4.57's rope_config_validation knows, with the keys it reads from rope_scaling
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
SKIP = ("manifest.json", "state.json")  # store bookkeeping, not part of a model folder


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: unreadable ({type(e).__name__}); expected a JSON model file") from None


def _write(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def config_for_both(cfg: dict, where: str) -> dict:
    """config.json readable by 4.x and 5.x alike (5.x form + the 4.x RoPE keys)."""
    mt = cfg.get("model_type")
    if mt not in CHECKED_TYPES:
        raise UserError(f"{where}: model_type {mt!r} has no checked transformers 4.x form (expected one of "
                        f"{', '.join(CHECKED_TYPES)}); verl 0.8.0 runs transformers<5")
    rope = cfg.get("rope_parameters")
    if rope is None:  # already the 4.x form (written by 4.x, or by 5.x for a model without RoPE params)
        return dict(cfg)
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        raise UserError(f"{where}: key 'rope_parameters' is per layer type; transformers 4.x has no such form")
    rtype = rope.get("rope_type", rope.get("type", "default"))
    if rtype not in ROPE_TYPES or "rope_theta" not in rope:
        raise UserError(f"{where}: key 'rope_parameters' = {rope!r}; transformers 4.x reads rope_theta with "
                        f"rope_type one of {', '.join(ROPE_TYPES)}")
    out = dict(cfg)
    out["rope_theta"] = rope["rope_theta"]
    if "partial_rotary_factor" in rope:
        out["partial_rotary_factor"] = rope["partial_rotary_factor"]
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor", "type")}
    scaling["rope_type"] = rtype
    out["rope_scaling"] = None if rtype == "default" else scaling
    return out


def tokenizer_config_for_both(tc: dict, where: str) -> dict:
    out = dict(tc)
    if out.get("tokenizer_class") == "TokenizersBackend":
        out["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = out.get("extra_special_tokens")
    if isinstance(extra, list):  # 5.x's list form is 4.x's additional_special_tokens (5.x converts it back)
        out.pop("extra_special_tokens")
        out["additional_special_tokens"] = extra
    elif extra is not None and not isinstance(extra, dict):
        raise UserError(f"{where}: key 'extra_special_tokens' = {extra!r}; expected a list or a mapping")
    return out


def check(src: Path, label: str) -> None:
    """UserError (one line) unless `src` can be written in the form both transformers lines read."""
    src = Path(src)
    for need in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if not (src / need).is_file():
            raise UserError(f"{label}: {need} missing from {src}; a verl bundle needs a Hugging Face model folder "
                            "with a fast tokenizer (tokenizer.json)")
    config_for_both(_read(src / "config.json"), f"{label}/config.json")
    tokenizer_config_for_both(_read(src / "tokenizer_config.json"), f"{label}/tokenizer_config.json")


def write(src: Path, dst: Path, label: str) -> None:
    """Copy model folder `src` to `dst` (a new dir) in the form both transformers lines read."""
    src, dst = Path(src), Path(dst)
    check(src, label)
    dst.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in SKIP:
            shutil.copyfile(f, dst / f.name)  # a copy, never a link into the store: the bundle moves
    _write(dst / "config.json", config_for_both(_read(src / "config.json"), f"{label}/config.json"))
    _write(dst / "tokenizer_config.json",
           tokenizer_config_for_both(_read(src / "tokenizer_config.json"), f"{label}/tokenizer_config.json"))
    _check_5x(src, dst, label)


def _check_5x(src: Path, dst: Path, label: str) -> None:
    """transformers 5 reads the rewritten config to the RoPE it read before (its `rope_scaling` wins
    over `rope_parameters` when both are present, so the two must agree)."""
    import transformers
    from transformers import AutoConfig

    if int(transformers.__version__.split(".")[0]) < 5:
        return  # the folder came from 4.x: nothing was rewritten that 4.x could disagree with
    before, after = AutoConfig.from_pretrained(src), AutoConfig.from_pretrained(dst)
    if before.rope_parameters != after.rope_parameters:
        raise UserError(f"{label}/config.json: rewritten RoPE reads back as {after.rope_parameters!r}, not "
                        f"{before.rope_parameters!r}")
