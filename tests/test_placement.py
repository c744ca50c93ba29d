"""Placements and the OOM retry: shared backbone scores exactly as a separate teacher copy (and the
whole run publishes the same bytes), swap bookkeeping, refusals before any weights load, and CUDA
OOM in score/update halving the position chunk (fake OOM injected on CPU; a real one on GPU)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from support import TINY, opd, session
from safetensors.torch import load_file

import numerics
from stages import rollout, score, train, update
from stages.engine import batch, lmhead, sampler
from stages.engine.sampling import Sampling
from stages.memory import placement
from stages.weights import models
from stages.weights.state import state
from stages.rows import tables
from stages.errors import UserError
from stages.memory.resident import Resident
from engine_models import tempered_logprob

# teacher = the student's own base (same name/init/keep_layers): what shared_backbone needs
SAME = ["teacher.name=arch:tiny-llama", "teacher.init=random"]


def perturb_lora(student, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in student.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def test_shared_backbone_teacher_equals_a_separate_copy(work, monkeypatch):
    sess = session(work, *SAME, "memory.placement=shared_backbone")
    assert sess.prepared["student"] == sess.prepared["teacher"]
    student = sess.models.student()
    perturb_lora(student)  # a trained-looking adapter: the shared teacher must not see it
    shared = sess.models.teacher()
    assert isinstance(shared, placement.SharedTeacher) and shared.peft is student
    copy = models.load(sess.models.model_dir("teacher"), sess.cfg.teacher, sess.device, sess.dtype)
    assert sum(p.numel() for p in copy.parameters()) > 0  # the reference: a second copy of the weights
    p = lmhead.pack([[1, 500, 600, 700], [1, 42]], [[5, 6, 7, 8, 9], [11, 12, 13]], [[1] * 5, [1] * 3], 2, "cpu")
    with torch.no_grad():
        a = lmhead.score_positions(lmhead.hidden(shared, p), lmhead.head_weight(shared), p.targets, 3, 8)
        b = lmhead.score_positions(lmhead.hidden(copy, p), lmhead.head_weight(copy), p.targets, 3, 8)
        s = lmhead.score_positions(lmhead.hidden(student, p), lmhead.head_weight(student), p.targets, 3, 8)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    # the student (adapter on) differs by more than rounding can explain (the derived fp32 bounds of
    # both log-prob computations): the shared teacher really ran with the adapter disabled
    import transformers.masking_utils as mu

    monkeypatch.setattr(mu, "_ignore_causal_mask_sdpa", lambda *a, **k: False)  # traceable: the batch is padded
    head = tempered_logprob(lmhead.head_weight(copy), p.targets, 1.0)
    _, b_t = numerics.fp32_bound_through(lambda: lmhead.hidden(copy, p), head)
    _, b_s = numerics.fp32_bound_through(lambda: lmhead.hidden(student, p), head)
    assert ((a[0] - s[0]).abs().double() > b_t + b_s).any(), ((a[0] - s[0]).abs().max(), (b_t + b_s).max())
    # the rollout engine on the shared teacher reads the base weights unmerged (no copy)...
    eng_shared, eng_copy = sampler.make(shared, False), sampler.make(copy, False)
    assert eng_shared.W["layers"][0]["o_proj"].data_ptr() == \
        student.get_base_model().model.layers[0].self_attn.o_proj.base_layer.weight.data_ptr()
    kw = dict(eos=2, pad=2, seed=0, sampling=Sampling(greedy=True))
    ga, gb = eng_shared.generate([[1, 5, 6]], 6, **kw), eng_copy.generate([[1, 5, 6]], 6, **kw)
    assert torch.equal(ga.tokens, gb.tokens) and torch.equal(ga.logprobs, gb.logprobs)
    # ...and the transformers fallback runs the base too
    ha, hb = sampler.hf_generate(shared, [[1, 5, 6]], 6, **kw), sampler.hf_generate(copy, [[1, 5, 6]], 6, **kw)
    assert torch.equal(ha.tokens, hb.tokens)
    # the student's adapter is enabled again afterwards
    with torch.no_grad():
        s2 = lmhead.score_positions(lmhead.hidden(student, p), lmhead.head_weight(student), p.targets, 3, 8)
    assert torch.equal(s[0], s2[0])


def _final_adapter(work: Path, *over) -> tuple[str, bytes, dict]:
    sess = session(work, *SAME, "train.updates=2", *over)
    out = train.run(sess)
    d = sess.store.path("update", out["final_policy"])
    return out["final_policy"], (d / "adapter" / "adapter_model.safetensors").read_bytes(), sess


def _fresh_run(work: Path, *over) -> tuple[str, bytes, bytes, dict]:
    """`_final_adapter` with the loop's stages computed anew (prepare's models and prompts kept), and the
    last step's rollout Parquet beside the adapter."""
    for stage in ("rollout", "score", "update"):
        shutil.rmtree(work / "artifacts" / "store" / stage, ignore_errors=True)
    dig, adapter, sess = _final_adapter(work, *over)
    return dig, adapter, (sess.store.path("rollout", sess.chain.rollout(2)) / "rollout.parquet").read_bytes(), sess


def _with_and_without_merge_in_place(work: Path, *over):
    """The same run with memory.merge_in_place false and true: the same adapter and rollout bytes.
    Returns the in-place run's session."""
    runs = {flag: _fresh_run(work, "memory.placement=resident", f"memory.merge_in_place={flag}", *over)
            for flag in ("false", "true")}
    for flag, (*_, sess) in runs.items():
        assert sess.models.engine().in_place == (flag == "true")
    assert runs["false"][:3] == runs["true"][:3]
    return runs["true"][3]


def test_shared_backbone_run_publishes_what_resident_does(work, tmp_path):
    dig_r, bytes_r, s_r = _final_adapter(work, "memory.placement=resident")
    assert s_r.models.placement == "resident" and not isinstance(s_r.models._teacher, placement.SharedTeacher)
    shutil.rmtree(work / "artifacts" / "store" / "update")
    shutil.rmtree(work / "artifacts" / "store" / "score")
    dig_s, bytes_s, s_s = _final_adapter(work, "memory.placement=auto")  # auto: same base -> shared
    assert s_s.models.placement == "shared_backbone" and isinstance(s_s.models._teacher, placement.SharedTeacher)
    assert dig_r == dig_s and bytes_r == bytes_s


def test_refusals_come_before_any_weights_load(work):
    sess = session(work, "memory.placement=shared_backbone")  # tiny-llama vs tiny-llama-teacher
    with pytest.raises(UserError, match="bases differ"):
        sess.models.student()
    assert sess.models._student is None and sess.models._teacher is None
    sess = session(work, "memory.placement=swap", "student.quant=nf4")
    with pytest.raises(UserError, match="use memory.placement=resident"):
        sess.models.teacher()
    assert sess.models._student is None and sess.models._teacher is None


def test_shared_teacher_refuses_different_materialised_models():
    fake = SimpleNamespace(prepared={"student": "a" * 32, "teacher": "b" * 32})
    with pytest.raises(UserError, match="shared_backbone: student model/aaaa"):
        placement.shared_teacher(fake)


def test_swap_moves_the_idle_role_and_drops_the_engine(monkeypatch):
    moves = []
    monkeypatch.setattr(placement, "move", lambda model, dev: moves.append((model, dev.type)))
    # an update still being written on the publish thread reads the student's tensors: joined first
    store = SimpleNamespace(flush=lambda: moves.append(("flush", None)))
    res = object.__new__(Resident)  # the swap bookkeeping alone: no config, no models
    res.__dict__.update(_placement="swap", device=torch.device("cuda"), _student="S", _teacher="T",
                        _engine="E", _on_host=set(), store=store, optimizer=None)
    res.activate("teacher")  # score: the student (and its engine) wait in host memory
    assert moves == [("flush", None), ("S", "cpu")] and res._on_host == {"student"} and res._engine is None
    moves.remove(("flush", None))
    res.activate("student")  # rollout/update: the teacher leaves, the student comes back
    assert moves[1:] == [("flush", None), ("T", "cpu"), ("S", "cuda")] and res._on_host == {"teacher"}
    moves.remove(("flush", None))
    res._on_device("teacher")  # an accessor (evaluate) brings it back, evicting nothing
    assert moves[3:] == [("T", "cuda")] and res._on_host == set()
    moves.clear()
    for where in ("resident", "shared_backbone"):
        Resident.activate(SimpleNamespace(placement=where, device=torch.device("cuda")), "teacher")
    Resident.activate(SimpleNamespace(placement="swap", device=torch.device("cpu")), "teacher")
    assert moves == []  # nothing moves elsewhere, nor on CPU (the device is host memory)


# ---- CUDA OOM: halve the position chunk, retry, record ----

def fake_oom(fn, above: int, calls: list):
    """Wrap fn(..., chunk) so that chunks larger than `above` raise CUDA OOM (after running, so a
    failed update attempt leaves partial gradients behind, as a real mid-backward OOM would)."""
    def wrapped(*a, **kw):
        chunk = kw["chunk"] if "chunk" in kw else a[3]
        calls.append(chunk)
        out = fn(*a, **kw)
        if chunk > above:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (fake)")
        return out
    return wrapped


def _step(sess, k=1):
    train.ensure_policy(sess, k - 1)
    rollout.run(sess, k)
    return score.run(sess, k), update.run(sess, k)


def _recording(fn, calls: list):
    """Wrap update.backward_sums: per call, whether every trainable parameter started without a
    gradient, and the backbone's hidden states h and dloss/dh (the only things the chunk changes)."""
    def wrapped(sess, student, p, *a, **kw):
        real_hidden, seen = lmhead.hidden, {}

        def hidden(model, pk):
            h = real_hidden(model, pk)
            seen["h"] = h.detach().clone()
            h.register_hook(lambda g: seen.__setitem__("g", g.clone()))
            return h

        seen["clean"] = all(q.grad is None for q in student.parameters() if q.requires_grad)
        lmhead.hidden = hidden
        try:
            return fn(sess, student, p, *a, **kw)
        finally:
            lmhead.hidden = real_hidden
            calls.append(seen)
    return wrapped


def test_oom_halves_the_chunk_records_retries_and_publishes_the_same(work, monkeypatch):
    ref = session(work, "train.chunk=32")
    sd_ref, ud_ref = _step(ref)
    ref_adapter = load_file(ud_ref / "adapter" / "adapter_model.safetensors")
    for stage in ("score", "update"):
        shutil.rmtree(work / "artifacts" / "store" / stage)
    calls_s, calls_u, seen = [], [], []
    real_score, real_update = lmhead.score_positions, update.backward_sums
    monkeypatch.setattr(lmhead, "score_positions", fake_oom(lmhead.score_positions, 8, calls_s))
    monkeypatch.setattr(update, "backward_sums", fake_oom(_recording(update.backward_sums, seen), 4, calls_u))
    sess = session(work, "train.chunk=32", "memory.chunk_floor=2")
    sd, ud = _step(sess)
    assert sd.name == sd_ref.name and ud.name == ud_ref.name  # the digest keeps the configured chunk
    assert calls_s == [32, 16, 8] and calls_u == [32, 16, 8, 4]
    st_s, st_u = (json.loads((d / "state.json").read_text()) for d in (sd, ud))
    assert (st_s["chunk"], st_s["oom_retries"], st_s["oom_chunks"]) == (8, 2, [32, 16])
    assert (st_u["chunk"], st_u["oom_retries"], st_u["oom_chunks"]) == (4, 3, [32, 16, 8])
    # published scores: those of the configured chunk up to rounding. Both score stages run the same
    # teacher forward on the same rollout and differ in how many positions share an LM-head matmul:
    # each is within the derived fp32 bound of the exact value (numerics.fp32_bound_through).
    a = tables.read(sd / "scores.parquet")
    b = tables.read(sd_ref / "scores.parquet")
    sel = np.concatenate(a.column("selected").to_pylist()).astype(bool)
    assert (sel == np.concatenate(b.column("selected").to_pylist()).astype(bool)).all() and sel.sum() > 0
    ro = tables.read(sess.store.path("rollout", sess.chain.rollout(1)) / "rollout.parquet")
    ps = batch.subset(batch.packed(ro, sess.device), torch.from_numpy(sel))
    teacher = sess.models.teacher()
    import transformers.masking_utils as mu

    monkeypatch.setattr(mu, "_ignore_causal_mask_sdpa", lambda *a, **k: False)  # traceable: the batch is padded
    head = tempered_logprob(lmhead.head_weight(teacher), ps.targets, sess.cfg.rollout.temperature)
    ref, bound = numerics.fp32_bound_through(lambda: lmhead.hidden(teacher, ps), head)
    for name, t in (("chunk 8 (after OOM)", a), ("chunk 32", b)):
        got = np.concatenate(t.column("teacher_logprobs").to_pylist())[sel]
        numerics.check(torch.from_numpy(got), ref, bound, f"teacher log-probs, {name}")
    # failed attempts' partial gradients were discarded, not accumulated: every attempt started with
    # no gradient, and the last one computed exactly (bit for bit) the h and dloss/dh of an update run
    # directly at the chunk that fit (the backbone's backward of that dloss/dh is the same call)
    assert len(seen) == 4 and all(c["clean"] for c in seen)
    for stage in ("score", "update"):
        shutil.rmtree(work / "artifacts" / "store" / stage)
    clean, direct = session(work, "train.chunk=32", "memory.chunk_floor=2"), []
    clean.chunk_sizes = {"score": 8, "update": 4}
    monkeypatch.setattr(lmhead, "score_positions", real_score)
    monkeypatch.setattr(update, "backward_sums", _recording(real_update, direct))
    sd_clean, ud_clean = _step(clean)
    assert ud_clean.name == ud.name and (sd_clean / "scores.parquet").read_bytes() == (sd / "scores.parquet").read_bytes()
    assert len(direct) == 1 and torch.equal(direct[0]["h"], seen[-1]["h"]) and torch.equal(direct[0]["g"], seen[-1]["g"])
    assert set(load_file(ud / "adapter" / "adapter_model.safetensors")) == set(ref_adapter)
    assert sess.chunk_sizes == {"score": 8, "update": 4}  # later steps start from the chunk that fit


def test_oom_past_the_floor_is_a_clear_error_and_publishes_nothing(work, monkeypatch):
    def always(*a, **kw):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB (fake)")

    sess = session(work, "train.chunk=16", "memory.chunk_floor=4")
    train.ensure_policy(sess, 0)
    rollout.run(sess, 1)
    monkeypatch.setattr(lmhead, "score_positions", always)
    with pytest.raises(UserError) as e:
        score.run(sess, 1)
    msg = str(e.value)
    assert "\n" not in msg and "score step 1: CUDA out of memory at position chunk 4" in msg
    assert "memory.chunk_floor = 4" in msg and "chunks 16, 8, 4" in msg and "memory.placement=swap" in msg
    assert not (work / "artifacts" / "store" / "score" / sess.chain.score(1)).exists()


def test_other_errors_are_not_retried(monkeypatch):
    sess = SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(chunk=8), memory=SimpleNamespace(chunk_floor=1)),
                           chunk_sizes={})
    calls = []

    def boom(chunk):
        calls.append(chunk)
        raise RuntimeError("not memory")

    with pytest.raises(RuntimeError, match="not memory"):
        placement.chunk_retry(sess, "score", 1, {}, boom)
    assert calls == [8]


def test_cli_refuses_bad_placement_before_loading(work):
    r = opd("stage", "train", *TINY, "memory.placement=swap", "teacher.quant=int8", cwd=work, check=False)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "memory.placement=resident" in r.stderr


# ---- GPU: the real thing ----

@pytest.mark.gpu
def test_gpu_swap_and_shared_publish_what_resident_does(work):
    outs = {p: _fresh_run(work, f"memory.placement={p}", "runtime.device=cuda")[:3] for p in ("resident", "swap")}
    assert outs["resident"] == outs["swap"]


@pytest.mark.gpu
def test_gpu_merge_in_place_publishes_what_resident_does(work, monkeypatch):
    # CUDA: the merge is a replayed graph and the copy back runs on a side stream, overlapping the
    # score; the update's forward waits for it on the device (decoder.base_ready); from the second
    # rollout on the merge is enqueued right after the previous update (sampler.Engine.premerge)
    premerged, premerge, found, generate = [], sampler.Engine.premerge, [], sampler.Engine.generate
    monkeypatch.setattr(sampler.Engine, "premerge", lambda self: premerged.append(premerge(self)) or premerged[-1])

    def generate_finds(self, *a, **kw):  # whether the weights were still merged ahead when the rollout began
        found.append(self.in_place and state(self.model).merged)
        return generate(self, *a, **kw)

    monkeypatch.setattr(sampler.Engine, "generate", generate_finds)
    base = models.base_of(_with_and_without_merge_in_place(work, "runtime.device=cuda").models.student())
    assert premerged == [False, True], premerged  # (the copy's engine merges nothing ahead; in place, step 2's)
    assert found == [False, False, False, True], found  # step 2's rollout sampled that merge (nothing undid it)
    torch.cuda.synchronize()  # the student's base is pristine after the last rollout's copy back
    assert torch.equal(state(base).flat.cpu(), state(base).pristine)


@pytest.mark.gpu
def test_gpu_oom_retry_under_a_tiny_budget(work):
    # vram_gib caps the caching allocator: a [256, 49152] fp32 chunk (48 MiB each) cannot fit 4 times.
    # The rollout is not under test and has no retry: eager decode (no graph capture, whose side stream
    # takes a second 32 MiB cuBLAS workspace that does not fit 0.12 GiB; seen on the H200), and eager
    # score/update forwards for the same reason (their capture's workspace; seen on the H200 too)
    r = opd("stage", "train", *TINY, "train.updates=1", "train.chunk=256", "rollout.batch_size=8",
            "rollout.cuda_graphs=false", "runtime.cuda_graphs=false",
            "rollout.max_new_tokens=32", "rollout.min_new_tokens=32", "memory.vram_gib=0.12",
            "memory.chunk_floor=8", cwd=work, check=False)
    assert r.returncode == 0, r.stderr
    st = json.loads((work / "artifacts/runs/default/step-0001/state.json").read_text())
    assert st["score"].get("oom_retries", 0) + st["policy"].get("oom_retries", 0) >= 1, st


# ---- memory.merge_in_place: the engine merges into the student's own weights ----

def test_fused_projections_compute_what_the_model_computed():
    from engine_models import tiny, with_trained_lora
    from stages.engine import decoder

    ref, fused = with_trained_lora(tiny()), tiny()
    decoder.fuse_projections(fused)
    fused = with_trained_lora(fused)  # the order Resident uses: fused at load, then the adapter
    base = models.base_of(fused)
    flat = state(base).flat
    a = base.model.layers[1].self_attn
    assert a.k_proj.base_layer.weight.data_ptr() == a.q_proj.base_layer.weight.data_ptr() + \
        a.q_proj.base_layer.weight.numel() * flat.element_size()  # q|k|v rows of one matrix
    assert state(base).fused[1][0].data_ptr() == a.q_proj.base_layer.weight.data_ptr()
    lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    for n, p in base.model.layers.named_parameters():
        if n.endswith("base_layer.weight"):
            assert lo <= p.data_ptr() < hi, n
    for (n, p), (m, q) in zip(ref.named_parameters(), fused.named_parameters()):
        assert n == m and torch.equal(p, q), n
    p = lmhead.pack([[1, 500, 600, 700], [1, 42]], [[5, 6, 7, 8, 9], [11, 12, 13]], [[1] * 5, [1] * 3], 2, "cpu")
    with torch.no_grad():
        assert torch.equal(lmhead.hidden(ref, p), lmhead.hidden(fused, p))


def test_in_place_engine_samples_what_the_copy_samples_and_restores_the_base():
    from engine_models import PROMPTS, tiny, with_trained_lora
    from stages.engine import decoder

    ref, fused = with_trained_lora(tiny()), tiny()
    decoder.fuse_projections(fused)
    fused = with_trained_lora(fused)
    base = models.base_of(fused)
    before = state(base).flat.clone()
    copy_eng, own = sampler.make(ref, False), sampler.make(fused, False)
    assert own.in_place and not copy_eng.in_place  # (from the model: fused or not)
    assert own.W["layers"][0]["gate_up"].data_ptr() == base.model.layers[0].mlp.gate_proj.base_layer.weight.data_ptr()
    kw = dict(eos=-1, pad=2, seed=3, sampling=Sampling(0.8))
    for _ in range(2):  # twice: the second merge starts from the restored base, not from merged weights
        a, b = copy_eng.generate(PROMPTS, 7, **kw), own.generate(PROMPTS, 7, **kw)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
        assert torch.equal(state(base).flat, before)  # the student's base is pristine again
    perturb_lora(ref, 5)
    perturb_lora(fused, 5)  # a new policy version: picked up by the next generate
    copy_eng.refresh()
    own.refresh()
    a, b = copy_eng.generate(PROMPTS, 7, **kw), own.generate(PROMPTS, 7, **kw)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    assert torch.equal(state(base).flat, before)


def test_a_merge_enqueued_ahead_is_undone_before_anything_else_reads_the_base():
    """sampler.Engine.premerge leaves the LoRA merged into the base until the next generate; a forward
    (decoder.base_ready) or a new adapter (Engine.refresh) reaching the weights first gets the pristine
    base back. (The CPU engine never merges ahead: it is rebuilt per policy, and premerge is a replay
    of the captured merge.)"""
    from engine_models import tiny, with_trained_lora
    from stages.engine import decoder

    fused = tiny()
    decoder.fuse_projections(fused)
    fused = with_trained_lora(fused)
    base = models.base_of(fused)
    flat, pristine = state(base).flat, state(base).pristine
    own = sampler.make(fused, False)
    assert own.premerge() is False and not state(base).merged
    for undo in (lambda: decoder.base_ready(fused), own.refresh):
        with torch.no_grad():
            own._merge(base)  # what premerge's replay computes
        state(base).merged = True
        assert not torch.equal(flat, pristine)
        undo()
        assert torch.equal(flat, pristine) and not state(base).merged


def test_merge_in_place_run_publishes_what_the_copy_does(work):
    sess = _with_and_without_merge_in_place(work)
    base = models.base_of(sess.models.student())  # CPU: restored in place after each generate
    assert torch.equal(state(base).flat, state(base).pristine)


def test_merge_in_place_refusals(work):
    with pytest.raises(UserError, match="merge_in_place"):
        session(work, "memory.merge_in_place=true", "student.quant=nf4")
    sess = session(work, "memory.merge_in_place=true", "memory.placement=swap")
    with pytest.raises(UserError, match="memory.placement=swap with memory.merge_in_place=true"):
        sess.models.student()
    assert sess.models._student is None
