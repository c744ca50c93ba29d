"""The checks behind a bundle's `launchable`: each returns {"ok": bool, "detail": str}.

    verl_config   the overrides composed with verl 0.8.0's own Hydra config (verl/trainer/config/
                  ppo_trainer.yaml) build verl's dataclasses (DistillationConfig, the actor, the rollout,
                  the model) and pass verl's validate_config; needs verl installed (conformance extra)
    forward       the exported base + PEFT adapter load with plain transformers/PEFT and one CPU forward
                  on a training prompt gives finite logits over the vocabulary
    tokenizer     base, teacher and the run's prompts share one tokenizer (same fingerprint)
    parquet       the data files have verl's prompt schema (and ground truths when rewards are used)
"""
from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

from ..errors import UserError
from ..weights.lora import peft_wrap_quietly
from ..weights.models import tokenizer_fingerprint
from ..rows.prompts import prompt_ids
from ..rows.verl_rows import read_verl_parquet


def _ok(detail: str) -> dict:
    return {"ok": True, "detail": detail}


def _fail(detail: str) -> dict:
    return {"ok": False, "detail": detail}


def run_all(tmp: Path, overrides: list[str], cfg, prepared: dict) -> dict:
    """`overrides` with paths absolute under `tmp` (the bundle before its rename)."""
    return {"verl_config": verl_config(overrides), "forward": forward(tmp, cfg),
            "tokenizer": tokenizer(tmp, prepared), "parquet": parquet(tmp, cfg)}


def compose_verl(overrides: list[str]):
    """verl 0.8.0's ppo_trainer config composed with `overrides` (Hydra, exactly as main_ppo does)."""
    import verl
    from hydra import compose, initialize_config_dir

    conf = Path(verl.__file__).parent / "trainer" / "config"
    with initialize_config_dir(str(conf), version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))


def verl_config(overrides: list[str]) -> dict:
    try:
        import verl  # noqa: F401
    except ImportError:
        return _fail("verl is not installed, so the bundle was not checked against verl 0.8.0's config "
                     "(install the conformance extra: tests/conformance/REQUIREMENTS.txt) and re-export")
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            return _ok(build_dataclasses(overrides))
    except Exception as e:  # verl raises assertion/value/instantiation errors of every kind
        return _fail(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500])


def build_dataclasses(overrides: list[str]) -> str:
    """Compose and build verl's dataclasses; raises on the first failure. Returns what was built."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cfg = compose_verl(overrides)
    OmegaConf.resolve(cfg)
    built = {
        "distillation": omega_conf_to_dataclass(cfg.distillation),
        "actor": omega_conf_to_dataclass(cfg.actor_rollout_ref.actor),
        "rollout": omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout),
        "model": omega_conf_to_dataclass(cfg.actor_rollout_ref.model),
    }
    if not built["distillation"].enabled:
        raise ValueError("distillation.enabled is false")
    note = ""
    try:
        validate_config(cfg, use_reference_policy=False, use_critic=False)
    except ValueError as e:
        # verl's last check asks vLLM for its LoRA rank limit; without vLLM on this machine (CPU)
        # that one check cannot run: every earlier check has passed by then
        if "vllm version" not in str(e):
            raise
        note = "; vLLM's max LoRA rank not checked (vLLM not installed here)"
    return ", ".join(f"{k}: {type(v).__name__}" for k, v in built.items()) + "; validate_config passed" + note


def forward(tmp: Path, cfg) -> dict:
    try:
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tmp / "base")
        rows = read_verl_parquet(str(tmp / "data" / "train.parquet"), cfg.data.prompt_key)
        ids = prompt_ids(tok, rows.column(cfg.data.prompt_key)[0].as_py(), cfg.data)
        base = AutoModelForCausalLM.from_pretrained(tmp / "base", dtype=torch.float32)
        with peft_wrap_quietly():
            model = PeftModel.from_pretrained(base, tmp / "adapter").eval()
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits  # [1, T, V]
        if logits.shape[:2] != (1, len(ids)) or not torch.isfinite(logits).all():
            return _fail(f"base + adapter forward gave logits {tuple(logits.shape)} with non-finite values")
        return _ok(f"base + adapter loaded with PEFT; CPU forward on {len(ids)} prompt tokens gave finite "
                   f"logits over {logits.shape[-1]} ids")
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        return _fail(f"base + adapter do not load or run: {type(e).__name__}: {first}")


def tokenizer(tmp: Path, prepared: dict) -> dict:
    from transformers import AutoTokenizer

    try:
        fps = {name: tokenizer_fingerprint(AutoTokenizer.from_pretrained(tmp / name)) for name in ("base", "teacher")}
    except Exception as e:
        return _fail(f"tokenizer files missing or unreadable: {type(e).__name__}")
    if fps["base"] != fps["teacher"]:
        return _fail(f"student and teacher tokenizers differ ({fps['base'][:12]} vs {fps['teacher'][:12]})")
    if fps["base"] != prepared.get("tokenizer"):
        return _fail(f"exported tokenizer {fps['base'][:12]} is not the one the prompts were prepared with "
                     f"({str(prepared.get('tokenizer'))[:12]})")
    return _ok(f"student, teacher and prompts share tokenizer {fps['base'][:12]}")


def parquet(tmp: Path, cfg) -> dict:
    need_truth = cfg.objective.name == "pg_k1_rewarded"
    try:
        counts = {}
        for name in ("train.parquet", "test.parquet"):
            t = read_verl_parquet(str(tmp / "data" / name), cfg.data.prompt_key)
            if "data_source" not in t.column_names:
                return _fail(f"data/{name}: missing column 'data_source' (verl's reward_fn_key)")
            if need_truth and ("reward_model" not in t.column_names or any(
                    not (r or {}).get("ground_truth") for r in t.column("reward_model").to_pylist())):
                return _fail(f"data/{name}: rows without reward_model.ground_truth (task rewards need them)")
            counts[name] = t.num_rows
    except UserError as e:
        return _fail(str(e))
    return _ok(", ".join(f"data/{k}: {v} rows" for k, v in counts.items()) + "; verl prompt schema")
