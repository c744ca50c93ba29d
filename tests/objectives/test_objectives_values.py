"""Each objective on tiny hand-computed cases: values, clamps, and (for PG) the gradient.

Every fp32 value is compared with its hand-computed exact value within the fp32 error bound of the
ops that computed it (numerics.fp32_bound: each op's worst-case rounding carried to the result by
float64 adjoints; the inputs count as fp32 roundings of the hand-written reals). Where the fp32
result is exact by construction (a clamp to an fp32 number, a count over a power of two, a branch
that passes no gradient) it is compared with ==."""
import math

import pytest
import torch
from torch.func import grad_and_value

import numerics
from stages import objectives as O
from stages.run.config import ObjectiveCfg
from stages.errors import UserError
from stages.objectives import Chunk, reward_advantages
from support import seeds

LN2, LN3 = math.log(2.0), math.log(3.0)
FLOATS = ("old_logprobs", "teacher_logprobs", "topk_logprobs", "advantages", "teacher_logits")


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


def _bounded(name, chunk, rounded: bool = True, **cfg):
    """per_token of `name` on `chunk`, bounded: {output: (fp32 value, exact value, fp32 error bound)}
    for the loss, every float diagnostic and "grad" (d sum(loss) / d student logits). rounded: the
    chunk's floats stand for hand-written reals (each off by <= u); else they are the data."""
    cfg = ObjectiveCfg(name=name, **cfg)
    O.check(cfg)
    floats = [k for k in FLOATS if getattr(chunk, k) is not None]

    def f(logits, *vals):
        def loss_of(lg):
            ch = Chunk(student_logits=lg, sampled_ids=chunk.sampled_ids, topk_ids=chunk.topk_ids,
                       **{k: v.float() for k, v in zip(floats, vals)})
            loss, diag = O.get(name).per_token(ch, cfg)
            return loss.sum(), {"loss": loss, **{k: v.float() for k, v in diag.items()}}

        g, (_, outs) = grad_and_value(loss_of, has_aux=True)(logits)
        return {**outs, "grad": g}

    args = (chunk.student_logits.detach(), *[getattr(chunk, k) for k in floats])
    got = f(*args)
    ref, bound = numerics.fp32_bound(f, *args, rounded_inputs=rounded)
    return {k: (got[k], ref[k], bound[k]) for k in got}


def _check(out, key, expected, label):
    got, _, bound = out[key]
    numerics.check(got, torch.as_tensor(expected, dtype=torch.float64).reshape(got.shape), bound, f"{label}: {key}")


# ---- forward_kl_topk ---------------------------------------------------------------------------

def test_forward_kl_topk_uniform_student():
    # student uniform over 3 ids: log p_S = -ln 3; teacher top-2 = {0: 0.5, 2: 0.3}
    ch = _chunk([[0.0, 0.0, 0.0]], topk_ids=[[0, 2]], topk_logprobs=[[math.log(0.5), math.log(0.3)]])
    out = _bounded("forward_kl_topk", ch, topk=2)
    expected = 0.5 * (math.log(0.5) + LN3) + 0.3 * (math.log(0.3) + LN3)
    _check(out, "loss", [expected], "uniform student")
    _check(out, "teacher_topk_mass", [0.8], "uniform student")
    _check(out, "student_topk_mass", [2 / 3], "uniform student")
    # student top-2 of a uniform row is ids {0, 1} (first indices on ties): id 0 overlaps, id 2 not;
    # a count over k = 2: exact
    assert out["topk_overlap"][0].item() == 0.5


def test_forward_kl_topk_floor_at_zero_and_max_clamp():
    # student puts 0.9 on id 0 where the teacher has 0.1: 0.1 * ln(0.1 / 0.9) < 0 -> floored at 0
    p = [math.log(0.9), math.log(0.05), math.log(0.05)]
    ch = _chunk([p], topk_ids=[[0]], topk_logprobs=[[math.log(0.1)]])
    assert _run("forward_kl_topk", ch, topk=1)[0].item() == 0.0
    # teacher 0.9 where the student has 0.05: 0.9 ln 18 = 2.60 capped at 1
    ch = _chunk([p], topk_ids=[[1]], topk_logprobs=[[math.log(0.9)]])
    _check(_bounded("forward_kl_topk", ch, topk=1), "loss", [0.9 * math.log(18)], "0.9 ln 18")
    assert _run("forward_kl_topk", ch, topk=1, loss_max_clamp=1.0)[0].item() == 1.0  # clamped to an fp32 number


def test_forward_kl_topk_log_prob_floor():
    # student log-prob -50 on the teacher's id is floored at -18: loss = 1 * (0 - (-18))
    ch = _chunk([[0.0, -50.0]], topk_ids=[[1]], topk_logprobs=[[0.0]])
    _check(_bounded("forward_kl_topk", ch, topk=1, log_prob_min_clamp=-18.0), "loss", [18.0], "floor -18")


# ---- reverse-KL estimators ---------------------------------------------------------------------

# student p(sampled) = 1/2 (two equal logits), teacher 1/4: d = log p_S - log p_T = ln 2
EST = {"k1": LN2, "k2": 0.5 * LN2 ** 2, "mse": 0.5 * LN2 ** 2, "abs": LN2,
       "k3": 0.5 + LN2 - 1, "low_var_kl": 0.5 + LN2 - 1}


@pytest.mark.parametrize("name", sorted(EST))
def test_estimator_values(name):
    ch = _chunk([[0.0, 0.0]], teacher_logprobs=[math.log(0.25)], old_logprobs=[math.log(0.5)])
    out = _bounded(name, ch, use_policy_gradient=name == "k1")
    _check(out, "kl_estimate", [EST[name]], name)
    # k1 is PG: ratio 1, advantage -k1 -> loss = -A * 1 = k1
    _check(out, "loss", [EST[name]], name)


def test_k3_negative_d():
    # student 1/4, teacher 1/2: d = -ln 2, k3 = e^{ln 2} - ln 2 - 1
    ch = _chunk([[0.0, math.log(3.0)]], teacher_logprobs=[math.log(0.5)])
    _check(_bounded("k3", ch), "loss", [2 - LN2 - 1], "k3, d = -ln 2")


def test_supervised_k2_gradient():
    # k2 = d^2/2, d/dlogits = d * (onehot - p) = ln2 * ([1, 0] - [.5, .5])
    ch = _chunk([[0.0, 0.0]], teacher_logprobs=[math.log(0.25)])
    _check(_bounded("k2", ch), "grad", [[0.5 * LN2, -0.5 * LN2]], "k2")


def test_pg_gradient_inside_band():
    # ratio 1, A = -ln2: loss = -A * ratio, d/dlogits = -A * (onehot - p) = ln2 * [.5, -.5]
    ch = _chunk([[0.0, 0.0]], teacher_logprobs=[math.log(0.25)], old_logprobs=[math.log(0.5)])
    out = _bounded("k1", ch, use_policy_gradient=True)
    _check(out, "grad", [[0.5 * LN2, -0.5 * LN2]], "pg inside the band")
    _check(out, "ratio", [1.0], "pg inside the band")
    assert out["pg_clipped"][0].item() == 0.0


def test_pg_clip_high_and_dual_clip():
    # A = +ln2 (student below teacher), ratio 2 > 1 + 0.2: loss = -A * 1.2, no gradient
    ch = _chunk([[0.0, 0.0]], teacher_logprobs=[0.0], old_logprobs=[math.log(0.25)])
    out = _bounded("k1", ch, use_policy_gradient=True)
    _check(out, "loss", [-LN2 * 1.2], "clip high")
    assert out["pg_clipped"][0].item() == 1.0
    assert out["grad"][0].abs().sum() == 0  # the clipped branch passes no gradient: exactly 0
    # A = -ln2, ratio 0.5 / 0.1 = 5: max(5|A|, 1.2|A|) = 5|A| is cut by the dual clip at 3|A|
    ch = _chunk([[0.0, 0.0]], teacher_logprobs=[math.log(0.25)], old_logprobs=[math.log(0.1)])
    _check(_bounded("k1", ch, use_policy_gradient=True), "loss", [3 * LN2], "dual clip")
    # asymmetric band: clip_ratio_high = 0.5 lets ratio 2 -> 1.5
    ch = _chunk([[0.0, 0.0]], teacher_logprobs=[0.0], old_logprobs=[math.log(0.25)])
    _check(_bounded("k1", ch, use_policy_gradient=True, clip_ratio_high=0.5), "loss", [-LN2 * 1.5], "clip_ratio_high")


def test_pg_advantage_uses_clamped_estimate():
    # k2 = 0.5 * (ln 2)^2 = 0.24 capped at 0.1: advantage -0.1, ratio 1 -> loss 0.1
    ch = _chunk([[0.0, 0.0]], teacher_logprobs=[math.log(0.25)], old_logprobs=[math.log(0.5)])
    _check(_bounded("k2", ch, use_policy_gradient=True, loss_max_clamp=0.1), "loss", [0.1], "clamped advantage")


# ---- pg_k1_rewarded ----------------------------------------------------------------------------

def test_pg_k1_rewarded_inside_band():
    # ratio 1: loss = -(reward_coef * A_task) - distill_coef * (-k1) = -2 * 0.3 + 0.5 * ln2
    ch = _chunk([[0.0, 0.0]], teacher_logprobs=[math.log(0.25)], old_logprobs=[math.log(0.5)], advantages=[0.3])
    out = _bounded("pg_k1_rewarded", ch, use_policy_gradient=True, reward_coef=2.0, distill_coef=0.5)
    _check(out, "loss", [-0.6 + 0.5 * LN2], "pg_k1_rewarded")
    a = 0.6 - 0.5 * LN2  # the combined advantage; gradient -a * (onehot - p)
    _check(out, "grad", [[-0.5 * a, 0.5 * a]], "pg_k1_rewarded")


def test_pg_k1_rewarded_clips_each_part_by_its_sign():
    # ratio 2: task A = +1 is clipped at 1.2, distill A = -ln2 (student above teacher) is not
    ch = _chunk([[0.0, 0.0]], teacher_logprobs=[math.log(0.25)], old_logprobs=[math.log(0.25)], advantages=[1.0])
    _check(_bounded("pg_k1_rewarded", ch, use_policy_gradient=True), "loss", [-1.2 + 2 * LN2], "clipped by sign")


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
    # Counts, sums of these small rewards, the mean 3/4, r - mean, its squares and std = sqrt(1/4) are
    # all exact in fp32. What rounds: leave_one_out's division by 3 (u), standardized's fp32(1e-6)
    # and + eps (<= 2u relative on the divisor) and the division (u); the singleton's fp32(1 + 1e-6)
    # and the division. So |error| <= 3u |exact| everywhere.
    numerics.check(out, expected, 3 * numerics.U32 * torch.tensor(expected, dtype=torch.float64).abs(), mode)


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
    out = _bounded("bucketed_topk_tail", ch, topk=2, divergence=div, jsd_beta=beta)
    _check(out, "loss", [expected], div)
    _check(out, "teacher_tail_mass", [0.25], div)
    _check(out, "student_tail_mass", [0.5], div)


@pytest.mark.parametrize("seed", seeds(1))
def test_bucketed_full_support_equals_exact_kl_and_stays_finite(seed):
    # k = V: the tail is empty (teacher top-k mass rounds to 1); the loss is the exact KL, grads finite
    torch.manual_seed(seed)
    raw = torch.randn(2, 5) * 3
    s, t = torch.randn(2, 5), torch.log_softmax(raw, -1)
    top = t.topk(5, -1)
    ch = _chunk(s.tolist(), topk_ids=top.indices, topk_logprobs=top.values, teacher_logits=t)
    bucketed = _bounded("bucketed_topk_tail", ch, rounded=False, topk=5, log_prob_min_clamp=-30.0)
    assert torch.isfinite(bucketed["grad"][0]).all()
    exact = _bounded("exact_full_vocab", _chunk(s.tolist(), teacher_logits=t), rounded=False)
    numerics.check(exact["loss"][0], exact["loss"][1], exact["loss"][2], "exact_full_vocab")
    # The teacher's 5 log-probs t are fp32 roundings of log_softmax(raw) (numerics.log_softmax_err):
    # their probabilities sum to 1 + d, |d| <= sum p (e^err - 1). Where d < 0 the bucketed loss has a
    # tail bucket of mass -d, and that bucket's log ratio is within [0, 30] (both sides floored at
    # -30): it adds at most 30 |d| to the exact KL. Plus each fp32 evaluation's own bound.
    p = raw.double().softmax(-1)
    d = (p * numerics.log_softmax_err(raw).expm1()).sum(-1)
    numerics.check(bucketed["loss"][0], exact["loss"][1], bucketed["loss"][2] + 30 * d, "bucketed (k = V) vs exact KL")


def test_bucketed_tiny_student_tail_is_exact():
    # the student's tail 1e-12 is read from its own row, not from 1 - sum(top-k) (which rounds to 0)
    ch = _chunk([[0.0, -27.631]], topk_ids=[[0]], topk_logprobs=[[math.log(0.5)]])
    # (-27.631 itself is rounded to fp32: 27.6 u relative on its exp, part of the bound)
    _check(_bounded("bucketed_topk_tail", ch, topk=1, log_prob_min_clamp=-40.0), "student_tail_mass",
           [math.exp(-27.631)], "tiny tail")


# ---- exact_full_vocab --------------------------------------------------------------------------

def test_exact_full_vocab_values():
    ch = _chunk([[0.0, 0.0]], teacher_logits=[[math.log(0.8), math.log(0.2)]])
    out = _bounded("exact_full_vocab", ch)
    _check(out, "loss", [0.8 * math.log(1.6) + 0.2 * math.log(0.4)], "forward")
    _check(out, "teacher_entropy", [-(0.8 * math.log(0.8) + 0.2 * math.log(0.2))], "forward")
    _check(out, "grad", [[0.5 - 0.8, 0.5 - 0.2]], "forward")  # d KL(T||S) / d s_logits = p_S - p_T
    rev = _bounded("exact_full_vocab", _chunk([[0.0, 0.0]], teacher_logits=[[math.log(0.8), math.log(0.2)]]),
                   divergence="reverse")
    _check(rev, "loss", [0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.5 / 0.2)], "reverse")


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
