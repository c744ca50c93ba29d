"""Our objectives against verl 0.8.0's own code on random inputs: loss values and gradients with
respect to the student logits, for every verl loss mode we implement and every loss_agg_mode.

verl is driven the way its FSDP actor drives it: `distillation_ppo_loss` called once as the logits
processor (top-k modes) and once as the final loss, on a TensorDict in verl's no-padding layout.
Ours is driven the way the update stage drives it: per_token over chunks of response positions,
weighted by agg_weights. Skipped when verl is not installed (see REQUIREMENTS.txt).
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

from tensordict import TensorDict  # noqa: E402  (verl's dependency)
from verl.trainer.distillation.losses import distillation_ppo_loss  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import ActorConfig, DistillationConfig, DistillationLossConfig  # noqa: E402

from stages import objectives as O  # noqa: E402
from stages.config import ObjectiveCfg  # noqa: E402
from stages.objectives import estimators  # noqa: E402
from stages.objectives._common import ppo_per_token  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)
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


def our_loss(case: Case, cfg: ObjectiveCfg, chunk_size=3):
    O.check(cfg)
    leaf = case.logits.clone().requires_grad_(True)
    w = O.agg_weights(case.mask, cfg.loss_agg_mode)  # [B, R]
    total, diags = torch.zeros(()), []
    for pos in case.mask.nonzero().split(chunk_size):  # [n, 2] (b, j)
        b, j = pos[:, 0], pos[:, 1]
        flat = case.ridx[b, j]
        chunk = O.Chunk(student_logits=leaf[flat], sampled_ids=case.responses[b, j], old_logprobs=case.old_lp[b, j],
                        teacher_logprobs=case.teacher_lp[flat], topk_ids=case.topk_ids[flat],
                        topk_logprobs=case.topk_lp[flat], advantages=case.adv[b, j])
        loss, diag = O.get(cfg.name).per_token(chunk, cfg)
        total = total + (w[b, j] * loss).sum()
        diags.append((flat, diag))
    total.backward()
    return total.detach(), leaf.grad, diags


def _compare(ours, theirs):
    torch.testing.assert_close(ours[0], theirs[0], **TOL)
    torch.testing.assert_close(ours[1], theirs[1], **TOL)
    assert ours[1].abs().sum() > 0


AGG = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
CLAMPS = [None, 1.5]  # 1.5 cuts part of the per-token losses (medians here are ~1-2)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("clamp", CLAMPS)
@pytest.mark.parametrize("pg", [False, True])
@pytest.mark.parametrize("agg", AGG)
def test_forward_kl_topk(agg, pg, clamp, seed):
    case = make_case(seed)
    lp_clamp = -2.5 if seed else -18.420680743952367  # seed 1: the log-prob floor is active
    theirs = verl_loss(case, "forward_kl_topk", agg, pg, clamp, lp_clamp=lp_clamp)
    cfg = ObjectiveCfg(name="forward_kl_topk", topk=K, loss_agg_mode=agg, use_policy_gradient=pg,
                       loss_max_clamp=clamp, log_prob_min_clamp=lp_clamp, **CLIP)
    ours = our_loss(case, cfg)
    _compare(ours, theirs)
    out = theirs[2]  # diagnostics: verl's teacher/student top-k mass and overlap count
    for flat, diag in ours[2]:
        torch.testing.assert_close(diag["teacher_topk_mass"], out["teacher_mass"][flat], **TOL)
        torch.testing.assert_close(diag["student_topk_mass"], out["student_mass"][flat].detach(), **TOL)
        torch.testing.assert_close(diag["topk_overlap"], out["overlap_count"][flat].float() / K, **TOL)


@pytest.mark.parametrize("clamp", CLAMPS)
@pytest.mark.parametrize("pg", [False, True])
@pytest.mark.parametrize("agg", AGG)
@pytest.mark.parametrize("name", estimators.NAMES)
def test_estimators(name, agg, pg, clamp):
    if name == "k1" and not pg:
        with pytest.raises(ValueError, match="k1"):  # verl refuses it too
            DistillationLossConfig(loss_mode="k1", use_policy_gradient=False)
        return
    case = make_case(2)
    theirs = verl_loss(case, name, agg, pg, clamp)
    ours = our_loss(case, ObjectiveCfg(name=name, loss_agg_mode=agg, use_policy_gradient=pg, loss_max_clamp=clamp,
                                       **CLIP))
    _compare(ours, theirs)


@pytest.mark.parametrize("coef", [1.0, 0.4])
@pytest.mark.parametrize("clamp", CLAMPS)
@pytest.mark.parametrize("agg", AGG)
def test_pg_k1_rewarded(agg, clamp, coef):
    # verl: use_task_rewards=True, use_policy_gradient=True, loss_mode=k1 -> ppo(task) + coef * ppo(-k1)
    case = make_case(3)
    theirs = verl_loss(case, "k1", agg, True, clamp, task=True, coef=coef)
    ours = our_loss(case, ObjectiveCfg(name="pg_k1_rewarded", loss_agg_mode=agg, use_policy_gradient=True,
                                       loss_max_clamp=clamp, reward_coef=1.0, distill_coef=coef, **CLIP))
    _compare(ours, theirs)


# ---- the building blocks, directly ------------------------------------------------------------

@pytest.mark.parametrize("agg", AGG)
def test_agg_weights_equal_agg_loss(agg):
    g = torch.Generator().manual_seed(4)
    loss_mat = torch.randn(5, 7, generator=g)
    mask = (torch.rand(5, 7, generator=g) > 0.5).float()
    mask[3] = 0
    expected = core_algos.agg_loss(loss_mat, mask, agg)
    torch.testing.assert_close((O.agg_weights(mask, agg) * loss_mat).sum(), expected, **TOL)


@pytest.mark.parametrize("name", estimators.NAMES)
def test_estimate_equals_kl_penalty(name):
    g = torch.Generator().manual_seed(5)
    lp = (torch.randn(64, generator=g) * 8 - 4).requires_grad_(True)  # wide: reaches k3's clamps
    ref = torch.randn(64, generator=g) * 8 - 4
    ours = estimators.estimate(lp, ref, name)
    (g_ours,) = torch.autograd.grad(ours.sum(), lp)
    theirs = core_algos.kl_penalty(lp, ref, name)
    (g_theirs,) = torch.autograd.grad(theirs.sum(), lp)
    torch.testing.assert_close(ours, theirs, **TOL)
    torch.testing.assert_close(g_ours, g_theirs, **TOL)


@pytest.mark.parametrize("agg", AGG)
def test_ppo_equals_compute_policy_loss_vanilla(agg):
    g = torch.Generator().manual_seed(6)
    lp = (torch.randn(4, 9, generator=g) - 2).requires_grad_(True)
    old = lp.detach() + 0.5 * torch.randn(4, 9, generator=g)
    adv = torch.randn(4, 9, generator=g)
    mask = (torch.rand(4, 9, generator=g) > 0.3).float()
    actor = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, loss_agg_mode=agg, **CLIP)
    theirs, _ = core_algos.compute_policy_loss_vanilla(old, lp, adv, mask, loss_agg_mode=agg, config=actor)
    (g_theirs,) = torch.autograd.grad(theirs, lp)
    per_tok, _ = ppo_per_token(lp, old, adv, ObjectiveCfg(**CLIP))
    ours = (O.agg_weights(mask, agg) * per_tok).sum()
    (g_ours,) = torch.autograd.grad(ours, lp)
    torch.testing.assert_close(ours, theirs, **TOL)
    torch.testing.assert_close(g_ours, g_theirs, **TOL)


@pytest.mark.parametrize("mode", ["group_centered", "group_standardized", "leave_one_out"])
def test_reward_advantages_equal_verl_outcome_estimators(mode):
    g = torch.Generator().manual_seed(7)
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
    torch.testing.assert_close(ours, theirs[:, 0], **TOL)
    assert not math.isnan(ours.sum().item())
