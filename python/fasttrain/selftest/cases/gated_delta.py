"""`fasttrain selftest` cases of the linear-attention ops: gated_delta_rule (chunked, forward and
backward, from an initial state), gated_delta_step, the decoder's in-place gated_delta_step_ with
held rows, and causal_conv1d, each through its face in fasttrain.ops (whatever runs on the device:
flash-linear-attention, causal-conv1d, the chunked torch form or fasttrain's kernel; each case
names it, `[fla]`, and returns it as its implementation) against fasttrain.ops.reference in
float64 on the same (rounded) inputs. The shapes include Qwen3.5-27B's (key and value head dim
128, 48 value heads over 16 key heads, with q, k and g in float32 and v, beta in the model's dtype,
as the hybrid decoder and the update pass them), a head dim of 96 (three warps on a GPU) and
unequal head dims.

Tolerances (derived; fasttrain.selftest.bounds states the shared conventions u_d, u_a):
  The recurrence is non-expansive: with ‖k‖ = 1 and 0 <= β <= 1, I − βkkᵀ has norm <= 1 and the
  decay e^g <= 1, so every value column of the state obeys ‖S_t[:, j]‖ <= ‖S_0[:, j]‖ + Σ_t β_t|v_tj|
  =: S_max, and |o_tj| <= scale·‖q_t‖·S_max =: O_max. A rounding error made anywhere is carried
  forward without growth, so the error of a computation in precision u is at most the sum of its
  roundings: fasttrain's kernel (the recurrence, one token at a time) adds L = T(Dk + 4) + Dk;
  the chunked form adds, per token, a state update and a read-out of L = T(1 + Dk/C) +
  C + Dk terms in all (the chunk's triangular solve and products, and the chunks carried), each
  bounded by the magnitudes above. Hence
      tol(o) = 2·err_plain + (4·L·u_a + 4·(C + Dk)·u_c)·O_max + u_d·|o_ref|
      tol(S) = 2·err_plain + (4·L·u_a + 4·(C + Dk)·u_c)·S_max
  where err_plain is the worst error of the plain one-token recurrence computed in the case's
  accumulation dtype (fasttrain.ops.reference with the same inputs not promoted to float64: the
  flash-attention criterion, at most twice what a plain computation loses), and u_c = u_d for
  bf16/fp16 inputs (a kernel may keep intermediates in them, as flash-linear-attention does), 0
  otherwise (the torch chunked form keeps them in float32); the torch chunked form adds
  e^floor·(T + C)·(the largest reference result), e^floor bounding what its clamp of decay
  factors below e^floor (fasttrain.ops.gated_delta.decay_floor) changes a product by. The backward:
  the same form with the magnitudes replaced by the largest reference gradient of each input
  times the largest |o| cotangent path, err_plain taken from the plain recurrence's own backward. causal_conv1d: K products summed per output: (K + 2)·u_a·Σ_j|w_j||x_j|
  before the SiLU (Lipschitz 1.1), plus the output's rounding; the state is copied exactly.
"""
from __future__ import annotations

import math

import torch

from fasttrain.selftest.bounds import DT_NAME, U, rounding, u_acc
from fasttrain.selftest.harness import Check, gen, kernel, leaf, timed

__all__ = ["gated_delta_cases", "conv_cases"]


def _inputs(dev, B, T, Hk, Hv, Dk, Dv, dtype, seed, state: bool, callers: bool = False):
    """Random inputs in `dtype`; `callers`: q, k and g in float32 (the callers' L2 norm and decay),
    v and beta in `dtype`, as the hybrid decoder and the update pass them."""
    g = gen(seed)
    q = torch.randn(B, T, Hk, Dk, generator=g)
    k = torch.nn.functional.normalize(torch.randn(B, T, Hk, Dk, generator=g), dim=-1)
    v = torch.randn(B, T, Hv, Dv, generator=g)
    gl = -torch.rand(B, T, Hv, generator=g) * 1.5                      # decay e^g in (0.22, 1]
    beta = torch.rand(B, T, Hv, generator=g)
    s0 = torch.randn(B, Hv, Dk, Dv, generator=g) if state else None
    do = torch.randn(B, T, Hv, Dv, generator=g)
    dS = torch.randn(B, Hv, Dk, Dv, generator=g)
    wide = torch.float32 if callers else dtype
    cast = [q.to(wide), k.to(wide), v.to(dtype), gl.to(wide), beta.to(dtype)]
    return [t.to(dev) for t in cast], (None if s0 is None else s0.to(dev)), do.to(dtype).to(dev), dS.to(dev)


def _bounds(q, k, v, beta, s0, scale):
    """(S_max, O_max) of the derivation above, from float64 inputs."""
    Hk, Hv = q.shape[2], v.shape[2]
    b = beta.double()
    col = (b[..., None] * v.double().abs()).sum(1)                       # [B, Hv, Dv]
    if s0 is not None:
        col = col + s0.double().norm(dim=2)
    s_max = float(col.max())
    qn = q.double().norm(dim=-1).max()
    return s_max, float(scale * qn * s_max)


def _delta_case(dev, B, T, Hk, Hv, Dk, Dv, dtype, chunk, state=True, seed=0, callers=False):
    from fasttrain.ops.gated_delta import gated_delta_backend
    backend = gated_delta_backend(dev, dtype, head_dim=Dk, grad=True)
    forward = gated_delta_backend(dev, dtype, head_dim=Dk, grad=False)      # what a no-grad forward runs
    both = backend if forward == backend else f"{backend}; no-grad {forward}"
    name = (f"B={B} T={T} Hk={Hk} Hv={Hv} Dk={Dk} Dv={Dv} {DT_NAME[dtype]}{' q/k/g fp32' if callers else ''} "
            f"chunk={chunk}{' state' if state else ''} [{both}]")
    scale = Dk ** -0.5

    def run(check: Check):
        from fasttrain.ops import reference as R
        ins, s0, do, dS = _inputs(dev, B, T, Hk, Hv, Dk, Dv, dtype, seed, state, callers)
        kin = [leaf(t, dev) for t in ins]
        ks0 = leaf(s0, dev, torch.float32 if dtype != torch.float64 else torch.float64)
        rin = [leaf(t, dev, torch.float64) for t in ins]
        rs0 = leaf(s0, dev, torch.float64)
        pin = [leaf(t, dev) for t in ins]                               # the plain recurrence, acc dtype
        ps0 = leaf(s0, dev, torch.float32 if dtype != torch.float64 else torch.float64)

        def go(fn, xs, s, sdt):
            o, S = fn(*xs, scale=scale, initial_state=s, chunk_size=chunk)
            (o.to(sdt) * do.to(sdt)).sum().add((S.to(sdt) * dS.to(sdt)).sum()).backward()
            return o, S

        acc = torch.float64 if dtype == torch.float64 else torch.float32
        (ok, Sk), tk = timed(lambda: go(kernel("gated_delta_rule"), kin, ks0, acc), dev)
        (orf, Sr), tr = timed(lambda: go(R.gated_delta_rule, rin, rs0, torch.float64), dev)
        op, Sp = go(R.gated_delta_rule, pin, ps0, acc)
        ua = u_acc(dtype)
        low = dtype in (torch.bfloat16, torch.float16)

        def factor(impl):
            uc = U[dtype if low else torch.bfloat16] if impl == "fla" else 0.0    # fla rounds q, k, v to 16 bits
            # fasttrain's kernel runs the recurrence itself: per token a recall of Dk terms, the write,
            # the decay and the difference, carried without growth, then a read-out
            L = T * (Dk + 4) + Dk if impl == "fused" else T * (1 + Dk / chunk) + chunk + Dk
            return 4 * L * ua + 4 * (chunk + Dk) * uc
        f = factor(backend)
        s_max, o_max = _bounds(*ins[:3], ins[4], s0, scale)
        # the chunked torch form replaces a decay factor below e^floor by e^floor (gated_delta.decay_floor):
        # each product of a result changes by at most e^floor times the problem's largest result, at
        # most T + chunk products per entry
        from fasttrain.ops.gated_delta import decay_floor
        results = [orf, Sr] + [t.grad for t in rin] + ([rs0.grad] if state else [])
        largest = max(float(t.detach().abs().max()) for t in results if t.numel())
        clamp = math.exp(decay_floor(acc)) * (T + chunk) * largest if backend == "torch" else 0.0

        def plain_err(a, b):
            return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0

        with torch.no_grad():
            check.close("o", ok, orf, 2 * plain_err(op, orf) + f * o_max + rounding(orf, dtype) + clamp, dtype)
            check.close("state", Sk, Sr, 2 * plain_err(Sp, Sr) + f * s_max + clamp, acc)
            if forward != backend:                   # the no-grad form (prefill, scores) is another one
                of, Sf = kernel("gated_delta_rule")(*(t.detach() for t in kin), scale=scale,
                                                    initial_state=None if ks0 is None else ks0.detach(),
                                                    chunk_size=chunk)
                ff = factor(forward)
                check.close("o no-grad", of, orf, 2 * plain_err(op, orf) + ff * o_max + rounding(orf, dtype), dtype)
                check.close("state no-grad", Sf, Sr, 2 * plain_err(Sp, Sr) + ff * s_max, acc)
            grads = [("dq", kin[0], rin[0], pin[0]), ("dk", kin[1], rin[1], pin[1]), ("dv", kin[2], rin[2], pin[2]),
                     ("dg", kin[3], rin[3], pin[3]), ("dbeta", kin[4], rin[4], pin[4])]
            if state:
                grads.append(("dstate", ks0, rs0, ps0))
            for nm, gk, gr, gp in grads:
                mag = float(gr.grad.abs().max())
                check.close(nm, gk.grad, gr.grad,
                            2 * plain_err(gp.grad, gr.grad) + f * mag + rounding(gr.grad, gk.dtype) + clamp, gk.dtype)
        return tk, tr

    return name, run, f"gated_delta_rule:{backend}" + (f"+{forward}" if forward != backend else "")


def _step_case(dev, B, Hk, Hv, Dk, Dv, dtype, seed=0, held=False):
    """One token per row from a float32 state (float64 for float64): gated_delta_step, or with `held`
    the decoder's in-place gated_delta_step_ with every other row held (its state kept bit for bit,
    its output 0)."""
    from fasttrain.ops.gated_delta import gated_delta_backend
    backend = gated_delta_backend(dev, dtype, step=True)
    face = "gated_delta_step_" if held else "gated_delta_step"
    name = f"{'in-place step, rows held' if held else 'step'} B={B} Hk={Hk} Hv={Hv} Dk={Dk} Dv={Dv} " \
           f"{DT_NAME[dtype]} fp32 state [{backend}]"

    def run(check: Check):
        from fasttrain.ops import reference as R
        ins, s0, _, _ = _inputs(dev, B, 1, Hk, Hv, Dk, Dv, dtype, seed, True)
        one = [t[:, 0] for t in ins]
        sdt = torch.float64 if dtype == torch.float64 else torch.float32
        start = s0.to(sdt)
        active = torch.arange(B, device=dev) % 2 == 0

        def kern():
            if not held:
                return kernel(face)(*one, start)
            state = start.clone()
            with torch.no_grad():
                o = kernel(face)(state, *one, active=active)
            return o, state

        (ok, Sk), tk = timed(kern, dev)
        (orf, Sr), tr = timed(lambda: R.gated_delta_step(*[t.double() for t in one], s0.double()), dev)
        ua = u_acc(dtype)
        s_max, o_max = _bounds(*ins[:3], ins[4], s0, Dk ** -0.5)
        f = 4 * (2 * Dk + 4) * ua
        rows = active if held else torch.ones(B, dtype=torch.bool, device=dev)
        check.close("o", ok[rows], orf[rows], f * o_max + rounding(orf[rows], dtype), dtype)
        check.close("state", Sk[rows], Sr[rows], f * s_max, sdt)
        if held:
            check.exact("held state", Sk[~rows], start[~rows])
            check.exact("held o", ok[~rows], torch.zeros_like(ok[~rows]))
        return tk, tr

    return name, run, f"{face}:{backend}"


def gated_delta_cases(dev, quick: bool):
    bf16, f32 = torch.bfloat16, torch.float32
    # Qwen3.5-27B's Gated DeltaNet heads (16 q/k heads of 128, 48 value heads of 128) in the dtypes
    # the callers pass; T = 70 leaves a partial chunk of 64
    big = _delta_case(dev, 1, 70 if not quick else 16, 16, 48, 128, 128, bf16, 64, seed=20, callers=True)
    if quick:
        return [_delta_case(dev, 2, 37, 2, 6, 16, 8, f32, 16, seed=1), big,
                _step_case(dev, 3, 2, 4, 16, 8, bf16, seed=2),
                _step_case(dev, 4, 16, 48, 128, 128, bf16, seed=21, held=True)]
    out = [_delta_case(dev, 2, 37, 2, 6, 16, 8, f32, 16, seed=1),
           _delta_case(dev, 1, 130, 3, 3, 32, 16, f32, 64, seed=2),
           _delta_case(dev, 2, 70, 1, 3, 16, 16, bf16, 64, state=False, seed=3),
           _delta_case(dev, 2, 33, 2, 2, 8, 8, torch.float16, 8, seed=4),
           _delta_case(dev, 1, 1, 2, 4, 8, 8, f32, 64, seed=5),
           big,
           _delta_case(dev, 2, 45, 2, 4, 96, 96, bf16, 32, seed=22, callers=True),     # three warps
           _delta_case(dev, 1, 40, 2, 4, 128, 64, f32, 32, seed=23),                   # unequal head dims
           _delta_case(dev, 1, 40, 2, 2, 64, 128, bf16, 32, seed=24, callers=True),
           _step_case(dev, 3, 2, 4, 16, 8, bf16, seed=6),
           _step_case(dev, 3, 2, 2, 16, 8, f32, seed=7),
           _step_case(dev, 2, 16, 48, 128, 128, bf16, seed=25),
           _step_case(dev, 5, 2, 6, 96, 96, f32, seed=26, held=True),
           _step_case(dev, 4, 16, 48, 128, 128, bf16, seed=21, held=True)]
    if dev.type == "cpu":
        out += [_delta_case(dev, 2, 45, 2, 4, 8, 8, torch.float64, 16, seed=8),
                _step_case(dev, 2, 1, 3, 8, 8, torch.float64, seed=9)]
    return out


def _conv_case(dev, B, T, C, K, dtype, state, step=False, seed=0):
    from fasttrain.ops.gated_delta import causal_conv1d_backend
    face = "causal_conv1d_step" if step else "causal_conv1d"
    backend = "torch" if step else causal_conv1d_backend(dev, dtype, C, K)
    name = f"{'step ' if step else ''}B={B} T={T} C={C} K={K} {DT_NAME[dtype]}{' state' if state else ''} [{backend}]"

    def run(check: Check):
        from fasttrain.ops import reference as R
        g = gen(seed)
        x = torch.randn(B, T, C, generator=g).to(dtype).to(dev)
        w = torch.randn(C, K, generator=g).to(dtype).to(dev)
        s = torch.randn(B, K - 1, C, generator=g).to(dtype).to(dev) if state else None
        if step:
            (yk, sk), tk = timed(lambda: kernel("causal_conv1d_step")(x[:, 0], w, s), dev)
            (yr, sr), tr = timed(lambda: R.causal_conv1d_step(x[:, 0].double(), w.double(), s.double()), dev)
            xs = torch.cat([s, x[:, :1]], 1).double()
        else:
            (yk, sk), tk = timed(lambda: kernel("causal_conv1d")(x, w, s), dev)
            (yr, sr), tr = timed(lambda: R.causal_conv1d(x.double(), w.double(), None if s is None else s.double()), dev)
            xs = torch.cat([s if s is not None else x.new_zeros(B, K - 1, C), x], 1).double()
        n = 1 if step else yr.shape[1]
        mag = sum(xs[:, j:j + n].abs() * w.double().abs()[:, j] for j in range(K))
        if step:
            mag = mag[:, 0]
        check.close("y", yk, yr, 1.1 * (K + 2) * u_acc(dtype) * mag + rounding(yr, dtype), dtype)
        check.exact("state", sk, sr.to(sk.dtype))
        return tk, tr

    return name, run, f"{face}:{backend}"


def conv_cases(dev, quick: bool):
    if quick:
        return [_conv_case(dev, 2, 9, 24, 4, torch.bfloat16, True, seed=1)]
    out = [_conv_case(dev, 2, 9, 24, 4, torch.bfloat16, True, seed=1),
           _conv_case(dev, 3, 2, 17, 4, torch.float32, False, seed=2),
           _conv_case(dev, 2, 33, 40, 3, torch.float16, True, seed=3),
           _conv_case(dev, 4, 1, 24, 4, torch.float32, True, step=True, seed=4),
           _conv_case(dev, 4, 1, 24, 4, torch.bfloat16, True, step=True, seed=5)]
    if dev.type == "cpu":
        out.append(_conv_case(dev, 2, 9, 24, 4, torch.float64, True, seed=6))
    return out
