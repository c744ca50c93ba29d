"""update: chunked LM head + loss == unchunked (values and gradients), all-masked batch, optimizer
state round trip, and no [tokens, vocab] fp32 tensor beyond one chunk."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.func import grad_and_value

import numerics
from stages import objectives, update
from stages.weights import adapters, lora
from stages.run import config
from stages.engine import lmhead
from stages.run.config import LoraCfg
from support import seeds
from engine_models import tiny

PROMPTS = [[1, 500, 600, 700, 800], [1, 42], [1, 9000, 9001, 9002]]
RESP = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17, 18, 19, 20, 21]]


def fixture(chunk: int, masks=None, mode="token-mean", seed: int = 0):
    cfg = config.compose(["objective.topk=8", f"train.chunk={chunk}", f"objective.loss_agg_mode={mode}"])
    sess = SimpleNamespace(cfg=cfg, device=torch.device("cpu"))
    student = lora.add(tiny(seed=seed), LoraCfg(r=4, alpha=8), seed=3 + seed)
    with torch.no_grad():
        for n, p in student.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    teacher = tiny("tiny-llama-teacher", seed=1 + seed)
    masks = masks or [[1] * len(r) for r in RESP]
    p = lmhead.pack(PROMPTS, RESP, masks, 2, "cpu")
    with torch.no_grad():
        h = lmhead.hidden(teacher, p)
        lp, ids, tlp, _ = lmhead.score_positions(h, lmhead.head_weight(teacher), p.targets, 5, 8)
    sc = {"teacher_logprobs": lp.numpy(), "topk_ids": ids.numpy(), "topk_logprobs": tlp.numpy()}
    return sess, student, p, torch.zeros(p.targets.numel()), sc


def grads(student):
    return {n: q.grad.clone() for n, q in student.named_parameters() if q.requires_grad and q.grad is not None}


def run(chunk, **kw):
    sess, student, p, old, sc = fixture(chunk, **kw)
    stats = update.backward_sums(sess, student, p, old, sc).read()
    return stats, grads(student)


def head_and_loss(sess, student, p, old, sc, grad: bool = True):
    """The update's LM head + objective, unchunked, per position, as a function of the backbone's
    hidden states h [n, H] -> (d sum(loss)/dh [n, H], loss per position [n]) (grad=False: the
    losses only); the loss weights are left out (see the tests) so one bound serves every
    loss_agg_mode."""
    ob = objectives.get(sess.cfg.objective.name)
    head = lmhead.head_weight(student).detach()
    sc = {k: torch.as_tensor(v) for k, v in sc.items()}

    def per_position(h):
        logits = torch.nn.functional.linear(h, head).float() / sess.cfg.rollout.temperature  # [n, V]
        ch = objectives.Chunk(student_logits=logits, sampled_ids=p.targets, old_logprobs=old,
                              teacher_logprobs=sc["teacher_logprobs"], topk_ids=sc["topk_ids"],
                              topk_logprobs=sc["topk_logprobs"])
        per_tok, _ = ob.per_token(ch, sess.cfg.objective)
        per_tok = per_tok * torch.ones_like(per_tok)  # the weight multiplication, with weight 1 (see the test)
        return per_tok.sum(), per_tok

    def f(h):
        g, (_, per_tok) = grad_and_value(per_position, has_aux=True)(h)
        return g, per_tok

    return f if grad else (lambda h: per_position(h)[1])


@pytest.mark.parametrize("seed", seeds(1))
def test_chunked_equals_unchunked_values_and_gradients(seed, monkeypatch):
    """Chunking changes only the LM head + objective stage (which positions share a matmul, the
    order of fp32 sums); the backbone runs once forward and once backward either way. So:
      * the hidden states h are bit-identical for every chunk (the same call on the same inputs);
      * the loss and dloss/dh of every chunk are within the derived fp32 bound of the exact value
        (numerics.fp32_bound on the unchunked graph: it bounds every chunking, since each position's
        ops are the same and the bounds for sums hold in any order), element-wise;
      * the LoRA gradients are exactly the backbone's backward of that chunk's dloss/dh (bit for
        bit), so they depend on the chunk only through dloss/dh.
    (An element-wise rtol on the LoRA gradients themselves, tuned on one Intel CPU, failed on AMD
    EPYC: entries small after cancellation carry the absolute error of the terms summed.)"""
    seen = {}
    real_hidden = lmhead.hidden

    def hidden(model, pk):  # keep h and the gradient the chunk loop sends back into it
        h = real_hidden(model, pk)
        seen["h"] = h.detach().clone()
        if h.requires_grad:
            h.register_hook(lambda g: seen.__setitem__("g", g.clone()))
        return h

    monkeypatch.setattr(lmhead, "hidden", hidden)
    sess, student, p, old, sc = fixture(10_000, seed=seed)
    update.backward_sums(sess, student, p, old, sc)
    h0 = seen["h"]
    # per position i: loss_i and d loss_i / dh_i (exact, float64) and their fp32 error bounds b_i, G_i.
    # The update weights position i by w_i (agg_weights, fp32, the same bits in every run): the
    # weighted gradient is w_i times the one traced here, every term of its error too, so its bound
    # is |w_i| G_i; the loss adds the products w_i loss_i (one rounding each) and their sum (any
    # order, over chunks or not): |w_i| b_i + (gamma(n-1) + u) |w_i loss_i|.
    (ref_g1, ref_l), (bound_g1, bound_l) = numerics.fp32_bound(
        head_and_loss(sess, student, p, old, sc), h0, rows=h0.shape[0], batch=16)
    n = h0.shape[0]
    j = torch.arange(n) - torch.tensor(p.offsets)[p.rows]
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        sess = SimpleNamespace(cfg=config.compose(["objective.topk=8", f"objective.loss_agg_mode={mode}"]),
                               device=torch.device("cpu"))
        w = objectives.agg_weights(p.mask, mode)[p.rows, j].double()  # [n]
        ref_loss, ref_g = (w * ref_l).sum(), w[:, None] * ref_g1
        bound_loss = (w.abs() * bound_l).sum() + (numerics.gamma(n - 1) + numerics.U32) * (w * ref_l).abs().sum()
        bound_g = w.abs()[:, None] * bound_g1
        assert ref_loss > 0.01  # a real divergence between two different random models
        for chunk in (10_000, 1, 3, 7):
            student.zero_grad(set_to_none=True)
            got = update.backward_sums(sess, student, p, old, sc, chunk=chunk).read()
            g = grads(student)
            assert len(g) > 0 and torch.equal(seen["h"], h0), (mode, chunk)
            numerics.check(got["loss"], ref_loss, bound_loss, f"{mode} chunk {chunk}: loss")
            numerics.check(seen["g"], ref_g, bound_g, f"{mode} chunk {chunk}: dloss/dh")
            # the backbone's backward of exactly this dloss/dh gives exactly these LoRA gradients
            student.zero_grad(set_to_none=True)
            real_hidden(student, p).backward(seen["g"])
            again = grads(student)
            assert set(again) == set(g) and all(torch.equal(again[k], g[k]) for k in g), (mode, chunk)


@pytest.mark.parametrize("seed", seeds(1))
def test_loss_is_token_mean_over_response_tokens(seed):
    # masking out a whole sequence changes the normaliser: equals the loss of the remaining tokens
    masks = [[1] * len(RESP[0]), [0] * len(RESP[1]), [1] * len(RESP[2])]
    sess, student, p, old, sc = fixture(4, masks=masks, seed=seed)
    a = update.backward_sums(sess, student, p, old, sc).read()
    with torch.no_grad():
        h = lmhead.hidden(student, p)
    # exact per-position losses and their fp32 bounds b_i (numerics.fp32_bound, one backward pass);
    # the update's value is sum_i w_i loss_i with w_i = fp32(1 / n_kept) (relative error <= u) on the
    # kept positions and 0 elsewhere: |error| <= sum_kept b_i / n + (u + u + gamma(n-1)) sum_kept |loss_i| / n
    # (the weight's rounding, the product's, the sum's in any order)
    f = head_and_loss(sess, student, p, old, sc, grad=False)
    ref, bound = numerics.fp32_bound(f, h, rows=h.shape[0])
    keep = torch.tensor([m for ms in masks for m in ms], dtype=torch.bool)
    n = int(keep.sum())
    mean = ref[keep].mean()
    slack = bound[keep].sum() / n + (2 * numerics.U32 + numerics.gamma(h.shape[0] - 1)) * ref[keep].abs().sum() / n
    numerics.check(a["loss"], mean, slack, "masked-sequence loss vs exact mean over kept positions")


def test_all_masked_batch_gives_zero_loss_and_no_nan():
    masks = [[0] * len(r) for r in RESP]
    stats, g = run(4, masks=masks)
    assert stats["loss"] == 0.0
    assert all(torch.isfinite(v).all() and (v == 0).all() for v in g.values())


def test_optimizer_state_round_trips_exactly(tmp_path):
    sess, student, p, old, sc = fixture(4)
    opt, named = adapters.make_optimizer(sess.cfg.optim, student, None)
    update.backward_sums(sess, student, p, old, sc)
    opt.step()
    adapters.save_optimizer(opt, named, tmp_path / "opt.safetensors")
    opt2, named2 = adapters.make_optimizer(sess.cfg.optim, student, tmp_path / "opt.safetensors")
    for (_, a), (_, b) in zip(named, named2):
        sa, sb = opt.state[a], opt2.state[b]
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
        assert float(sa["step"]) == float(sb["step"]) == 1.0


def test_no_tokens_by_vocab_fp32_tensor_beyond_one_chunk():
    """Peak CPU allocation during the update stays below what one [tokens, vocab] fp32 logits tensor
    would take: measured with the torch profiler's allocator events."""
    from torch.profiler import ProfilerActivity, profile

    sess, student, p, old, sc = fixture(2)
    n, V = p.targets.numel(), lmhead.head_weight(student).shape[0]
    full = n * V * 4  # bytes of one [tokens, vocab] fp32 tensor
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        update.backward_sums(sess, student, p, old, sc)
    biggest = max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), default=0)
    assert biggest < full / 2, (biggest, full)
    assert biggest >= 2 * V * 4  # sanity: one chunk of logits did get allocated


def test_background_publish_writes_the_same_bytes_on_the_publish_thread(work, monkeypatch):
    """What CUDA does (adapter + AdamW moments snapshotted at the optimizer step, then written,
    sealed and renamed on the publish thread while the next step runs; the rollout and scores handed
    on in memory while theirs are), forced on the CPU: the same files as synchronous publishing, even
    when the writer is slower than the next step's compute."""
    import json
    import shutil
    import threading

    from stages import train
    from stages.run import store as store_mod
    from stages.session import Session
    from support import session

    import time

    from stages.rows import tables

    real_adapter, real_write = adapters.write_adapter, tables.write

    def run(tag: str, background: bool) -> dict:
        monkeypatch.setattr(Session, "background_publish", property(lambda s: background))
        threads: list[str] = []
        parquet: dict[str, set] = {}  # which threads wrote each step's rollout and scores

        def write(path, table, meta):
            if path.name in ("rollout.parquet", "scores.parquet"):
                parquet.setdefault(path.name, set()).add(threading.current_thread().name)
            real_write(path, table, meta)

        monkeypatch.setattr(tables, "write", write)
        # a slow writer (a slow disk): the next step's rollout, score and optimizer step run before it
        # writes, so bytes only match if it writes the snapshot of its own step, not the live tensors
        def slow_write(student, state, out, base):  # (policy 0's adapter, written by init, is not an update's)
            if out.parent.parent.name == "update":
                threads.append(threading.current_thread().name)
                time.sleep(1.5 if background else 0)
            real_adapter(student, state, out, base)

        monkeypatch.setattr(adapters, "write_adapter", slow_write)
        sess = session(work, "train.updates=3", "runtime.threads=1", f"run={tag}")
        train.run(sess)
        out = {}
        for k in (1, 2, 3):
            for d in (sess.policy_dir(k), sess.store.path("rollout", sess.chain.rollout(k)),
                      sess.store.path("score", sess.chain.score(k))):
                assert store_mod.Store(sess.store.root.parent).verify(d)
                out[k, d.parent.name] = {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*"))
                                         if p.is_file() and p.name not in ("state.json", "manifest.json")}
            st = json.loads((sess.policy_dir(k) / "state.json").read_text())
            assert {"save_adapter", "save_optimizer", "wait_previous_publish"} <= set(st["io_s"])
        for stage in ("rollout", "score", "update"):  # the second run computes every step again
            shutil.rmtree(sess.store.root / stage)
        return out, threads, parquet

    sync, t_sync, pq_sync = run("sync", False)
    bg, t_bg, pq_bg = run("bg", True)
    assert bg == sync and len(sync[3, "update"]) >= 3  # adapter weights + config + optimizer state, byte for byte
    assert set(sync[3, "rollout"]) == {"rollout.parquet"} and set(sync[3, "score"]) == {"scores.parquet"}
    assert t_sync == ["MainThread"] * 3
    assert len(t_bg) == 3 and all(t.startswith("opd-publish") for t in t_bg)
    assert pq_sync == {"rollout.parquet": {"MainThread"}, "scores.parquet": {"MainThread"}}
    assert {n: {t.split("_")[0] for t in ts} for n, ts in pq_bg.items()} == \
        {"rollout.parquet": {"opd-publish"}, "scores.parquet": {"opd-publish"}}


def test_on_cpu_an_update_drops_the_engine_and_the_next_one_holds_the_new_policy(work):
    """CPU: the update does not refresh the sampling weights in place; the next rollout builds them
    from the resident policy, the construction a resumed process uses (one path for both)."""
    from stages import train
    from stages.engine import decoder
    from support import session

    sess = session(work, "train.updates=1")
    train.run(sess)  # rollout(1) builds the engine at policy 0; update(1) trains policy 1 in place
    assert sess.models._engine is None
    student = sess.models.student()
    qkv = sess.models.engine().W["layers"][0]["qkv"]
    assert torch.equal(qkv, decoder.sampling_weights(student)["layers"][0]["qkv"])
    with student.disable_adapter():
        base = decoder.sampling_weights(student)["layers"][0]["qkv"]
    assert not torch.equal(qkv, base)  # policy 1's LoRA delta is merged in (B moved off zero)


@pytest.mark.parametrize("fused", [False, True])  # True: CUDA's AdamW (fused runs on the CPU too)
def test_guarded_step_takes_the_step_only_on_finite_values(fused):
    """guarded_step: with finite sums and norm it is AdamW's own step (same bytes as calling step);
    a non-finite loss or gradient norm stops with a one-line error and leaves the LoRA and the
    optimizer's moments and step count as they were (the fused step is queued, the device skips it)."""
    from stages.errors import UserError

    def make():
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(4, 3))
        w.grad = torch.randn(4, 3)
        return w, torch.optim.AdamW([w], lr=0.1, foreach=not fused, fused=fused)

    w, opt = make()
    sums = update.Sums(torch.tensor([2.0, 4.0, 1.0]), ["kl"])
    stats, gn = update.guarded_step(opt, sums, torch.tensor(0.5), 1)
    ref, ropt = make()
    ropt.step()
    assert stats == {"loss": 2.0, "kl": 0.25} and gn == 0.5 and torch.equal(w, ref)
    for bad_loss, bad_norm, what in ((float("nan"), 0.5, "loss is nan"), (2.0, float("inf"), "gradient norm is inf")):
        before = (w.detach().clone(), opt.state[w]["exp_avg"].clone(), float(opt.state[w]["step"]))
        w.grad = torch.randn(4, 3)
        with pytest.raises(UserError, match=f"update step 2: {what}"):
            update.guarded_step(opt, update.Sums(torch.tensor([bad_loss, 4.0]), []), torch.tensor(bad_norm), 2)
        assert torch.equal(w, before[0]) and torch.equal(opt.state[w]["exp_avg"], before[1])
        assert float(opt.state[w]["step"]) == before[2]
