"""Host reads of tensor values inside the rollout / score / update phases (each a host-device sync on
CUDA), counted on CPU where they are visible too.

    python benchmarks/sync_count.py [--device cpu|cuda] [--json FILE]

A tiny run (random tiny Llamas, SmolLM2 tokenizer) warms up on step 1; step 2's three stages then run
under torch.profiler (aten::item / aten::_local_scalar_dense, i.e. `.item()`, `float(t)`, `bool(t)`)
while Python-level counters record `Tensor.tolist`, `.cpu()`, `.numpy()`, `.item()` and the
`bool`/`float`/`int` conversions of tensors. Each count is split into "in phase" (inside the timed
`session.phase` block, where a sync stalls the device queue) and "stage" (the stage's whole run:
reading inputs and writing Parquet/adapters need host values and may sync once at their start).
AdamW's per-parameter step counters live on the host (foreach, not capturable): their `.item()`
calls are counted under aten::item but are no device sync; `host_step_items` reports them apart.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

READS = ("tolist", "cpu", "numpy", "item", "__bool__", "__float__", "__int__")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from stages import rollout, score, train, update
    from stages import session as session_mod
    from stages.run import config
    from support import TINY

    work = Path(tempfile.mkdtemp(prefix="opd-sync-"))
    over = [*TINY, f"runtime.device={args.device}", "runtime.threads=1", "rollout.max_new_tokens=16",
            "train.updates=2", f"artifacts={work / 'artifacts'}"]
    sess = train.session(config.compose(over))
    train.ensure_policy(sess, 1)  # warm: models resident, engine built (graphs captured on CUDA)

    where = {"in": False}
    counts: dict[str, Counter] = {}
    current = {"stage": None}

    def counted(name, fn):
        def wrapper(self, *a, **kw):
            st = current["stage"]
            if st:
                counts[st][f"{'phase' if where['in'] else 'stage'}:{name}"] += 1
            return fn(self, *a, **kw)
        return wrapper

    originals = {n: getattr(torch.Tensor, n) for n in READS}
    orig_phase = session_mod.phase

    @contextlib.contextmanager
    def marked_phase(*a, **kw):
        with orig_phase(*a, **kw) as box:
            where["in"] = True
            try:
                yield box
            finally:
                where["in"] = False

    mods = (rollout, score, update)
    saved = [m.phase for m in mods]
    for n, fn in originals.items():
        setattr(torch.Tensor, n, counted(n, fn))
    for m in mods:
        m.phase = marked_phase
    k = 2
    result = {"device": args.device, "step": k, "stages": {}}
    try:
        for name, fn in (("rollout", rollout.run), ("score", score.run), ("update", update.run)):
            counts[name] = Counter()
            current["stage"] = name
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
            with profile(activities=acts) as prof:
                fn(sess, k)
                sess.store.flush()
            current["stage"] = None
            ev = Counter()
            for e in prof.events():
                if e.name in ("aten::item", "aten::_local_scalar_dense", "cudaStreamSynchronize",
                              "cudaDeviceSynchronize", "aten::_foreach_add_"):
                    ev[e.name] += 1
            result["stages"][name] = {"profiler": dict(ev), "python": dict(sorted(counts[name].items()))}
    finally:
        for n, fn in originals.items():
            setattr(torch.Tensor, n, fn)
        for m, p in zip(mods, saved):
            m.phase = p
    n_params = len(sess.models.optimizer[2]) if sess.models.optimizer else 0
    result["trainable_tensors"] = n_params
    print(f"{'stage':8} {'aten::item':>10}  python reads (phase: inside the timed block; stage: the rest)")
    for name, r in result["stages"].items():
        print(f"{name:8} {r['profiler'].get('aten::item', 0):>10}  {r['python']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
