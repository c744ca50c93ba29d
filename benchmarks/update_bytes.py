"""Bytes the update's eager backbone moves, op by op, and what fusing its pieces would save: a model,
not a timing (no GPU needed: the student runs on meta tensors, nothing is computed).

    python benchmarks/update_bytes.py --workload b [--phase update|score] [--bandwidth-gbs 2990.9] [--out DIR]

The student of the workload (conf/arch shapes, bf16, LoRA r16 on 7 projections in fp32, as
`lora.add` makes it; activation checkpointing as the workload's default run has it) runs one
training forward and its backward in the padded layout under a dispatch mode that adds up, per
ATen op, the bytes of its tensor inputs and outputs (views and allocations move none). That is
each eager kernel's memory traffic: the elementwise kernels (and PEFT's skinny fp32 LoRA matmuls)
are bound by it, so bytes over the device's copy bandwidth is their time; the base matmuls are
bound by their FLOPs instead (benchmarks/roofline.py). Attention is counted as one fused kernel would move it
(CUDA runs cuDNN's or the efficient SDPA; on meta tensors torch would decompose it into the math
path, whose [B, heads, T, T] tensors no GPU run makes).

Variants replace one piece with a stand-in that moves what a fused kernel would (RMSNorm: x and
the weight in, y and one fp32 per row out; its backward x, the weight, dy and the row's fp32 in,
dx out. The LoRA tail, PEFT's fp32 `result + B(A(x.float())) * s` cast back: x and the two factors
in, the result out, the base output read once; its backward the same the other way), so
the difference to the full count is what fusing that piece would save. The base matmuls stay.
"lora kernels" runs stages/weights/lora_kernels.py's ops themselves (runtime.lora_kernels), each counted
with its inputs and outputs (its backward's four kernels read g twice) and as many launches as it makes
(`lora_kernels.launches`: its sums of chunked partial sums too, whose few MB of partials are not counted).
"ops" counts the ATen ops, about the kernels an eager step launches.
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

MOVES_NOTHING = {"view", "_unsafe_view", "detach", "expand", "transpose", "t", "slice", "select", "unsqueeze",
                 "squeeze", "permute", "as_strided", "alias", "split", "split_with_sizes", "unbind",
                 "_reshape_alias", "empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided"}


def _bytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in MOVES_NOTHING:
            if name == "_to_copy":
                i, o = tree_leaves(args)[0], tree_leaves(out)[0]
                name = f"_to_copy {i.dtype} -> {o.dtype}".replace("torch.", "")
            self.ops[name] += _bytes(tree_leaves((args, kwargs))) + _bytes(tree_leaves(out))
            self.calls[name] += 1
            if name.startswith("lora_"):  # (stages/weights/lora_kernels.py's ops: their launches)
                self.calls[name] += _lora_launches(name, args) - 1
            if name == "lora_grads":  # (two of its kernels read g)
                self.ops[name] += _bytes([args[0]])
        return out


def _lora_launches(name: str, args) -> int:
    from stages.weights import lora_kernels

    if name == "lora_grads":  # (g [N, O], x [N, K], ...)
        (N, O), K = args[0].shape, args[1].shape[1]
    else:  # lora_down (x [N, K], a) or lora_tail (result [N, O], ...): one projection's input or output
        (N, K), O = args[0].shape, args[0].shape[1]
    return lora_kernels.launches(N, K, O)[name]


def _fused(label, like, fwd_in, fwd_out, bwd_in, bwd_out):
    """An autograd op that moves the given bytes (one fused kernel forward, one backward), counted
    under `label`; its output is shaped like `like`, its input grads like its inputs."""

    class Fused(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *xs):
            ctx.shapes = [(x.shape, x.dtype) for x in xs]
            COUNT.ops[label] += fwd_in + fwd_out
            COUNT.calls[label] += 1
            return torch.empty_like(like)

        @staticmethod
        def backward(ctx, g):
            COUNT.ops[label + " backward"] += bwd_in + bwd_out
            COUNT.calls[label + " backward"] += 1
            return tuple(torch.empty(s, dtype=d, device="meta") for s, d in ctx.shapes)

    return Fused


COUNT: _Count  # the current count (`count`), which the stand-ins add to


def _sdpa_stand_in(q, k, v, attn_mask=None, **_):
    """Fused attention's traffic: q, k, v, the mask in, out and an fp32 logsumexp per row out; backward
    q, k, v, out, d_out, the mask and the logsumexp in, dq, dk, dv out. The output keeps q's layout, as
    CUDA's fused kernels return it (transformers' transpose back then copies nothing)."""
    B, H, T, _ = q.shape
    lse = B * H * T * 4
    qkv, out, mask = _bytes([q, k, v]), q.numel() * q.element_size(), _bytes([attn_mask])
    return _fused("attention (fused)", q, qkv + mask, out + lse, qkv + 2 * out + mask + lse, qkv).apply(q, k, v)


def _rmsnorm_stand_in(mod):
    def forward(x):
        rows, w = x.numel() // x.shape[-1], _bytes([mod.weight])
        xb = x.numel() * x.element_size()
        return _fused("rmsnorm (fused)", x, xb + w, xb + rows * 4, 2 * xb + w + rows * 4, xb).apply(x)
    return forward


def _lora_stand_in(mod):
    """PEFT's lora.Linear forward as one fused tail after the base matmul."""
    def forward(x, *a, **k):
        base = mod.base_layer(x)
        name = mod.active_adapters[0]
        A, B = mod.lora_A[name].weight, mod.lora_B[name].weight
        xb, ob = x.numel() * x.element_size(), base.numel() * base.element_size()
        r = x.numel() // x.shape[-1] * A.shape[0] * 4  # the [rows, r] fp32 intermediate
        ab = _bytes([A, B])
        f = _fused("lora tail (fused)", base, xb + ab + ob + r, ob + r, ob + xb + ab + r, xb + ab)
        return f.apply(x, base, A, B)  # (the factors as inputs: their grads are what trains)
    return forward


def count(arch: str, batch: int, length: int, ckpt: bool, fuse: set[str],
          train: bool = True) -> tuple[collections.Counter, collections.Counter]:
    """Per-op bytes and calls of one training forward + backward of `arch`'s LoRA'd backbone (train), or
    of its no-grad forward without adapters (the teacher's scoring forward)."""
    global COUNT
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora.layer import Linear as LoraLinear
    from transformers import AutoConfig, AutoModelForCausalLM

    from stages.engine import graphs
    from stages.run.config import LoraCfg
    from stages.weights import lora_kernels, models

    spec = {k: v for k, v in models.arch_config(arch).items() if k != "_comment"}
    cfg = AutoConfig.for_model(**spec)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    m.requires_grad_(False)
    if not train:
        m.eval()
    lc = LoraCfg()  # what `lora.add` builds: fp32 adapters on the bf16 base
    p = get_peft_model(m, LoraConfig(r=lc.r, lora_alpha=lc.alpha, lora_dropout=0.0, bias="none",
                                     target_modules=list(lc.target_modules), task_type="CAUSAL_LM")) if train else m
    for n, q in p.named_parameters():
        if "lora_" in n:
            q.data = torch.empty(q.shape, dtype=torch.float32, device="meta")
    if ckpt:
        models.enable_activation_checkpointing(models.base_of(p), preserve_rng_state=False)
    p.train(train)
    for mod in p.modules():
        if "rmsnorm" in fuse and type(mod).__name__.endswith("RMSNorm"):
            mod.forward = _rmsnorm_stand_in(mod)
        if "lora" in fuse and hasattr(mod, "lora_A") and hasattr(mod, "base_layer"):
            mod.forward = _lora_stand_in(mod)
        if "kernels" in fuse and type(mod) is LoraLinear and lora_kernels.fits(mod):
            mod.forward = functools.partial(lora_kernels.forward, mod)  # (their ops' meta shapes)
    inner = models.base_of(p).model
    ids = torch.zeros(batch, length, dtype=torch.long, device="meta")
    _, mask = graphs.padded(ids, torch.ones(batch, length, dtype=torch.long, device="meta"), length)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = _sdpa_stand_in
    COUNT = _Count()
    try:
        with COUNT, torch.set_grad_enabled(train):
            h = inner(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            if train:
                h.backward(torch.empty_like(h))
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
    return COUNT.ops, COUNT.calls


def main(argv=None) -> int:
    from systems import B_DEFAULT, WORKLOAD_A, WORKLOAD_B

    from stages.engine import graphs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=("a", "b"), default="b")
    ap.add_argument("--phase", choices=("update", "score"), default="update",
                    help="score: the teacher's no-grad forward (no adapters, no backward)")
    ap.add_argument("--bandwidth-gbs", type=float, default=2990.9,
                    help="copy bandwidth to price bytes at (default: the H100's, measured in its systems run)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    w = WORKLOAD_B if args.workload == "b" else WORKLOAD_A
    train = args.phase == "update"
    ckpt = train and args.workload == "b" and "train.activation_checkpointing=true" in B_DEFAULT
    arch = w["student"] if train else w["teacher"]
    length = graphs.bucket(w["prompt_tokens"] + w["response"])  # the padded layout
    ms = lambda b: round(b / (args.bandwidth_gbs * 1e9) * 1e3, 1)  # noqa: E731
    res = {"workload": args.workload, "phase": args.phase, "model": arch, "batch": w["prompts"], "length": length,
           "activation_checkpointing": ckpt, "bandwidth_gbs": args.bandwidth_gbs, "variants": {}}
    variants = (("eager", set()), ("rmsnorm fused", {"rmsnorm"}), ("lora tail fused", {"lora"}),
                ("both fused", {"rmsnorm", "lora"}), ("lora kernels", {"kernels"}),
                ("rmsnorm fused + lora kernels", {"rmsnorm", "kernels"}))
    for name, fuse in variants if train else variants[:2]:
        ops, calls = count(arch, w["prompts"], length, ckpt, fuse, train)
        total = sum(ops.values())
        eager = res["variants"].get("eager", {}).get("total_gb", total / 1e9) * 1e9
        res["variants"][name] = {"total_gb": round(total / 1e9, 1), "saved_gb": round((eager - total) / 1e9, 1),
                                 "calls": sum(calls.values()),
                                 "saved_ms": ms(eager - total),
                                 "top": [{"op": k, "calls": calls[k], "gb": round(b / 1e9, 1), "ms": ms(b)}
                                         for k, b in ops.most_common(14)]}
    what = ("one training forward + backward of the LoRA'd backbone" if train else
            "the teacher's no-grad forward (no adapters)")
    lines = [f"# The {args.phase}'s eager traffic by op — workload {args.workload} ({arch}, {w['prompts']} x "
             f"{length} positions, checkpointing {'on' if ckpt else 'off'})", "",
             f"`python benchmarks/update_bytes.py --workload {args.workload} --phase {args.phase} --bandwidth-gbs "
             f"{args.bandwidth_gbs}`: bytes each ATen op reads and writes in {what} "
             f"(meta tensors; attention as one fused kernel), priced at {args.bandwidth_gbs} GB/s. A model of the "
             "memory traffic, not a timing.", "",
             "| variant | GB moved | GB less than eager | that at the bandwidth, ms | ops (kernels) |",
             "|---|---|---|---|---|"]
    for name, v in res["variants"].items():
        lines.append(f"| {name} | {v['total_gb']} | {v['saved_gb']} | {v['saved_ms']} | {v['calls']} |")
    lines += ["", "Eager, the ops that move the most:", "", "| op | calls | GB | ms |", "|---|---|---|---|"]
    lines += [f"| {t['op']} | {t['calls']} | {t['gb']} | {t['ms']} |" for t in res["variants"]["eager"]["top"]]
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"{args.phase}-bytes-{args.workload}"
        stem.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
        stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
