"""Our objectives against verl 0.8.0's own code on random inputs: loss values and gradients with
respect to the student logits, for every verl loss mode we implement and every loss_agg_mode.

verl is driven the way its FSDP actor drives it: `distillation_ppo_loss` called once as the logits
processor (top-k modes) and once as the final loss, on a TensorDict in verl's no-padding layout.
Ours is driven the way the update stage drives it: per_token over chunks of response positions,
weighted by agg_weights. Skipped when verl is not installed (see REQUIREMENTS.txt).

Tolerances: both sides run in fp32 and are compared with the exact value (the float64 re-evaluation
of our traced computation) within the fp32 error bound of our ops (numerics.fp32_bound). verl's side
gets the same bound because it performs the same rounded operations (verl 0.8.0, read for this:
kl_penalty_forward and compute_policy_loss_vanilla are op for op ours; forward-KL top-k is the same
log_softmax / gather / clamp / exp / product / sum; agg_loss rounds each term at most as often as
agg_weights + the weighted sum do: a 0/1 mask product is exact, and it sums per sequence then over
sequences, gamma(T-1) + gamma(B-1) <= gamma(B*T-1)), and the bound holds for any summation order.
"""
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

# tests/ is on sys.path and holds a `verl` folder of our own tests, so `import verl` alone can
# succeed where verl is absent: ask for the modules these tests use
pytest.importorskip("tensordict")
pytest.importorskip("verl.trainer.distillation.losses")

from torch.func import grad_and_value  # noqa: E402
from tensordict import TensorDict  # noqa: E402  (verl's dependency)
from verl.trainer.distillation.losses import distillation_ppo_loss  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import ActorConfig, DistillationConfig, DistillationLossConfig  # noqa: E402

import numerics  # noqa: E402
from stages import objectives as O  # noqa: E402
from stages.run.config import ObjectiveCfg  # noqa: E402
from stages.objectives import estimators  # noqa: E402
from stages.objectives._common import ppo_per_token  # noqa: E402
from support import seeds  # noqa: E402

CLIP = dict(clip_ratio=0.2, clip_ratio_low=0.15, clip_ratio_high=0.28)  # asymmetric: exercises both sides
B, P, R, V, K = 4, 2, 6, 13, 4  # sequences, prompt length, response length, vocab, top-k
L = P + R


@dataclass
class Case:
    logits: torch.Tensor  # [B*L, V] student logits over every prompt+response token (verl's layout)
    nxt: torch.Tensor  # [B*L] the next token at each position (the sampled response token where it is one)
    ridx: torch.Tensor  # [B, R] flat index of the logits row that predicts response token (b, j)
    mask: torch.Tensor  # [B, R] response_mask
    responses: torch.Tensor  # [B, R]
    old_lp: torch.Tensor  # [B, R]
    teacher_lp: torch.Tensor  # [B*L] teacher log-prob of the next token
    topk_ids: torch.Tensor  # [B*L, K]
    topk_lp: torch.Tensor  # [B*L, K]
    adv: torch.Tensor  # [B, R] task advantages


def make_case(seed: int) -> Case:
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, R, generator=g) > 0.35).long()
    mask[1] = 0  # a sequence with no response token
    mask[2] = 1  # a full one
    responses = torch.randint(0, V, (B, R), generator=g)
    ridx = torch.arange(B)[:, None] * L + P - 1 + torch.arange(R)[None]  # verl shifts by one token
    nxt = torch.randint(0, V, (B * L,), generator=g)
    nxt[ridx.reshape(-1)] = responses.reshape(-1)
    logits = torch.randn(B * L, V, generator=g) * 2
    own = torch.log_softmax(logits, -1).gather(-1, nxt[:, None])[:, 0]
    old_lp = own[ridx] + 0.4 * torch.randn(B, R, generator=g)  # ratios inside and outside the band
    t_logp = torch.log_softmax(torch.randn(B * L, V, generator=g) * 2, -1)
    top = t_logp.topk(K, -1)
    return Case(logits, nxt, ridx, mask, responses, old_lp, t_logp.gather(-1, nxt[:, None])[:, 0],
                top.indices, top.values, torch.randn(B, R, generator=g))


def _nested(x: torch.Tensor) -> torch.Tensor:
    return torch.nested.nested_tensor_from_jagged(x, offsets=torch.arange(B + 1) * L)


def verl_loss(case: Case, loss_mode, agg, pg, clamp, lp_clamp=None, task=False, coef=1.0):
    leaf = case.logits.clone().requires_grad_(True)
    log_probs = torch.log_softmax(leaf, -1).gather(-1, case.nxt[:, None])[:, 0]  # [B*L]
    data = TensorDict({
        "prompts": torch.zeros(B, P, dtype=torch.long), "responses": case.responses,
        "attention_mask": torch.ones(B, L, dtype=torch.long), "response_mask": case.mask,
        "old_log_probs": case.old_lp, "advantages": case.adv,
    }, batch_size=[B])
    if loss_mode == "forward_kl_topk":
        data["teacher_logprobs"], data["teacher_ids"] = _nested(case.topk_lp), _nested(case.topk_ids)
    else:
        data["teacher_logprobs"] = _nested(case.teacher_lp[:, None])
    # dp 1 and no global batch info: agg_loss normalises over this batch
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=None, global_batch_size=None)
    actor = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, loss_agg_mode=agg, **CLIP)
    dcfg = DistillationConfig(distillation_loss=DistillationLossConfig(
        loss_mode=loss_mode, topk=K, use_task_rewards=task, distillation_loss_coef=coef, loss_max_clamp=clamp,
        log_prob_min_clamp=lp_clamp, use_policy_gradient=pg, **CLIP))
    model_output = {"log_probs": log_probs}
    if loss_mode == "forward_kl_topk":
        out = distillation_ppo_loss(actor, dcfg, data=data, student_logits=leaf.unsqueeze(0))  # logits processor
        model_output.update({k: v.squeeze(0) for k, v in out.items()})
    loss, _ = distillation_ppo_loss(actor, dcfg, model_output=model_output, data=data)
    loss.backward()
    return loss.detach(), leaf.grad, model_output


def our_total(case: Case, cfg: ObjectiveCfg, logits: torch.Tensor, chunk_size: int):
    """What the update computes from the student logits [B*L, V]: (weighted total, {diag: [positions]})."""
    w = O.agg_weights(case.mask, cfg.loss_agg_mode)  # [B, R]
    total, diags = torch.zeros(()), {}
    for pos in case.mask.nonzero().split(chunk_size):  # [n, 2] (b, j)
        b, j = pos[:, 0], pos[:, 1]
        flat = case.ridx[b, j]
        chunk = O.Chunk(student_logits=logits[flat], sampled_ids=case.responses[b, j], old_logprobs=case.old_lp[b, j],
                        teacher_logprobs=case.teacher_lp[flat], topk_ids=case.topk_ids[flat],
                        topk_logprobs=case.topk_lp[flat], advantages=case.adv[b, j])
        loss, diag = O.get(cfg.name).per_token(chunk, cfg)
        total = total + (w[b, j] * loss).sum()
        for k, v in diag.items():
            diags.setdefault(k, []).append(v.float())
    return total, {k: torch.cat(v) for k, v in diags.items()}


def our_loss(case: Case, cfg: ObjectiveCfg, chunk_size=3):
    """Ours in fp32 with the exact values and their fp32 bounds: {"value" | "grad" | diag name:
    (fp32, exact, bound)} and the flat logits row of each diagnostic position."""
    O.check(cfg)
    got = grad_and_value(lambda lg: our_total(case, cfg, lg, chunk_size), has_aux=True)(case.logits)
    # The bound, from the same computation unchunked over the n response positions (each position's
    # ops are the same in any chunk; the sums' bounds hold in any order) with the weights as an
    # input: agg_weights rounds each (1 to 3 divisions and verl's + 1e-8 in fp32: <= 3u). Positions
    # do not interact, so one backward per vocabulary column bounds all rows (rows=n).
    pos = case.mask.nonzero()
    b, j = pos[:, 0], pos[:, 1]
    flat = case.ridx[b, j]
    wpos = O.agg_weights(case.mask, cfg.loss_agg_mode)[b, j]  # [n]

    def f(sel, w):
        def total(x):
            chunk = O.Chunk(student_logits=x, sampled_ids=case.responses[b, j], old_logprobs=case.old_lp[b, j],
                            teacher_logprobs=case.teacher_lp[flat], topk_ids=case.topk_ids[flat],
                            topk_logprobs=case.topk_lp[flat], advantages=case.adv[b, j])
            loss, diag = O.get(cfg.name).per_token(chunk, cfg)
            return (w * loss).sum(), {k: v.float() for k, v in diag.items()}
        return grad_and_value(total, has_aux=True)(sel)

    ref, bound = numerics.fp32_bound(f, case.logits[flat], wpos, rows=len(flat), rounded_inputs=(0, 3))
    full = lambda x: torch.zeros_like(case.logits, dtype=x.dtype).index_put((flat,), x)  # noqa: E731
    out = {"grad": (got[0], full(ref[0]), full(bound[0])), "value": (got[1][0], ref[1][0], bound[1][0])}
    out.update({k: (got[1][1][k], ref[1][1][k], bound[1][1][k]) for k in got[1][1]})
    return out, flat


def _compare(ours, theirs):
    for i, key in enumerate(("value", "grad")):
        got, ref, bound = ours[key]
        numerics.check(got, ref, bound, f"ours: {key}")
        numerics.check(theirs[i], ref, bound, f"verl: {key}")
    # exactly the logits rows whose exact gradient is 0 (not a response position; every loss at the
    # clamp, as some seeds give) get an fp32 gradient of exactly 0 on both sides
    zero = ours["grad"][1].abs().sum(-1) == 0
    assert torch.equal(ours["grad"][0].abs().sum(-1) == 0, zero) and torch.equal(theirs[1].abs().sum(-1) == 0, zero)


AGG = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
CLAMPS = [None, 1.5]  # 1.5 cuts part of the per-token losses (medians here are ~1-2)


@pytest.mark.parametrize("seed", seeds(1))
@pytest.mark.parametrize("lp_clamp", [-18.420680743952367, -2.5])  # -2.5: the log-prob floor is active
@pytest.mark.parametrize("clamp", CLAMPS)
@pytest.mark.parametrize("pg", [False, True])
@pytest.mark.parametrize("agg", AGG)
def test_forward_kl_topk(agg, pg, clamp, lp_clamp, seed):
    case = make_case(seed)
    theirs = verl_loss(case, "forward_kl_topk", agg, pg, clamp, lp_clamp=lp_clamp)
    cfg = ObjectiveCfg(name="forward_kl_topk", topk=K, loss_agg_mode=agg, use_policy_gradient=pg,
                       loss_max_clamp=clamp, log_prob_min_clamp=lp_clamp, **CLIP)
    ours, flat = our_loss(case, cfg)
    _compare(ours, theirs)
    out = theirs[2]  # diagnostics: verl's teacher/student top-k mass and overlap count
    for key, theirs_key in (("teacher_topk_mass", "teacher_mass"), ("student_topk_mass", "student_mass")):
        got, ref, bound = ours[key]  # verl: the same exp + sum over the same k log-probs
        numerics.check(got, ref, bound, f"ours: {key}")
        numerics.check(out[theirs_key][flat].detach(), ref, bound, f"verl: {key}")
    # a count of ids over k = 4 (a power of two): exact on both sides
    assert torch.equal(ours["topk_overlap"][0], out["overlap_count"][flat].float() / K)


@pytest.mark.parametrize("clamp", CLAMPS)
@pytest.mark.parametrize("pg", [False, True])
@pytest.mark.parametrize("agg", AGG)
@pytest.mark.parametrize("name", estimators.NAMES)
@pytest.mark.parametrize("seed", seeds(1))
def test_estimators(name, agg, pg, clamp, seed):
    if name == "k1" and not pg:
        with pytest.raises(ValueError, match="k1"):  # verl refuses it too
            DistillationLossConfig(loss_mode="k1", use_policy_gradient=False)
        return
    case = make_case(2 + 10 * seed)
    theirs = verl_loss(case, name, agg, pg, clamp)
    ours, _ = our_loss(case, ObjectiveCfg(name=name, loss_agg_mode=agg, use_policy_gradient=pg,
                                          loss_max_clamp=clamp, **CLIP))
    _compare(ours, theirs)


@pytest.mark.parametrize("coef", [1.0, 0.4])
@pytest.mark.parametrize("clamp", CLAMPS)
@pytest.mark.parametrize("agg", AGG)
@pytest.mark.parametrize("seed", seeds(1))
def test_pg_k1_rewarded(agg, clamp, coef, seed):
    # verl: use_task_rewards=True, use_policy_gradient=True, loss_mode=k1 -> ppo(task) + coef * ppo(-k1)
    # (reward_coef 1: ours multiplies by 1.0, exact)
    case = make_case(3 + 10 * seed)
    theirs = verl_loss(case, "k1", agg, True, clamp, task=True, coef=coef)
    ours, _ = our_loss(case, ObjectiveCfg(name="pg_k1_rewarded", loss_agg_mode=agg, use_policy_gradient=True,
                                          loss_max_clamp=clamp, reward_coef=1.0, distill_coef=coef, **CLIP))
    _compare(ours, theirs)


# ---- the building blocks, directly ------------------------------------------------------------

@pytest.mark.parametrize("seed", seeds(1))
@pytest.mark.parametrize("agg", AGG)
def test_agg_weights_equal_agg_loss(agg, seed):
    g = torch.Generator().manual_seed(4 + 10 * seed)
    loss_mat = torch.randn(5, 7, generator=g)
    mask = (torch.rand(5, 7, generator=g) > 0.5).float()
    mask[3] = 0
    expected = core_algos.agg_loss(loss_mat, mask, agg)
    ours = lambda lm: (O.agg_weights(mask, agg) * lm).sum()  # noqa: E731
    ref, bound = numerics.fp32_bound(ours, loss_mat)
    numerics.check(ours(loss_mat), ref, bound, "ours")
    numerics.check(expected, ref, bound, "verl agg_loss")


@pytest.mark.parametrize("seed", seeds(1))
@pytest.mark.parametrize("name", estimators.NAMES)
def test_estimate_equals_kl_penalty(name, seed):
    g = torch.Generator().manual_seed(5 + 10 * seed)
    lp = torch.randn(64, generator=g) * 8 - 4  # wide: reaches k3's clamps
    ref_lp = torch.randn(64, generator=g) * 8 - 4
    f = grad_and_value(lambda x: (lambda e: (e.sum(), e))(estimators.estimate(x, ref_lp, name)), has_aux=True)
    g_ours, (_, ours) = f(lp)
    (ref_g, (_, ref)), (b_g, (_, b)) = numerics.fp32_bound(f, lp)
    x = lp.clone().requires_grad_(True)
    theirs = core_algos.kl_penalty(x, ref_lp, name)
    (g_theirs,) = torch.autograd.grad(theirs.sum(), x)
    for side, v, gv in (("ours", ours, g_ours), ("verl", theirs.detach(), g_theirs)):
        numerics.check(v, ref, b, f"{side}: estimate")
        numerics.check(gv, ref_g, b_g, f"{side}: gradient")


@pytest.mark.parametrize("seed", seeds(1))
@pytest.mark.parametrize("agg", AGG)
def test_ppo_equals_compute_policy_loss_vanilla(agg, seed):
    g = torch.Generator().manual_seed(6 + 10 * seed)
    lp = torch.randn(4, 9, generator=g) - 2
    old = lp + 0.5 * torch.randn(4, 9, generator=g)
    adv = torch.randn(4, 9, generator=g)
    mask = (torch.rand(4, 9, generator=g) > 0.3).float()
    actor = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, loss_agg_mode=agg, **CLIP)
    x = lp.clone().requires_grad_(True)
    theirs, _ = core_algos.compute_policy_loss_vanilla(old, x, adv, mask, loss_agg_mode=agg, config=actor)
    (g_theirs,) = torch.autograd.grad(theirs, x)
    f = grad_and_value(lambda y: (O.agg_weights(mask, agg) * ppo_per_token(y, old, adv, ObjectiveCfg(**CLIP))[0]).sum())
    g_ours, ours = f(lp)
    (ref_g, ref), (b_g, b) = numerics.fp32_bound(f, lp)
    for side, v, gv in (("ours", ours, g_ours), ("verl", theirs.detach(), g_theirs)):
        numerics.check(v, ref, b, f"{side}: loss")
        numerics.check(gv, ref_g, b_g, f"{side}: gradient")


def _advantage_bound(rewards: np.ndarray, groups: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """Exact advantages (float64) and an fp32 error bound that holds for ours (sum / count, two-pass
    std) and verl's (torch.mean / torch.std over each group; r c/(c-1) - mean c/(c-1) for RLOO).
    Per group of c rewards, first order, each op <= u relative:
      mean: |dm| <= 6c u max|r|  (a sum and a division, or a running mean: <= 3 roundings per element)
      x = r - mean: |dx| <= |dm| + u|x|
      std: relative <= gamma(4c) (squares, sums, division, sqrt; the mean's error enters only to
           second order since sum(x) = 0, and a running M2 adds non-negative terms)
      centered x; standardized y = x / (std + eps): |dx| / (std + eps) + |y| (gamma(4c) std + 3u (std + eps))
      / (std + eps) + u|y|; leave-one-out y = x c/(c-1): (|dm| + 2u(|r| + |m|)) c/(c-1) + 2u|y|."""
    u, exact, bound = numerics.U32, np.zeros(len(rewards)), np.zeros(len(rewards))
    for gid in np.unique(groups):
        i = groups == gid
        r, c = rewards[i], int(i.sum())
        if c == 1:  # no baseline: the reward itself (standardized: / (1 + eps), two roundings)
            exact[i] = r / (1 + 1e-6) if mode == "group_standardized" else r
            bound[i] = 3 * u * np.abs(exact[i])
            continue
        m = r.mean()
        dm = 6 * c * u * np.abs(r).max()
        x = r - m
        if mode == "group_centered":
            exact[i], bound[i] = x, dm + u * np.abs(x)
        elif mode == "leave_one_out":
            exact[i] = x * c / (c - 1)
            bound[i] = (dm + 2 * u * (np.abs(r) + abs(m))) * c / (c - 1) + 2 * u * np.abs(exact[i])
        else:
            sd = r.std(ddof=1)
            y = x / (sd + 1e-6)
            exact[i] = y
            bound[i] = (dm + u * np.abs(x)) / (sd + 1e-6) + np.abs(y) * (numerics.gamma(4 * c) * sd + 3 * u * (sd + 1e-6)) \
                / (sd + 1e-6) + u * np.abs(y)
    return exact, bound


@pytest.mark.parametrize("seed", seeds(1))
@pytest.mark.parametrize("mode", ["group_centered", "group_standardized", "leave_one_out"])
def test_reward_advantages_equal_verl_outcome_estimators(mode, seed):
    g = torch.Generator().manual_seed(7 + 10 * seed)
    groups = np.array([3, 3, 3, 9, 9, 1, 4, 4, 4, 4])  # sizes 3, 2, 1, 4
    rewards = torch.randint(0, 3, (10,), generator=g).float() + torch.rand(10, generator=g)
    token_rewards = torch.zeros(10, 5)
    token_rewards[:, -1] = rewards  # an outcome reward sits on the last response token
    if mode == "leave_one_out":
        theirs, _ = core_algos.compute_rloo_outcome_advantage(token_rewards, torch.ones(10, 5), groups)
    else:
        theirs, _ = core_algos.compute_grpo_outcome_advantage(
            token_rewards, torch.ones(10, 5), groups, norm_adv_by_std_in_grpo=mode == "group_standardized")
    ours = O.reward_advantages(rewards, torch.as_tensor(groups), mode)
    exact, bound = _advantage_bound(rewards.double().numpy(), groups, mode)
    numerics.check(ours, torch.from_numpy(exact), torch.from_numpy(bound), "ours")
    numerics.check(theirs[:, 0], torch.from_numpy(exact), torch.from_numpy(bound), "verl")
    assert not math.isnan(ours.sum().item())
