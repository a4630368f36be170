"""`fasttrain selftest` cases of moe_experts (the routed experts of a mixture-of-experts layer),
forward and backward, NF4 and 16-bit stacks, through its face in fasttrain.ops against
fasttrain.ops.reference in float64 on the same (rounded) inputs; the MoE tests (tests/ops,
tests/cuda_emu) reuse the inputs and bounds.

Tolerances (derived; fasttrain.selftest.bounds states the conventions u_d, u_a). Every output
is a chain of sums of products, so its first-order rounding error is at most (L + c)·u times the
chain's magnitude M, the same chain with every factor replaced by its absolute value. With
yg, yu = |x|·(|W_e| + s|B_e|·|A_e|)ᵀ (the gate and up halves) and g, u, a = silu(g)·u the float64
values, the activation's error is at most 1.1|u|·δg + |g|·δu (|silu'| <= 1.1, |silu(g)| <= |g|)
and the down projection adds its own sum's error, so
    M = Σ_j |w_j|·(|D_e| + s|B_e|·|A_e|)·(1.1|u|·yg + |g|·yu + |a|),
which bounds the forward (the k-slot sum included). A gradient's magnitude is the gradient of
Σ|dy|·M with respect to the absolute inputs (|u|, |g|, |a| held fixed): each term of the true
gradient is a product of factors each at most its counterpart there. L = H + 2I + 2r + k + 8
counts the longest sums (H in gate/up, I in down, r in each LoRA product, k slots), plus N for a
LoRA factor's or routing weight's gradient (summed over tokens); c = 8 roundings to the compute
dtype u_c on the way (u_c = u_d for bf16/fp16 cases: nf4_linear and the activation may run in
them; u_a otherwise):
    tol = ((L + 8)·u_a + c·u_c)·M + u_d·|reference|.
Where the CPU kernel runs its GEMMs in bf16 (bf16 x on a CPU with native bf16 GEMMs) each GEMM
operand and output on the chain is a bf16 rounding, each of a term bounded by M: gate/up's decoded
weight, its product, the LoRA factors A and B, x·Aᵀ and its product (6), the activation (1), the
same six for the down projection, and in the backward the decoded weights again and the bf16 copies
of dy's and dh's GEMM operands' products (each tile's partial product rounded once, the partials
summed in float32): c = 16 there.
"""
from __future__ import annotations

import os
from typing import Callable

import torch

from fasttrain.selftest.bounds import DT_NAME, U, u_acc
from fasttrain.selftest.harness import Check, gen, kernel, leaf, timed

__all__ = ["moe_inputs", "moe_magnitudes", "moe_cases", "moe_tolerance", "kernel_roundings", "moe_case"]


def moe_inputs(N: int, H: int, I: int, E: int, k: int, r: int, dtype: torch.dtype, nf4: bool, seed: int = 0):
    """(x, expert_index, routing_weights, gate_up, down, gate_up_lora, down_lora, dy) on the CPU:
    x, weights and LoRA factors rounded to `dtype` where they are stored in it (LoRA fp32 masters,
    float64 for a float64 case); every expert has tokens except the last (an empty expert)."""
    from fasttrain.ops.moe_experts import ExpertStack
    g = gen(seed)
    x = torch.randn(N, H, generator=g, dtype=torch.float64).to(dtype)
    idx = torch.stack([torch.randperm(max(E - 1, k), generator=g)[:k] for _ in range(N)])
    w = torch.rand(N, k, generator=g, dtype=torch.float64).softmax(-1)
    w = w.to(torch.float64 if dtype == torch.float64 else torch.float32)
    wd = torch.float32 if dtype == torch.float64 and nf4 else dtype
    gu = (torch.randn(E, 2 * I, H, generator=g, dtype=torch.float64) / H ** 0.5).to(wd)
    dn = (torch.randn(E, H, I, generator=g, dtype=torch.float64) / I ** 0.5).to(wd)
    if nf4:
        stacks = ExpertStack.quantize(gu), ExpertStack.quantize(dn)
    else:
        stacks = (ExpertStack(E, 2 * I, H, dtype, weight=gu.to(dtype)), ExpertStack(E, H, I, dtype, weight=dn.to(dtype)))
    ld = torch.float64 if dtype == torch.float64 else torch.float32
    lora = None
    if r:
        lora = ((torch.randn(E, r, H, generator=g, dtype=torch.float64) / H ** 0.5).to(ld),
                (torch.randn(E, 2 * I, r, generator=g, dtype=torch.float64) / r).to(ld)), \
               ((torch.randn(E, r, I, generator=g, dtype=torch.float64) / I ** 0.5).to(ld),
                (torch.randn(E, H, r, generator=g, dtype=torch.float64) / r).to(ld))
    dy = torch.randn(N, H, generator=g, dtype=torch.float64)
    return x, idx, w, stacks[0], stacks[1], (lora[0] if lora else None), (lora[1] if lora else None), dy


def _abs_stack(stack):
    """The stack as a 16-bit-style float64 stack of absolute values (NF4 decoded exactly)."""
    from fasttrain.ops import reference as R
    from fasttrain.ops.moe_experts import ExpertStack
    w = R.expert_weights(stack, torch.float64).abs()
    return ExpertStack(stack.E, stack.out_features, stack.in_features, torch.float64, weight=w)


def moe_magnitudes(x, idx, w, gate_up, down, gu_lora, dn_lora, dy, scale: float):
    """(forward magnitude [N, H], {input: gradient magnitude}) of the chain in the module header."""
    gu, dn = _abs_stack(gate_up), _abs_stack(down)
    ax = x.detach().double().abs().requires_grad_()
    aw = w.detach().double().abs().requires_grad_()
    la = [None if l is None else tuple(t.detach().double().abs().requires_grad_() for t in l) for l in (gu_lora, dn_lora)]
    W1, W2 = gu.weight[idx], dn.weight[idx]                                 # [N, k, out, in]

    def proj(Wm, lora, inp):
        y = torch.einsum("nkoi,nki->nko", Wm, inp)
        if lora is not None:
            y = y + scale * torch.einsum("nkor,nkr->nko", lora[1][idx], torch.einsum("nkri,nki->nkr", lora[0][idx], inp))
        return y

    with torch.no_grad():                                                  # the actual |g|, |u|, |silu(g)·u|
        lora1 = None if gu_lora is None else tuple(t.double() for t in gu_lora)
        g, u = proj(W1, lora1, x.double()[:, None, :].expand(-1, idx.shape[1], -1)).chunk(2, dim=-1)
        a = (torch.nn.functional.silu(g) * u).abs()
    yg, yu = proj(W1, la[0], ax[:, None, :].expand(-1, idx.shape[1], -1)).chunk(2, dim=-1)
    # the activation's error from its inputs' (|silu'| <= 1.1, |silu(g)| <= |g|), plus the down sum's own
    c1 = 1.1 * u.abs() * yg + g.abs() * yu + a
    m = (aw[..., None] * proj(W2, la[1], c1)).sum(1)
    leaves = {"x": ax, "routing_weights": aw}
    for name, l in (("gate_up_lora", la[0]), ("down_lora", la[1])):
        if l is not None:
            leaves[name + "_A"], leaves[name + "_B"] = l
    grads = torch.autograd.grad((dy.abs() * m).sum(), list(leaves.values()))
    return m.detach(), dict(zip(leaves, grads))


def moe_tolerance(magnitude: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, H: int, I: int, r: int,
                  k: int, N: int = 0, roundings: int = 8) -> torch.Tensor:
    """The elementwise bound of the module header (N: the tokens a parameter's gradient sums;
    `roundings`: c, 16 where the CPU kernel's GEMMs run in bf16)."""
    L = H + 2 * I + 2 * r + k + N + 8
    u_a, u_d = u_acc(dtype), U[dtype]
    u_c = u_d if dtype in (torch.bfloat16, torch.float16) else u_a
    return ((L + 8) * u_a + roundings * u_c) * magnitude + u_d * ref.abs()


def kernel_roundings(dev, dtype: torch.dtype) -> int:
    """c of the module header for the kernel that runs on `dev`: 16 where the CPU kernel's GEMMs
    run in bf16, else 8."""
    if dev.type == "cpu" and dtype == torch.bfloat16:
        from fasttrain.host import cpu_bf16_compute
        if cpu_bf16_compute():
            return 16
    return 8


def moe_case(dev, N, H, I, E, k, r, dtype, nf4, seed=0) -> tuple[str, Callable]:
    name = f"N={N} H={H} I={I} E={E} k={k} r={r} {DT_NAME[dtype]} {'nf4' if nf4 else '16-bit'}"
    scale = 2.0

    def run(check: Check):
        from fasttrain.ops import reference as R
        x, idx, w, gu, dn, gul, dnl, dy = moe_inputs(N, H, I, E, k, r, dtype, nf4, seed)
        face = kernel("moe_experts")

        def leaves(dt):
            lx, lw = leaf(x, dev, dt), leaf(w, dev, torch.float64 if dt else None)
            ll = [None if l is None else tuple(leaf(t, dev, dt) for t in l) for l in (gul, dnl)]
            return lx, lw, ll

        def on(stack, dt):
            from dataclasses import replace
            f = {n: (t.to(dev, dt) if (dt is not None and t.is_floating_point() and n == "weight") else t.to(dev))
                 for n, t in stack.tensors().items()}
            return replace(stack, **f, dtype=dt or stack.dtype)

        kx, kw, kl = leaves(None)
        rx, rw, rl = leaves(torch.float64)
        di = idx.to(dev)

        def kern():
            y = face(kx, di, kw, on(gu, None), on(dn, None), kl[0], kl[1], scale)
            (y.double() * dy.to(dev)).sum().backward()
            return y
        y, tk = timed(kern, dev)
        yr, tr = timed(lambda: R.moe_experts(rx, di, rw, on(gu, torch.float64 if not nf4 else None),
                                              on(dn, torch.float64 if not nf4 else None), rl[0], rl[1], scale), dev)
        (yr * dy.to(dev)).sum().backward()
        fwd, gmag = moe_magnitudes(x, idx, w, gu, dn, gul, dnl, dy, scale)
        c = kernel_roundings(dev, dtype)
        check.close("y", y, yr, moe_tolerance(fwd, yr.detach().cpu(), dtype, H, I, r, k, roundings=c), dtype)
        got = {"x": kx.grad, "routing_weights": kw.grad}
        want = {"x": rx.grad, "routing_weights": rw.grad}
        for name, kk, rr in (("gate_up_lora", kl[0], rl[0]), ("down_lora", kl[1], rl[1])):
            if kk is not None:
                got[name + "_A"], got[name + "_B"] = kk[0].grad, kk[1].grad
                want[name + "_A"], want[name + "_B"] = rr[0].grad, rr[1].grad
        for n in want:
            gd = got[n].dtype if got[n] is not None else dtype
            check.close("d" + n, got[n] if got[n] is not None else torch.zeros_like(want[n]), want[n],
                        moe_tolerance(gmag[n], want[n].cpu(), dtype, H, I, r, k, 0 if n == "x" else N, roundings=c))
        return tk, tr
    return name, run


def moe_cases(dev, quick: bool):
    """The rows: an update-like batch (tens of tokens per expert), a decode step (2 tokens, 4
    experts each, weights wide enough for several decoded tiles), empty experts in each. On the
    CPU they run fasttrain's kernel, elsewhere the torch form (the row's implementation says which)."""
    cases = [moe_case(dev, 37, 64, 32, 6, 2, 4, torch.float32, True), moe_case(dev, 37, 64, 32, 6, 2, 4, torch.float32, False),
             moe_case(dev, 21, 64, 32, 5, 3, 4, torch.bfloat16, True), moe_case(dev, 2, 512, 160, 9, 4, 4, torch.float32, True)]
    if not quick:
        cases += [moe_case(dev, 50, 128, 64, 9, 4, 8, torch.float32, True, seed=1),
                  moe_case(dev, 50, 128, 64, 9, 4, 0, torch.bfloat16, False, seed=2)]
    on_cuda_kernel = dev.type == "cuda" and os.environ.get("FASTTRAIN_MOE_CUDA", "kernel").strip().lower() != "torch" \
        and torch._C._dispatch_has_kernel_for_dispatch_key("fasttrain::moe_experts", "CUDA")
    impl = "moe_experts:kernel" if dev.type == "cpu" or on_cuda_kernel else "moe_experts:torch"
    return [(name, run, impl) for name, run in cases]
