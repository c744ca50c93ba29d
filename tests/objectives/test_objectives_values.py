"""Each objective on tiny hand-computed cases: values, clamps, and (for PG) the gradient."""
import math

import pytest
import torch

from stages import objectives as O
from stages.config import ObjectiveCfg
from stages.errors import UserError
from stages.objectives import Chunk, reward_advantages

LN2, LN3 = math.log(2.0), math.log(3.0)


def _chunk(logits, **kw):
    logits = torch.tensor(logits, dtype=torch.float32).requires_grad_(True)
    n = logits.shape[0]
    kw.setdefault("sampled_ids", torch.zeros(n, dtype=torch.long))
    kw.setdefault("old_logprobs", torch.zeros(n))
    kw = {k: (torch.tensor(v) if not torch.is_tensor(v) else v) for k, v in kw.items()}
    return Chunk(student_logits=logits, **kw)


def _run(name, chunk, **cfg):
    cfg = ObjectiveCfg(name=name, **cfg)
    O.check(cfg)
    return O.get(name).per_token(chunk, cfg)


# ---- forward_kl_topk ---------------------------------------------------------------------------

def test_forward_kl_topk_uniform_student():
    # student uniform over 3 ids: log p_S = -ln 3; teacher top-2 = {0: 0.5, 2: 0.3}
    ch = _chunk([[0.0, 0.0, 0.0]], topk_ids=[[0, 2]], topk_logprobs=[[math.log(0.5), math.log(0.3)]])
    loss, diag = _run("forward_kl_topk", ch, topk=2)
    expected = 0.5 * (math.log(0.5) + LN3) + 0.3 * (math.log(0.3) + LN3)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert diag["teacher_topk_mass"].item() == pytest.approx(0.8)
    assert diag["student_topk_mass"].item() == pytest.approx(2 / 3)
    # student top-2 of a uniform row is ids {0, 1} (first indices on ties): id 0 overlaps, id 2 not
    assert diag["topk_overlap"].item() == pytest.approx(0.5)


def test_forward_kl_topk_floor_at_zero_and_max_clamp():
    # student puts 0.9 on id 0 where the teacher has 0.1: 0.1 * ln(0.1 / 0.9) < 0 -> floored at 0
    p = [math.log(0.9), math.log(0.05), math.log(0.05)]
    ch = _chunk([p], topk_ids=[[0]], topk_logprobs=[[math.log(0.1)]])
    assert _run("forward_kl_topk", ch, topk=1)[0].item() == 0.0
    # teacher 0.9 where the student has 0.05: 0.9 ln 18 = 2.60 capped at 1
    ch = _chunk([p], topk_ids=[[1]], topk_logprobs=[[math.log(0.9)]])
    assert _run("forward_kl_topk", ch, topk=1)[0].item() == pytest.approx(0.9 * math.log(18), rel=1e-6)
    assert _run("forward_kl_topk", ch, topk=1, loss_max_clamp=1.0)[0].item() == pytest.approx(1.0)


def test_forward_kl_topk_log_prob_floor():
    # student log-prob -50 on the teacher's id is floored at -18: loss = 1 * (0 - (-18))
    ch = _chunk([[0.0, -50.0]], topk_ids=[[1]], topk_logprobs=[[0.0]])
    loss, _ = _run("forward_kl_topk", ch, topk=1, log_prob_min_clamp=-18.0)
    assert loss.item() == pytest.approx(18.0, rel=1e-6)


# ---- reverse-KL estimators ---------------------------------------------------------------------

# student p(sampled) = 1/2 (two equal logits), teacher 1/4: d = log p_S - log p_T = ln 2
EST = {"k1": LN2, "k2": 0.5 * LN2 ** 2, "mse": 0.5 * LN2 ** 2, "abs": LN2,
       "k3": 0.5 + LN2 - 1, "low_var_kl": 0.5 + LN2 - 1}


@pytest.mark.parametrize("name", sorted(EST))
def test_estimator_values(name):
    ch = _chunk([[0.0, 0.0]], teacher_logprobs=[math.log(0.25)], old_logprobs=[math.log(0.5)])
    loss, diag = _run(name, ch, use_policy_gradient=name == "k1")
    assert diag["kl_estimate"].item() == pytest.approx(EST[name], rel=1e-6)
    # k1 is PG: ratio 1, advantage -k1 -> loss = -A * 1 = k1
    assert loss.item() == pytest.approx(EST[name], rel=1e-6)


def test_k3_negative_d():
    # student 1/4, teacher 1/2: d = -ln 2, k3 = e^{ln 2} - ln 2 - 1
    ch = _chunk([[0.0, math.log(3.0)]], teacher_logprobs=[math.log(0.5)])
    assert _run("k3", ch)[0].item() == pytest.approx(2 - LN2 - 1, rel=1e-6)


def test_supervised_k2_gradient():
    # k2 = d^2/2, d/dlogits = d * (onehot - p) = ln2 * ([1, 0] - [.5, .5])
    ch = _chunk([[0.0, 0.0]], teacher_logprobs=[math.log(0.25)])
    loss, _ = _run("k2", ch)
    loss.sum().backward()
    torch.testing.assert_close(ch.student_logits.grad, torch.tensor([[0.5 * LN2, -0.5 * LN2]]))


def test_pg_gradient_inside_band():
    # ratio 1, A = -ln2: loss = -A * ratio, d/dlogits = -A * (onehot - p) = ln2 * [.5, -.5]
    ch = _chunk([[0.0, 0.0]], teacher_logprobs=[math.log(0.25)], old_logprobs=[math.log(0.5)])
    loss, diag = _run("k1", ch, use_policy_gradient=True)
    loss.sum().backward()
    torch.testing.assert_close(ch.student_logits.grad, torch.tensor([[0.5 * LN2, -0.5 * LN2]]))
    assert diag["ratio"].item() == pytest.approx(1.0) and diag["pg_clipped"].item() == 0.0


def test_pg_clip_high_and_dual_clip():
    # A = +ln2 (student below teacher), ratio 2 > 1 + 0.2: loss = -A * 1.2, no gradient
    ch = _chunk([[0.0, 0.0]], teacher_logprobs=[0.0], old_logprobs=[math.log(0.25)])
    loss, diag = _run("k1", ch, use_policy_gradient=True)
    assert loss.item() == pytest.approx(-LN2 * 1.2, rel=1e-6) and diag["pg_clipped"].item() == 1.0
    loss.sum().backward()
    assert ch.student_logits.grad.abs().sum() == 0
    # A = -ln2, ratio 0.5 / 0.1 = 5: max(5|A|, 1.2|A|) = 5|A| is cut by the dual clip at 3|A|
    ch = _chunk([[0.0, 0.0]], teacher_logprobs=[math.log(0.25)], old_logprobs=[math.log(0.1)])
    loss, _ = _run("k1", ch, use_policy_gradient=True)
    assert loss.item() == pytest.approx(3 * LN2, rel=1e-6)
    # asymmetric band: clip_ratio_high = 0.5 lets ratio 2 -> 1.5
    ch = _chunk([[0.0, 0.0]], teacher_logprobs=[0.0], old_logprobs=[math.log(0.25)])
    loss, _ = _run("k1", ch, use_policy_gradient=True, clip_ratio_high=0.5)
    assert loss.item() == pytest.approx(-LN2 * 1.5, rel=1e-6)


def test_pg_advantage_uses_clamped_estimate():
    # k2 = 0.5 * (ln 2)^2 = 0.24 capped at 0.1: advantage -0.1, ratio 1 -> loss 0.1
    ch = _chunk([[0.0, 0.0]], teacher_logprobs=[math.log(0.25)], old_logprobs=[math.log(0.5)])
    loss, _ = _run("k2", ch, use_policy_gradient=True, loss_max_clamp=0.1)
    assert loss.item() == pytest.approx(0.1, rel=1e-6)


# ---- pg_k1_rewarded ----------------------------------------------------------------------------

def test_pg_k1_rewarded_inside_band():
    # ratio 1: loss = -(reward_coef * A_task) - distill_coef * (-k1) = -2 * 0.3 + 0.5 * ln2
    ch = _chunk([[0.0, 0.0]], teacher_logprobs=[math.log(0.25)], old_logprobs=[math.log(0.5)], advantages=[0.3])
    loss, diag = _run("pg_k1_rewarded", ch, use_policy_gradient=True, reward_coef=2.0, distill_coef=0.5)
    assert loss.item() == pytest.approx(-0.6 + 0.5 * LN2, rel=1e-6)
    loss.sum().backward()
    a = 0.6 - 0.5 * LN2  # the combined advantage; gradient -a * (onehot - p)
    torch.testing.assert_close(ch.student_logits.grad, torch.tensor([[-0.5 * a, 0.5 * a]]))


def test_pg_k1_rewarded_clips_each_part_by_its_sign():
    # ratio 2: task A = +1 is clipped at 1.2, distill A = -ln2 (student above teacher) is not
    ch = _chunk([[0.0, 0.0]], teacher_logprobs=[math.log(0.25)], old_logprobs=[math.log(0.25)], advantages=[1.0])
    loss, _ = _run("pg_k1_rewarded", ch, use_policy_gradient=True)
    assert loss.item() == pytest.approx(-1.2 + 2 * LN2, rel=1e-6)


REWARDS = [1.0, 0.0, 1.0, 1.0, 5.0]
GROUPS = [7, 7, 7, 7, 3]  # a group of four, and a single sample


@pytest.mark.parametrize("mode,expected", [
    ("raw", REWARDS),
    ("group_centered", [0.25, -0.75, 0.25, 0.25, 5.0]),  # mean 0.75; a singleton keeps its reward
    ("group_standardized", [0.25 / (0.5 + 1e-6), -0.75 / (0.5 + 1e-6), 0.25 / (0.5 + 1e-6), 0.25 / (0.5 + 1e-6),
                            5.0 / (1 + 1e-6)]),  # unbiased std = sqrt((3 * .0625 + .5625) / 3) = 0.5
    ("leave_one_out", [1 - 2 / 3, 0 - 1, 1 - 2 / 3, 1 - 2 / 3, 5.0]),  # r minus the mean of the others
])
def test_reward_advantages(mode, expected):
    out = reward_advantages(torch.tensor(REWARDS), torch.tensor(GROUPS), mode)
    torch.testing.assert_close(out, torch.tensor(expected), rtol=1e-6, atol=1e-7)


def test_reward_advantages_equal_rewards_and_bad_mode():
    out = reward_advantages([0.5, 0.5, 0.5], [0, 0, 0], "group_standardized")
    assert torch.equal(out, torch.zeros(3))  # std 0: (r - mean) / eps = 0, not NaN
    with pytest.raises(UserError, match="objective.advantage"):
        reward_advantages([1.0], [0], "zscore")


def test_pg_k1_rewarded_needs_advantages():
    ch = _chunk([[0.0, 0.0]], teacher_logprobs=[0.0])
    with pytest.raises(ValueError, match="advantages"):
        _run("pg_k1_rewarded", ch, use_policy_gradient=True)


# ---- bucketed_topk_tail ------------------------------------------------------------------------

# V = 4, student uniform; teacher top-2 = {0: .5, 1: .25}, tail .25; student buckets (.25, .25, .5)
T_B, S_B = [0.5, 0.25, 0.25], [0.25, 0.25, 0.5]


def _kl(p, q):
    return sum(a * math.log(a / b) for a, b in zip(p, q))


@pytest.mark.parametrize("div,beta,expected", [
    ("forward", 0.5, _kl(T_B, S_B)),  # = 0.25 ln 2
    ("reverse", 0.5, _kl(S_B, T_B)),
    ("jsd", 0.5, 0.5 * _kl(T_B, [.375, .25, .375]) + 0.5 * _kl(S_B, [.375, .25, .375])),
    ("jsd", 0.2, 0.2 * _kl(T_B, [.3, .25, .45]) + 0.8 * _kl(S_B, [.3, .25, .45])),  # M = .2 T + .8 S
])
def test_bucketed_values(div, beta, expected):
    ch = _chunk([[0.0] * 4], topk_ids=[[0, 1]], topk_logprobs=[[math.log(0.5), math.log(0.25)]])
    loss, diag = _run("bucketed_topk_tail", ch, topk=2, divergence=div, jsd_beta=beta)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert diag["teacher_tail_mass"].item() == pytest.approx(0.25, rel=1e-6)
    assert diag["student_tail_mass"].item() == pytest.approx(0.5, rel=1e-6)


def test_bucketed_full_support_equals_exact_kl_and_stays_finite():
    # k = V: the tail is empty (teacher top-k mass rounds to 1); the loss is the exact KL, grads finite
    torch.manual_seed(0)
    s, t = torch.randn(2, 5), torch.log_softmax(torch.randn(2, 5) * 3, -1)
    top = t.topk(5, -1)
    ch = _chunk(s.tolist(), topk_ids=top.indices, topk_logprobs=top.values, teacher_logits=t)
    loss, _ = _run("bucketed_topk_tail", ch, topk=5, log_prob_min_clamp=-30.0)
    loss.sum().backward()
    assert torch.isfinite(ch.student_logits.grad).all()
    exact, _ = _run("exact_full_vocab", _chunk(s.tolist(), teacher_logits=t))
    torch.testing.assert_close(loss.detach(), exact.detach(), rtol=1e-4, atol=1e-5)


def test_bucketed_tiny_student_tail_is_exact():
    # the student's tail 1e-12 is read from its own row, not from 1 - sum(top-k) (which rounds to 0)
    ch = _chunk([[0.0, -27.631]], topk_ids=[[0]], topk_logprobs=[[math.log(0.5)]])
    _, diag = _run("bucketed_topk_tail", ch, topk=1, log_prob_min_clamp=-40.0)
    assert diag["student_tail_mass"].item() == pytest.approx(math.exp(-27.631), rel=1e-4)


# ---- exact_full_vocab --------------------------------------------------------------------------

def test_exact_full_vocab_values():
    ch = _chunk([[0.0, 0.0]], teacher_logits=[[math.log(0.8), math.log(0.2)]])
    loss, diag = _run("exact_full_vocab", ch)
    assert loss.item() == pytest.approx(0.8 * math.log(1.6) + 0.2 * math.log(0.4), rel=1e-6)
    assert diag["teacher_entropy"].item() == pytest.approx(-(0.8 * math.log(0.8) + 0.2 * math.log(0.2)), rel=1e-6)
    loss.sum().backward()  # d KL(T||S) / d s_logits = p_S - p_T
    torch.testing.assert_close(ch.student_logits.grad, torch.tensor([[0.5 - 0.8, 0.5 - 0.2]]))
    rev, _ = _run("exact_full_vocab", _chunk([[0.0, 0.0]], teacher_logits=[[math.log(0.8), math.log(0.2)]]),
                  divergence="reverse")
    assert rev.item() == pytest.approx(0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.5 / 0.2), rel=1e-6)


def test_exact_full_vocab_masked_teacher_ids_no_nan():
    # a teacher logit of -inf (e.g. a padded vocab slot) contributes 0, not NaN
    ch = _chunk([[0.0, 0.0, 1.0]], teacher_logits=[[0.0, 0.0, -float("inf")]])
    loss, _ = _run("exact_full_vocab", ch)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(ch.student_logits.grad).all()


def test_exact_full_vocab_guard():
    ch = _chunk([[0.0] * 10] * 4, teacher_logits=torch.zeros(4, 10))
    with pytest.raises(UserError, match=r"objective\.full_vocab_limit.*at most 3 positions"):
        _run("exact_full_vocab", ch, full_vocab_limit=30)
    assert _run("exact_full_vocab", ch, full_vocab_limit=40)[0].shape == (4,)
    with pytest.raises(UserError, match=r"not even one position fits \(raise the limit to >= 10\)"):
        _run("exact_full_vocab", ch, full_vocab_limit=9)
