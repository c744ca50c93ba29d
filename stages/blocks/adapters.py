"""LoRA adapters and their optimizer state as files: the PEFT adapter dir and optimizer.safetensors
that init, sft and update publish, and the teacher with an SFT adapter merged in.

The safetensors files are serialised in memory and written with `store.write_bytes`, which hashes
the bytes as it writes them: sealing the stage then does not read back and re-hash what was just
written (the same bytes as safetensors' save_file)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from . import models
from .config import LoraCfg, OptimCfg
from .store import write_bytes


def to_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Device -> host in one copy per dtype (hundreds of small LoRA tensors would each sync).

    CUDA: on a side stream into pinned memory. This runs on the publish thread; a blocking `.cpu()`
    there would queue on the default stream, between the next step's kernels, and crawl through
    pageable memory (~26 ms per copy of adapter or moments measured on an H200, the decode waiting
    behind it). The side stream first waits for what is queued now (the optimizer step that made
    these values); only this thread waits for the copies."""
    out: dict[str, torch.Tensor] = {}
    groups = {dt: [n for n, t in tensors.items() if t.dtype == dt] for dt in {t.dtype for t in tensors.values()}}
    on_cuda = [t.device for t in tensors.values() if t.device.type == "cuda"]
    flats = {}
    if on_cuda:
        side = torch.cuda.Stream(on_cuda[0])
        side.wait_stream(torch.cuda.current_stream(on_cuda[0]))
        with torch.cuda.stream(side):
            for dt, names in groups.items():
                dev_flat = torch.cat([tensors[n].detach().reshape(-1) for n in names])
                flats[dt] = torch.empty(dev_flat.shape, dtype=dt, pin_memory=True)
                flats[dt].copy_(dev_flat, non_blocking=True)
                del dev_flat  # (freed on the side stream, which alone used it)
        side.synchronize()
    else:
        flats = {dt: torch.cat([tensors[n].detach().reshape(-1) for n in names]).cpu() for dt, names in groups.items()}
    for dt, names in groups.items():
        for n, piece in zip(names, flats[dt].split([tensors[n].numel() for n in names])):
            out[n] = piece.view(tensors[n].shape).clone()
    return dict(sorted(out.items()))


def make_optimizer(o: OptimCfg, student, state_file: Path | None):
    """AdamW over the LoRA parameters (o: OptimCfg), state restored from optimizer.safetensors when given."""
    named = models.trainable(student)
    opt = torch.optim.AdamW([p for _, p in named], lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay, foreach=True)
    if state_file is not None and state_file.exists():
        sd = load_file(state_file, device=str(named[0][1].device) if named else "cpu")
        step = sd.pop("__step__", None)
        for name, p in named:
            if f"{name}.exp_avg" in sd:
                # one step tensor per parameter (a shared one is advanced once per parameter by foreach
                # AdamW: a resumed run would then differ from an uninterrupted one)
                opt.state[p] = {"step": step.cpu().float().clone() if step is not None else torch.tensor(0.0),
                                "exp_avg": sd[f"{name}.exp_avg"], "exp_avg_sq": sd[f"{name}.exp_avg_sq"]}
    return opt, named


def save_optimizer(opt, named, path: Path) -> None:
    out, step = {}, None
    for name, p in named:
        st = opt.state.get(p)
        if st:
            out[f"{name}.exp_avg"] = st["exp_avg"]
            out[f"{name}.exp_avg_sq"] = st["exp_avg_sq"]
            step = st["step"]
    out = to_cpu(out) if out else out
    if step is not None:
        out["__step__"] = torch.as_tensor(step, dtype=torch.float32).reshape(()).cpu()
    write_bytes(path, save(out))


def save_adapter(student, out: Path, base_name: str) -> None:
    """A standard PEFT adapter dir (adapter_model.safetensors + adapter_config.json, what
    PeftModel.from_pretrained reads); the base path is a stable name so files are byte-reproducible."""
    from peft import get_peft_model_state_dict

    pc = student.peft_config["default"]
    pc.base_model_name_or_path = base_name
    out.mkdir(parents=True, exist_ok=True)
    # PEFT's "auto" looks up the base's config.json by name (a stable name here, not a path) to see whether
    # the embeddings changed, and warns when it cannot; they only can when LoRA targets them. Not
    # targeted: False is what "auto" resolves to, without the lookup (same bytes, no warning).
    tm = pc.target_modules
    embeddings = isinstance(tm, str) or any(m in ("embed_tokens", "lm_head") for m in tm)  # (a regex: let PEFT decide)
    state = get_peft_model_state_dict(student, save_embedding_layers="auto" if embeddings else False)
    write_bytes(out / "adapter_model.safetensors", save(to_cpu(state), metadata={"format": "pt"}))
    pc.save_pretrained(out)
    # PEFT keeps target_modules as a set: its JSON order follows string hashing, which changes per
    # process. Sorted, the file is byte-reproducible.
    cfg_file = out / "adapter_config.json"
    acfg = json.loads(cfg_file.read_text())
    if isinstance(acfg.get("target_modules"), list):
        acfg["target_modules"] = sorted(acfg["target_modules"])
    acfg["inference_mode"] = True  # what PEFT's own save_pretrained records for a saved adapter
    cfg_file.write_text(json.dumps(acfg, indent=2, sort_keys=True) + "\n")


def merged(teacher, adapter_dir: Path, lcfg: LoraCfg):
    """The frozen teacher with a published adapter merged in (a plain model again)."""
    model = models.add_lora(teacher, lcfg, 0)  # init values are overwritten by the load
    models.load_lora(model, adapter_dir)
    out = model.merge_and_unload()
    out.eval()
    out.requires_grad_(False)
    return out
