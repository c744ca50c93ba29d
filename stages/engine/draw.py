"""The decode step's draw as two Triton kernels (docs/architecture.md, "Fused decode projections"):
token ~ softmax(logits / temperature) by the inverse CDF at u, and its log-probability, for the
plain sampling setting (no top-p, not greedy) on CUDA. `decoder.pick` in torch takes ~10 kernels
over the [B, V] logits (log-softmax, exp, two scans, the search, gathers): 10% of workload b's
decode step at its 64 x 151,936 logits (docs/performance.md).

1. `_chunk_stats`, a program per row and chunk of C logits: the chunk's max m_c and
   s_c = sum exp(x - m_c) (x = logit / temperature, EOS at -inf where blocked).
2. `_pick`, a program per row: m = max m_c, the chunk weights w_c = s_c exp(m_c - m), their running
   sum (the CDF at chunk ends), the target u * total, the first chunk whose running sum reaches it,
   and within that chunk alone the running sum of exp(x - m) from the sum of the chunks before it:
   the first token reaching the target. log p = x - m - log(total). Chunks and tokens of probability
   0 are never chosen (torch's search picks token 0 for u = 0 whatever its probability).

It rounds otherwise than torch's passes (other summation orders; the CUDA digest names it, `draw:
kernel`); each sum runs in a fixed order, so it is deterministic. Should rounding leave the target
past the chosen chunk's last running sum, the chunk's last token of nonzero probability is taken
(torch's search clamps to the vocabulary's last token).
"""
from __future__ import annotations

import torch

from .kernels import triton

if triton is not None:
    import triton.language as tl

CHUNK = 2048  # logits per program of the first kernel
ON = True  # False: decoder.pick's torch passes on CUDA too (benchmarks/decode_kernels.py ':nodraw')


def serves(greedy: bool, top_p: float) -> bool:
    """The sampling settings these kernels draw for: plain sampling (greedy and top-p take torch's passes)."""
    return not greedy and top_p >= 1.0


def usable(logits: torch.Tensor, greedy: bool, top_p: float) -> bool:
    return ON and triton is not None and logits.is_cuda and serves(greedy, top_p)


if triton is not None:
    @triton.jit
    def _logit(X, BLOCK_EOS, r, idx, V, sx, temperature, eos, HAS_EOS: tl.constexpr):
        """Row r's logits at idx [C] in fp32 over the temperature, -inf past V and at a blocked EOS."""
        x = tl.load(X + r.to(tl.int64) * sx + idx, mask=idx < V, other=float("-inf")).to(tl.float32)  # (64-bit:
        # hf_generate's prompt-step logits [B, P, V] have rows P x V apart)
        if HAS_EOS:
            x = tl.where((idx == eos) & (tl.load(BLOCK_EOS + r) != 0), float("-inf"), x)
        return x / temperature

    # eos: not specialized (Triton would compile again for an id divisible by 16, or 1): the warm-up's
    # and the child's compilations (stages/engine/warmup.py) serve every tokenizer's EOS
    @triton.jit(do_not_specialize=["eos"])
    def _chunk_stats(X, BLOCK_EOS, MC, SC, V, sx, temperature, eos, NC, C: tl.constexpr, HAS_EOS: tl.constexpr):
        r, c = tl.program_id(0), tl.program_id(1)
        x = _logit(X, BLOCK_EOS, r, c * C + tl.arange(0, C), V, sx, temperature, eos, HAS_EOS)  # [C]
        m = tl.max(x, 0)
        s = tl.sum(tl.exp(x - tl.where(m == float("-inf"), 0.0, m)), 0)  # (a chunk all -inf: 0)
        tl.store(MC + r * NC + c, m)
        tl.store(SC + r * NC + c, s)

    @triton.jit(do_not_specialize=["eos"])
    def _pick(X, BLOCK_EOS, MC, SC, U, TOK, LP, V, sx, temperature, eos, NC,
              NCP: tl.constexpr, C: tl.constexpr, HAS_EOS: tl.constexpr):
        r = tl.program_id(0)
        rc = tl.arange(0, NCP)
        mc = tl.load(MC + r * NC + rc, mask=rc < NC, other=float("-inf"))  # [NCP]
        sc = tl.load(SC + r * NC + rc, mask=rc < NC, other=0.0)
        m = tl.max(mc, 0)  # (finite: some token is allowed)
        w = sc * tl.exp(mc - m)  # [NCP] each chunk's share of the normaliser (0 for an all -inf chunk)
        cum = tl.cumsum(w, 0)  # nondecreasing: the CDF at each chunk's end
        total = tl.max(cum, 0)
        target = tl.load(U + r) * total
        # the chunk the target falls in; should rounding leave the target past every running sum (the
        # parallel scan may round a trailing chunk of weight 0 above the last one), the last chunk of weight > 0
        j = tl.min(tl.where((cum >= target) & (w > 0), rc, tl.max(tl.where(w > 0, rc, 0), 0)), 0)
        before = tl.sum(tl.where(rc == j - 1, cum, 0.0), 0)  # the CDF at the end of the chunk before (one term)
        idx = j * C + tl.arange(0, C)
        x = _logit(X, BLOCK_EOS, r, idx, V, sx, temperature, eos, HAS_EOS)
        e = tl.exp(x - m)
        hit = tl.where((before + tl.cumsum(e, 0) >= target) & (e > 0), idx, V)  # (never a token of probability 0)
        last = tl.max(tl.where(e > 0, idx, 0), 0)  # (rounding left the target past this chunk: its last token)
        tok = tl.minimum(tl.min(hit, 0), last)
        xt = tl.sum(tl.where(idx == tok, x, 0.0), 0)
        tl.store(TOK + r, tok.to(tl.int64))
        tl.store(LP + r, xt - m - tl.log(total))


def sample(logits: torch.Tensor, u: torch.Tensor, temperature: float, block_eos, eos: int):
    """logits [B, V] (any float dtype, rows contiguous), u [B] in [0, 1), block_eos [B] bool or None ->
    (token [B] int64, its log-probability under softmax(logits / temperature) [B] fp32)."""
    torch._check(logits.stride(-1) == 1 and u.is_contiguous(), lambda: "draw.sample: logits rows and u contiguous")
    B, V = logits.shape
    NC = triton.cdiv(V, CHUNK)
    mc = torch.empty((B, NC), dtype=torch.float32, device=logits.device)
    sc = torch.empty_like(mc)
    tok = torch.empty(B, dtype=torch.long, device=logits.device)
    lp = torch.empty(B, dtype=torch.float32, device=logits.device)
    # one flag per row in memory (the engine's is an expanded scalar); u: a pointer HAS_EOS leaves unread
    blk = block_eos.to(torch.int8).contiguous() if block_eos is not None else u
    _chunk_stats[(B, NC)](logits, blk, mc, sc, V, logits.stride(0), float(temperature), eos, NC, C=CHUNK,
                          HAS_EOS=block_eos is not None, num_warps=4)
    _pick[(B,)](logits, blk, mc, sc, u, tok, lp, V, logits.stride(0), float(temperature), eos, NC,
                NCP=triton.next_power_of_2(NC), C=CHUNK, HAS_EOS=block_eos is not None, num_warps=4)
    return tok, lp
