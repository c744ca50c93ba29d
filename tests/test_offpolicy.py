"""The off-policy control (rollout.sampler=teacher objective.name=nll; docs/architecture.md "Off-policy
control"): SFT on teacher samples with the OPD run's optimizer, LoRA and update count, through the
real `opd run`. The published rollouts are what the teacher samples (tokens bit for bit, log-probs
within the derived fp32 bound of the teacher-forced ones), a rollout's identity names the teacher
instead of the policy, the nll objective is -log_softmax at the sampled id (value and gradient
against float64), and the refusals are one line with exit code 2."""
from __future__ import annotations

import json
import math

import pyarrow.parquet as pq
import pytest
import torch
from torch.func import grad_and_value

import numerics
from engine_models import engine_hidden, tempered_logprob
from stages import objectives
from stages.engine import lmhead, sampler
from stages.engine.sampling import Sampling
from stages.run import config, identity
from stages.run.config import ROOT, ObjectiveCfg
from stages.run.store import seed_of
from support import TINY, opd, seeds, session

OFF = ["rollout.sampler=teacher", "objective.name=nll"]  # TINY's 3 updates


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    work = tmp_path_factory.mktemp("offpolicy")
    (work / "conf").symlink_to(ROOT / "conf")
    opd("run", *TINY, *OFF, cwd=work)
    return work


def test_a_three_update_run_completes_with_finite_loss_and_held_out_numbers(ran):
    run = ran / "artifacts" / "runs" / "default"
    hist = (run / "history.csv").read_text().splitlines()
    cols = hist[0].split(",")
    losses = [float(r.split(",")[cols.index("loss")]) for r in hist[1:]]
    assert len(losses) == 3 and all(math.isfinite(x) and x > 0 for x in losses), losses
    ev = json.loads((run / "eval.json").read_text())
    for who in ("initial", "final"):
        for view in ("on_teacher_text", "on_own_text"):
            m = ev[who][view]
            assert math.isfinite(m["kl"]) and 0 <= m["top1_agreement"] <= 1 and m["tokens"] > 0, (who, view, m)
    for k in (1, 2, 3):
        st = json.loads((run / f"step-{k:04d}" / "state.json").read_text())
        assert st["rollout"]["sampler"] == "teacher" and "nll" in st["policy"]


def test_rollouts_are_the_teacher_s_samples_and_their_logprobs_the_teacher_s(ran, monkeypatch):
    monkeypatch.chdir(ran)
    sess = session(ran, *OFF)
    cfg, tok, teacher = sess.cfg, sess.models.tokenizer(), sess.models.teacher()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    T = config.logit_temperature(cfg.rollout)
    eng = sampler.make(teacher, use_graphs=False)
    assert eng is not None
    import transformers.masking_utils as mu  # tracing: transformers' mask builder must not branch on data

    monkeypatch.setattr(mu, "_ignore_causal_mask_sdpa", lambda *a, **k: False)
    prompts, resp, rec = [], [], []
    for k in (1, 2):
        dig = sess.chain.rollout(k)
        f = ran / "artifacts" / "runs" / "default" / f"step-{k:04d}" / "rollout.parquet"
        meta = pq.read_metadata(f).metadata
        assert meta[b"opd.digest"].decode() == dig and meta[b"opd.sampler"] == b"teacher"
        rows = pq.read_table(f).to_pylist()
        pk = [r["prompt_ids"] for r in rows]
        # what the teacher samples for these prompts under the stage's seed rule: the same tokens, bit for bit
        out = eng.generate(pk, cfg.rollout.max_new_tokens, eos=tok.eos_token_id, pad=pad, seed=seed_of(dig),
                           sampling=Sampling.of(cfg.rollout))
        rk = [out.tokens[b, :int(out.lengths[b])].tolist() for b in range(len(rows))]
        assert [r["response_ids"] for r in rows] == rk
        lp_k = torch.tensor([x for r in rows for x in r["sample_logprobs"]], dtype=torch.float32)
        assert torch.equal(lp_k, torch.cat([out.logprobs[b, :len(r)] for b, r in enumerate(rk)]))
        prompts, resp, rec = prompts + pk, resp + rk, rec + [lp_k]
    rec = torch.cat(rec)
    # ...and the teacher's teacher-forced log-probs of them (both steps in one batch), each side within its
    # own fp32 bound of the exact value (as tests/engine/test_sampler.py derives them)
    p = lmhead.pack(prompts, resp, [[1] * len(r) for r in resp], pad, "cpu")
    with torch.no_grad():
        lp, *_ = lmhead.score_positions(lmhead.hidden(teacher, p), lmhead.head_weight(teacher), p.targets, 64, 0,
                                        temperature=T, want_topk=False)
    head = tempered_logprob(lmhead.head_weight(teacher), p.targets, T)
    ref_tf, b_tf = numerics.fp32_bound_through(lambda: lmhead.hidden(teacher, p), head)
    ref_en, b_en = numerics.fp32_bound_through(lambda: engine_hidden(teacher, prompts, resp, pad), head)
    numerics.check(lp, ref_tf, b_tf, "teacher-forced")
    numerics.check(rec, ref_en, b_en, "recorded sample_logprobs")
    numerics.check(ref_en, ref_tf, (b_tf + b_en) * numerics.U64 / numerics.U32, "exact values")


PREP = {"student": "5" * 32, "teacher": "7" * 32, "prompts": "a" * 32}
RUNTIME = {"device": "cpu", "dtype": "float32", "threads": 1}


def chain(*extra: str, prep: dict = PREP) -> identity.Chain:
    return identity.Chain(config.compose([*TINY, *extra], ROOT / "conf"), lambda: dict(RUNTIME), prep)


def test_a_teacher_sampled_rollout_names_the_teacher_not_the_policy():
    off, other_lr = chain(*OFF), chain(*OFF, "optim.lr=0.01")
    assert off.update(1) != other_lr.update(1)  # policy 1 differs...
    assert off.rollout(2) == other_lr.rollout(2)  # ...and rollout(2) does not read it
    assert off.update(2) != other_lr.update(2)
    assert off.rollout(2) != chain(*OFF, prep={**PREP, "teacher": "8" * 32}).rollout(2)  # another teacher
    assert off.rollout(2) != chain(*OFF, "rollout.temperature=0.5").rollout(2)
    on, on_lr = chain("objective.name=nll"), chain("objective.name=nll", "optim.lr=0.01")
    assert on.rollout(2) != on_lr.rollout(2) and on.rollout(2) != off.rollout(2)  # the student's: policy 1's
    assert on.rollout(1) == chain().rollout(1)  # the default sampler is in no slice: digests as before


@pytest.mark.parametrize("seed", seeds(1))
def test_nll_per_token_is_minus_log_softmax_at_the_sampled_id_value_and_gradient(seed):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(6, 13, generator=g, dtype=torch.float64) * 3).float()
    ids = torch.randint(0, 13, (6,), generator=g)
    cfg = ObjectiveCfg(name="nll")
    objectives.check(cfg)
    assert objectives.needs(cfg) == set()

    def f(logits):
        def loss_of(lg):
            loss, _ = objectives.get("nll").per_token(objectives.Chunk(lg, ids, torch.zeros(6)), cfg)
            return loss.sum(), loss
        gr, (_, loss) = grad_and_value(loss_of, has_aux=True)(logits)
        return loss, gr

    loss, gr = f(z)
    _, (b_loss, b_grad) = numerics.fp32_bound(f, z)
    zd = z.double()  # the exact values, float64, by their definitions
    numerics.check(loss, -torch.log_softmax(zd, -1)[torch.arange(6), ids], b_loss, "nll")
    numerics.check(gr, torch.softmax(zd, -1) - torch.nn.functional.one_hot(ids, 13).double(), b_grad, "d nll / dz")


@pytest.mark.parametrize("extra,key", [
    (["rollout.sampler=teacher", "objective.name=k1", "objective.use_policy_gradient=true"], "rollout.sampler"),
    (["objective.name=nll", "objective.use_policy_gradient=true"], "objective.use_policy_gradient"),
    ([*OFF, "env.name=calculator"], "env.name"),
])
def test_refusals_are_one_line_with_exit_code_2(tmp_path, extra, key):
    (tmp_path / "conf").symlink_to(ROOT / "conf")
    r = opd("run", *TINY, *extra, cwd=tmp_path, check=False)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error")]
    assert r.returncode == 2 and len(errors) == 1 and f"'{key}'" in errors[0], r.stderr
    assert not any((tmp_path / "artifacts").rglob("manifest.json"))  # refused before anything is published
