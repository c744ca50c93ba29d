"""Cases for stages/weights/lora_kernels.py, shared by the CPU test (Triton's interpreter,
tests/weights/test_lora_kernels.py) and the GPU test (tests/gpu/test_gpu_lora_kernels.py).

One PEFT LoRA Linear per case, computed twice: as PEFT computes it, and with `install`'s forward.
Both are checked against the same branch in fp64 (x, the base output, A, B and the output's
gradient g as given), within bounds derived from the fp32 arithmetic both do (u = 2**-24 and
gam(n) = n u / (1 - n u), the bound of any order of summing n products in fp32, |.| elementwise):

    xa = f32(x) @ A.T             e_xa = gam(K) |x| @ |A|.T
    p  = xa @ B.T                 e_p  = e_xa @ |B|.T + gam(r) (|XA| + e_xa) @ |B|.T
    t  = f32(result) + p * s      e_t  = s e_p (1 + 3u) + 3u s |P| + u |result|   (the multiply and the
                                                                                   add round once each)
    y  = dtype(t)                 e_y  = e_t + ud (|Y| + e_t)   (ud: 2**-8 bf16, 2**-11 fp16)
    gs = f32(g) * s, gxa = gs @ B e_gxa = (gam(O) (1 + u) + u) |GS| @ |B|
    gB = gs.T @ xa                e_gB = (gam(N) + u)(1 + u)^2 |GS|.T @ (|XA| + e_xa) + |GS|.T @ e_xa
    gA = gxa.T @ f32(x)           e_gA = gam(N) (|GXA| + e_gxa).T @ |x| + e_gxa.T @ |x|
    gx = dtype(gxa @ A)           e_gx = gam(r) (|GXA| + e_gxa) @ |A| + e_gxa @ |A|, + ud (|GX| + e)

(capitals: the fp64 values). PEFT's values meet the same bounds (cuBLAS and MKL sum in orders of
their own too), which checks the bounds; x's whole gradient (the base's part is the same op in both)
then differs between the two by at most both lora parts' bounds and one rounding of each sum.
"""
from __future__ import annotations

import torch

U = 2.0 ** -24
UNIT = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}

# (rows N, in K, out O, rank r, alpha): N past lora_kernels.SPLIT where the weight gradients split
CPU_SHAPES = [(200, 96, 80, 8, 16.0), (1100, 64, 130, 16, 12.0), (70, 40, 33, 5, 7.5)]
GPU_SHAPES = [(4096, 960, 960, 16, 32.0), (4096, 960, 2560, 16, 32.0), (4096, 2560, 960, 16, 32.0),
              (41000, 1024, 3072, 16, 32.0), (3000, 1024, 512, 8, 16.0), (777, 130, 70, 5, 7.5)]


def gam(n: int) -> float:
    return n * U / (1 - n * U)


def layer(K, O, r, alpha, dtype, device, gen):
    """A PEFT LoRA Linear (base [O, K] in dtype, adapters in fp32 with nonzero B) and its base."""
    from peft import LoraConfig, inject_adapter_in_model

    class One(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(K, O, bias=False)

    m = One()
    with torch.no_grad():
        m.proj.weight.copy_(torch.randn(O, K, generator=gen) * K ** -0.5)
    m = m.to(device, dtype)
    inject_adapter_in_model(LoraConfig(r=r, lora_alpha=alpha, target_modules=["proj"], lora_dropout=0.0), m)
    lin = m.proj
    for mod, shape in ((lin.lora_A["default"], (r, K)), (lin.lora_B["default"], (O, r))):
        mod.weight = torch.nn.Parameter(torch.randn(*shape, generator=gen).to(device) * shape[1] ** -0.5)
    return lin


def run_branch(lin, x, g):
    """(y, x.grad, A.grad, B.grad) of one forward and backward of `lin` as it computes now."""
    a, b = lin.lora_A["default"].weight, lin.lora_B["default"].weight
    x = x.detach().requires_grad_()
    a.grad = b.grad = None
    y = lin(x)
    y.backward(g)
    return y.detach(), x.grad, a.grad.clone(), b.grad.clone()


def exact(x, res, a, b, g, s):
    """The fp64 values and the bounds of the module's docstring."""
    x, res, a, b, g = (t.double() for t in (x, res, a, b, g))
    (N, K), O, r = x.shape, res.shape[1], a.shape[0]
    XA, P = x @ a.T, x @ a.T @ b.T
    GS = g * s
    GXA = GS @ b
    e_xa = gam(K) * (x.abs() @ a.abs().T)
    e_p = e_xa @ b.abs().T + gam(r) * ((XA.abs() + e_xa) @ b.abs().T)
    e_t = s * e_p * (1 + 3 * U) + 3 * U * s * P.abs() + U * res.abs()
    e_gxa = (gam(O) * (1 + U) + U) * (GS.abs() @ b.abs())
    e_gb = (gam(N) + U) * (1 + U) ** 2 * (GS.abs().T @ (XA.abs() + e_xa)) + GS.abs().T @ e_xa
    e_ga = gam(N) * ((GXA.abs() + e_gxa).T @ x.abs()) + e_gxa.T @ x.abs()
    e_gx = gam(r) * ((GXA.abs() + e_gxa) @ a.abs()) + e_gxa @ a.abs()
    return {"Y": res + P * s, "e_t": e_t, "GB": GS.T @ XA, "e_gb": e_gb, "GA": GXA.T @ x, "e_ga": e_ga,
            "GX": GXA @ a, "e_gx": e_gx}


def worst(got, want, bound) -> float:
    """The largest |got - want| / bound (<= 1: within the bound everywhere)."""
    return float(((got.double() - want).abs() / bound.clamp_min(1e-300)).max())


def check(device: str, dtype, shapes, seed: int) -> list[dict]:
    """Per case: the largest error over its bound of each value, ours and PEFT's, and whether our bytes
    repeat."""
    from stages.weights import lora_kernels

    gen = torch.Generator().manual_seed(seed)
    out = []
    for N, K, O, r, alpha in shapes:
        lin = layer(K, O, r, alpha, dtype, device, gen)
        s = float(lin.scaling["default"])
        x = torch.randn(N, K, generator=gen).to(device, dtype)
        g = torch.randn(N, O, generator=gen).to(device, dtype)
        with torch.no_grad():
            res = lin.get_base_layer()(x)
        a, b = lin.lora_A["default"].weight.detach(), lin.lora_B["default"].weight.detach()
        ex = exact(x, res, a, b, g, s)
        ud = UNIT[dtype]
        e_y = ex["e_t"] + ud * (ex["Y"].abs() + ex["e_t"])
        e_gx = ex["e_gx"] + ud * (ex["GX"].abs() + ex["e_gx"])
        peft = run_branch(lin, x, g)
        assert lora_kernels.install(lin) == 1  # (lin is its own only module)
        ours, again = run_branch(lin, x, g), run_branch(lin, x, g)
        gx_ours = lora_kernels.grads(g, x, lora_kernels.down(x, a), a, b, s)[0]
        base_gx = g @ lin.get_base_layer().weight  # (the same op in both: its bytes are shared)
        e_sum = 2 * e_gx + 2 * ud * (base_gx.double().abs() + ex["GX"].abs() + e_gx)
        out.append({"shape": [N, K, O, r], "s": s,
                    "y": worst(ours[0], ex["Y"], e_y), "y_peft": worst(peft[0], ex["Y"], e_y),
                    "ga": worst(ours[2], ex["GA"], ex["e_ga"]), "ga_peft": worst(peft[2], ex["GA"], ex["e_ga"]),
                    "gb": worst(ours[3], ex["GB"], ex["e_gb"]), "gb_peft": worst(peft[3], ex["GB"], ex["e_gb"]),
                    "gx_lora": worst(gx_ours, ex["GX"], e_gx),
                    "gx_vs_peft": worst(ours[1], peft[1].double(), e_sum),
                    "y_identical": float((ours[0] == peft[0]).double().mean()),
                    "repeat": all(torch.equal(p, q) for p, q in zip(ours, again))})
    return out

