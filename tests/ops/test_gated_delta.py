"""fasttrain.ops.gated_delta_rule / gated_delta_step / causal_conv1d against their definitions in
fasttrain.ops.reference, in float64 (so the only differences are float64 roundings, bounded by
the derivation in fasttrain/selftest/cases/gated_delta.py with u = 2^-53), plus the properties the
rollout and the update rely on: any chunk size gives the same result, a sequence split anywhere
and continued from the carried state equals the whole, the one-token step repeated equals the
sequence, and the initial state receives the gradient the one-token recurrence gives it."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fasttrain.ops as F
from fasttrain.ops import reference as R

from support.tolerances import U64

SETTINGS = settings(max_examples=15, deadline=None, print_blob=True)


def _inputs(B, T, Hk, rep, Dk, Dv, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    Hv = Hk * rep
    q = torch.randn(B, T, Hk, Dk, generator=g, dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, Hk, Dk, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, T, Hv, Dv, generator=g, dtype=dtype)
    gl = -torch.rand(B, T, Hv, generator=g, dtype=dtype) * 3
    beta = torch.rand(B, T, Hv, generator=g, dtype=dtype)
    s0 = torch.randn(B, Hv, Dk, Dv, generator=g, dtype=dtype)
    return q, k, v, gl, beta, s0


@pytest.fixture(params=["fused", "torch"], autouse=True)
def backend(request):
    """Every test here runs on fasttrain's kernel ("fused", the CPU's default without a gradient) and
    on the chunked torch form ("torch", the CPU's default with one)."""
    from fasttrain.ops.gated_delta import set_gated_delta_backend
    prev = set_gated_delta_backend(request.param)
    yield request.param
    set_gated_delta_backend(prev)


def _roundings(T, C, Dk):
    """L, the roundings a value passes through (the selftest's derivation): the chunked form
    T(1 + Dk/C) + C + Dk; the one-token recurrence of the kernel T(Dk + 4) + Dk (per token a recall
    of Dk terms, the write, the decay and the difference, carried without growth; then a read-out)."""
    from fasttrain.ops.gated_delta import gated_delta_backend
    if gated_delta_backend("cpu") == "fused":
        return T * (Dk + 4) + Dk
    return T * (1 + Dk / C) + C + Dk


def _tol(T, C, Dk, q, v, beta, s0):
    """(4·L·u)·O_max with L from _roundings (float64, err_plain = 0)."""
    col = (beta[..., None] * v.abs()).sum(1) + s0.norm(dim=2)
    s_max = float(col.max())
    L = _roundings(T, C, Dk)
    return 4 * L * U64 * s_max * float(q.norm(dim=-1).max()) * Dk ** -0.5, 4 * L * U64 * s_max


shapes = st.tuples(st.integers(1, 2), st.integers(1, 40), st.integers(1, 3), st.sampled_from([1, 3]),
                   st.sampled_from([4, 8, 16]), st.sampled_from([4, 8]))


@SETTINGS
@given(shape=shapes, chunk=st.sampled_from([1, 2, 5, 16, 64]), seed=st.integers(0, 10**6))
def test_chunked_equals_the_recurrence_for_any_chunk_size(shape, chunk, seed):
    B, T, Hk, rep, Dk, Dv = shape
    q, k, v, gl, beta, s0 = _inputs(B, T, Hk, rep, Dk, Dv, seed)
    o_ref, S_ref = R.gated_delta_rule(q, k, v, gl, beta, initial_state=s0)
    o, S = F.gated_delta_rule(q, k, v, gl, beta, initial_state=s0, chunk_size=chunk)
    to, ts = _tol(T, chunk, Dk, q, v, beta, s0)
    assert o.dtype == torch.float64 and S.dtype == torch.float64
    assert (o - o_ref).abs().max() <= to and (S - S_ref).abs().max() <= ts


@SETTINGS
@given(shape=shapes, split=st.integers(0, 40), seed=st.integers(0, 10**6))
def test_a_split_sequence_continued_from_its_state_equals_the_whole(shape, split, seed):
    B, T, Hk, rep, Dk, Dv = shape
    s = min(split, T)
    q, k, v, gl, beta, s0 = _inputs(B, T, Hk, rep, Dk, Dv, seed)
    o, S = F.gated_delta_rule(q, k, v, gl, beta, initial_state=s0, chunk_size=8)
    a = [t[:, :s] for t in (q, k, v, gl, beta)]
    b = [t[:, s:] for t in (q, k, v, gl, beta)]
    o1, S1 = F.gated_delta_rule(*a, initial_state=s0, chunk_size=8)
    o2, S2 = F.gated_delta_rule(*b, initial_state=S1, chunk_size=8)
    to, ts = _tol(T, 8, Dk, q, v, beta, s0)
    assert (torch.cat([o1, o2], 1) - o).abs().max() <= 2 * to and (S2 - S).abs().max() <= 2 * ts


@pytest.mark.parametrize("rep", [1, 3])
def test_the_one_token_step_repeated_equals_the_sequence(rep):
    q, k, v, gl, beta, s0 = _inputs(2, 13, 2, rep, 8, 4, seed=3)
    o_seq, S_seq = F.gated_delta_rule(q, k, v, gl, beta, initial_state=s0, chunk_size=4)
    S, outs = s0, []
    for t in range(13):
        o, S = F.gated_delta_step(q[:, t], k[:, t], v[:, t], gl[:, t], beta[:, t], S)
        outs.append(o)
    to, ts = _tol(13, 4, 8, q, v, beta, s0)
    assert (torch.stack(outs, 1) - o_seq).abs().max() <= to and (S - S_seq).abs().max() <= ts


def test_gradients_including_the_initial_state_equal_the_recurrence():
    ins = _inputs(2, 21, 2, 3, 8, 4, seed=5)
    g = torch.Generator().manual_seed(9)
    do = torch.randn(2, 21, 6, 4, generator=g, dtype=torch.float64)
    dS = torch.randn(2, 6, 8, 4, generator=g, dtype=torch.float64)

    def grads(fn, **kw):
        xs = [t.clone().requires_grad_() for t in ins]
        o, S = fn(*xs[:5], initial_state=xs[5], **kw)
        ((o * do).sum() + (S * dS).sum()).backward()
        return [x.grad for x in xs]

    want = grads(R.gated_delta_rule)
    got = grads(F.gated_delta_rule, chunk_size=8)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), got, want):
        # the same L·u form as the values, relative to each gradient's own largest entry
        assert (a - b).abs().max() <= 4 * _roundings(21, 8, 8) * U64 * 50 * b.abs().max(), name
    assert want[5].abs().max() > 0.1          # the initial state does receive a gradient


@pytest.mark.parametrize("split", [0, 7, 16, 21])
def test_gradients_through_a_carried_state_equal_the_whole_recurrence(split):
    """The update's use: the prompt's call hands its final state to the answers' call (gathered per
    row, as prefix_forward_hybrid does), v a strided view of the conv output; the gradients of both
    calls' inputs and of the first initial state equal the float64 recurrence over the whole
    sequence (the final state's gradient of the first call is what carries the second's back)."""
    q, k, v, gl, beta, s0 = _inputs(2, 21, 2, 3, 8, 4, seed=13)
    wide = torch.cat([torch.zeros_like(v), v], -1)            # v as a view with row stride 2·Dv
    g = torch.Generator().manual_seed(21)
    do = torch.randn(2, 21, 6, 4, generator=g, dtype=torch.float64)
    dS = torch.randn(2, 6, 8, 4, generator=g, dtype=torch.float64)

    def leaves():
        return [t.clone().requires_grad_() for t in (q, k, wide, gl, beta, s0)]

    xs = leaves()
    qq, kk, ww, gg, bb, ss = xs
    vv = ww[..., 4:]
    a = [t[:, :split] for t in (qq, kk, vv, gg, bb)]
    b = [t[:, split:] for t in (qq, kk, vv, gg, bb)]
    rows = torch.tensor([0, 1])
    o1, S1 = F.gated_delta_rule(*a, initial_state=ss, chunk_size=8)
    o2, S2 = F.gated_delta_rule(*b, initial_state=S1[rows], chunk_size=8)
    ((torch.cat([o1, o2], 1) * do).sum() + (S2 * dS).sum()).backward()
    got = [x.grad for x in xs]
    ys = leaves()
    o, S = R.gated_delta_rule(ys[0], ys[1], ys[2][..., 4:], ys[3], ys[4], initial_state=ys[5])
    ((o * do).sum() + (S * dS).sum()).backward()
    want = [y.grad for y in ys]
    for name, x, y in zip(("q", "k", "v", "g", "beta", "initial_state"), got, want):
        # the same L·u form as the values (twice: two calls), relative to each gradient's largest entry
        assert (x - y).abs().max() <= 2 * 4 * _roundings(21, 8, 8) * U64 * 50 * y.abs().max(), name
    assert torch.equal(got[2][..., :4], torch.zeros_like(got[2][..., :4]))   # nothing leaks outside the view


def test_the_backend_rule_per_phase_and_its_override():
    """gated_delta_backend's rule on the CPU: the update (a gradient wanted) runs the chunked torch
    form, a prefill or the scores (no gradient) and a decode step the token kernel;
    set_gated_delta_backend forces one form for all, and the plan counts the update's form."""
    from fasttrain.ops.gated_delta import gated_delta_backend, set_gated_delta_backend
    from fasttrain.plan.hybrid_memory import update_rule_form
    set_gated_delta_backend("auto")           # the rule itself, whatever the fixture chose
    assert gated_delta_backend("cpu", torch.bfloat16, head_dim=128, grad=True) == "torch"
    assert gated_delta_backend("cpu", torch.bfloat16, head_dim=128, grad=False) == "fused"
    assert gated_delta_backend("cpu", step=True) == "fused"
    assert update_rule_form() == "chunked"
    for forced, form in (("fused", "fused"), ("torch", "chunked")):
        set_gated_delta_backend(forced)
        assert {gated_delta_backend("cpu", grad=g) for g in (True, False)} == {forced}
        assert update_rule_form() == form
    with pytest.raises(ValueError, match="allowed"):
        set_gated_delta_backend("chunked")
    # which form a call runs follows the rule: with a gradient the chunked form's own backward
    set_gated_delta_backend("auto")
    q, k, v, gl, beta, s0 = _inputs(1, 9, 1, 2, 4, 4, seed=2)
    o, _ = F.gated_delta_rule(q.requires_grad_(), k, v, gl, beta, initial_state=s0)
    assert type(o.grad_fn).__name__ == "_ChunkedRuleBackward"
    with torch.no_grad():
        o, _ = F.gated_delta_rule(q, k, v, gl, beta, initial_state=s0)
    assert o.grad_fn is None


@pytest.mark.parametrize("dtype,decay", [(torch.float32, 1), (torch.bfloat16, 1), (torch.float32, 40)])
def test_gradients_in_float32_and_bf16_within_float32_roundings(dtype, decay):
    """16-bit and float32 inputs run in float32 inside: values and every gradient within 4·L·u32 of
    the float64 recurrence (scaled by each one's largest entry), for a span of checkpoints that
    does not divide T. `decay` 40: log decays down to -120 a token, so a chunk's e^{Γ_t − Γ_s} fall
    far below float32's smallest normal (the chunked form clamps those exponents)."""
    ins64 = _inputs(2, 23, 1, 3, 16, 8, seed=11)
    ins64 = (*ins64[:3], ins64[3] * decay, *ins64[4:])
    ins = [t.to(dtype) for t in ins64[:5]] + [ins64[5].float()]
    g = torch.Generator().manual_seed(4)
    # the cotangent of o is exact in o's dtype (o is bf16 on that side: its gradient is rounded to it)
    do = torch.randn(2, 23, 3, 8, generator=g, dtype=torch.float64).to(dtype).double()
    dS = torch.randn(2, 3, 16, 8, generator=g, dtype=torch.float64)

    def run(fn, xs, **kw):
        xs = [t.detach().clone().requires_grad_() for t in xs]
        o, S = fn(*xs[:5], initial_state=xs[5], **kw)
        ((o.double() * do).sum() + (S.double() * dS).sum()).backward()
        return [o, S] + [x.grad for x in xs]

    want = run(R.gated_delta_rule, [t.double() for t in ins])
    got = run(F.gated_delta_rule, ins, chunk_size=5)
    u32 = 2.0 ** -24
    # the chunked form replaces a decay factor below e^floor by e^floor (gated_delta_chunked.decay_floor):
    # each of a result's products changes by at most e^floor times that product without the factor,
    # which the problem's largest result bounds; at most T + C such products per entry
    from fasttrain.ops.gated_delta import gated_delta_backend
    from fasttrain.ops.gated_delta_chunked import decay_floor
    scale_all = max(float(b.detach().abs().max()) for b in want)
    clamp = (math.exp(decay_floor(torch.float32)) * (23 + 5) * scale_all if gated_delta_backend("cpu") == "torch"
             else 0.0)
    for name, a, b in zip(("o", "S", "q", "k", "v", "g", "beta", "initial_state"), got, want):
        out_round = 2.0 ** -8 if (name == "o" or name in ("q", "k", "v", "g", "beta")) and dtype == torch.bfloat16 else 0
        bound = (4 * _roundings(23, 5, 16) * u32 * 50 + out_round) * float(b.detach().abs().max()) + clamp
        assert float((a.double() - b).abs().max()) <= bound, name


def test_the_kernel_keeps_states_only_when_a_gradient_is_wanted():
    from fasttrain.ops.gated_delta import set_gated_delta_backend
    set_gated_delta_backend("fused")          # the kernel's own behaviour, whatever the fixture chose
    q, k, v, gl, beta, s0 = _inputs(1, 9, 1, 1, 4, 4, seed=2)
    o, S, ck = torch.ops.fasttrain.gated_delta_forward(q, k, v, gl, beta, s0, 0.5, 4, True)
    assert ck.shape == (1, 1, 3, 4, 4) and torch.equal(ck[:, :, 0], s0)
    _, _, ck0 = torch.ops.fasttrain.gated_delta_forward(q, k, v, gl, beta, s0, 0.5, 4, False)
    assert ck0.numel() == 0
    with pytest.raises(RuntimeError, match="float32 or float64"):
        torch.ops.fasttrain.gated_delta_forward(q.half(), k.half(), v.half(), gl.half(), beta.half(), None, 0.5, 4,
                                                False)
    with pytest.raises(RuntimeError, match="checkpoint"):
        torch.ops.fasttrain.gated_delta_backward(torch.zeros_like(v), None, q, k, v, gl, beta, ck0, 0.5, 4)
    with torch.no_grad():
        o2, S2 = F.gated_delta_rule(q, k, v, gl, beta, initial_state=s0)
    x = q.clone().requires_grad_()
    with torch.no_grad():
        o3, _ = F.gated_delta_rule(x, k, v, gl, beta, initial_state=s0)
    assert not o3.requires_grad and torch.equal(o2, o3)


@pytest.mark.parametrize("rep", [1, 3])
def test_the_in_place_step_holds_inactive_rows_and_advances_the_others(rep):
    """gated_delta_step_ (the decoder's): active rows equal the one-token recurrence within its
    bound, held rows keep their state bit for bit and give 0, and no new state tensor is made."""
    q, k, v, gl, beta, s0 = _inputs(4, 1, 2, rep, 8, 4, seed=6)
    one = [t[:, 0] for t in (q, k, v, gl, beta)]
    active = torch.tensor([True, False, True, False])
    state = s0.clone()
    ptr = state.data_ptr()
    with torch.no_grad():
        o = F.gated_delta_step_(state, *one, active=active)
    o_ref, S_ref = R.gated_delta_step(*one, s0)
    to, ts = _tol(1, 1, 8, q, v, beta, s0)
    assert state.data_ptr() == ptr
    assert torch.equal(state[~active], s0[~active]) and torch.equal(o[~active], torch.zeros_like(o[~active]))
    assert (state[active] - S_ref[active]).abs().max() <= ts and (o[active] - o_ref[active]).abs().max() <= to
    assert not torch.equal(state[active], s0[active])


def test_an_empty_sequence_passes_the_state_through():
    q, k, v, gl, beta, s0 = _inputs(2, 0, 1, 2, 4, 4, seed=1)
    o, S = F.gated_delta_rule(q, k, v, gl, beta, initial_state=s0)
    assert o.shape == (2, 0, 2, 4) and torch.equal(S, s0)


def test_hf_torch_recurrence_agrees_in_float32():
    """A peer's implementation (transformers' torch fallback, float32 inside) against our float64
    definition: within float32 roundings of the same bound (u = 2^-24)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule
    q, k, v, gl, beta, s0 = _inputs(2, 19, 2, 3, 8, 4, seed=7)
    o_hf, S_hf = torch_chunk_gated_delta_rule(q, k, v, gl, beta, initial_state=s0, output_final_state=True,
                                              chunk_size=8)
    o, S = R.gated_delta_rule(q, k, v, gl, beta, initial_state=s0)
    to, ts = _tol(19, 8, 8, q, v, beta, s0)
    assert (o_hf - o).abs().max() <= to * 2.0**29 and (S_hf - S).abs().max() <= ts * 2.0**29


@pytest.mark.parametrize("K", [2, 4])
def test_conv_prefill_then_steps_equals_the_whole_sequence(K):
    g = torch.Generator().manual_seed(K)
    x = torch.randn(3, 11, 10, generator=g, dtype=torch.float64)
    w = torch.randn(10, K, generator=g, dtype=torch.float64)
    y_all, s_all = F.causal_conv1d(x, w)
    y_ref, s_ref = R.causal_conv1d(x, w)
    assert torch.allclose(y_all, y_ref, rtol=0, atol=(K + 2) * U64 * 1.1 * float(x.abs().max() * w.abs().sum(1).max()))
    y5, s = F.causal_conv1d(x[:, :5], w)
    ys = [y5]
    for t in range(5, 11):
        y, s = F.causal_conv1d_step(x[:, t], w, s)
        ys.append(y[:, None])
    assert torch.equal(s, s_all) and torch.equal(s_all, s_ref)
    assert (torch.cat(ys, 1) - y_all).abs().max() <= (K + 2) * U64 * 1.1 * float(x.abs().max() * w.abs().sum(1).max())
    # a state equal to zeros is the same as left zero padding
    y0, _ = F.causal_conv1d(x, w, torch.zeros(3, K - 1, 10, dtype=torch.float64))
    assert torch.equal(y0, y_all)


def test_shape_errors_name_the_argument():
    q, k, v, gl, beta, s0 = _inputs(1, 4, 2, 3, 8, 4, seed=1)
    with pytest.raises(ValueError, match="beta"):
        F.gated_delta_rule(q, k, v, gl, beta[:, :, :2])
    with pytest.raises(ValueError, match="initial_state"):
        F.gated_delta_rule(q, k, v, gl, beta, initial_state=s0[:, :2])
    with pytest.raises(ValueError, match="multiple"):
        F.gated_delta_rule(q, k, v[:, :, :5], gl[:, :, :5], beta[:, :, :5])


def test_a_selftest_case_run_on_its_own_checks_the_real_kernels(monkeypatch):
    """A case built and run outside run_selftest (as the CUDA test below does) finds the faces
    under test itself: KERNELS empty must not be a KeyError."""
    from fasttrain.selftest import harness
    from fasttrain.selftest.cases.gated_delta import gated_delta_cases
    monkeypatch.setattr(harness, "KERNELS", {})
    case = gated_delta_cases(torch.device("cpu"), quick=True)[0]
    chk = harness.Check()
    case[1](chk)
    assert chk.row("gated_delta_rule", case[0], 0, 0).passed and case[2].startswith("gated_delta_rule:")


def test_the_selftest_has_rows_at_the_27b_heads_past_one_warp_and_for_held_rows():
    """Qwen3.5-27B's delta-rule heads (16 q/k heads of 128 serving 48 value heads of 128, q/k/g in
    float32 as the callers pass them), a head dim of 96 (three 32-lane warps), unequal head dims,
    and the decoder's in-place step with held rows, in the full selftest and the quick one."""
    from fasttrain.selftest.cases.gated_delta import gated_delta_cases
    full = [c[0] for c in gated_delta_cases(torch.device("cpu"), quick=False)]
    quick = [c[0] for c in gated_delta_cases(torch.device("cpu"), quick=True)]
    big = "Hk=16 Hv=48 Dk=128 Dv=128"
    for names in (full, quick):
        assert any(big in n and "q/k/g fp32" in n and not n.startswith(("step", "in-place")) for n in names)
        assert any(n.startswith("in-place step, rows held") and big in n for n in names)
    assert any("Dk=96 Dv=96" in n and not n.startswith(("step", "in-place")) for n in full)
    assert any(n.startswith("in-place step, rows held") and "Dk=96" in n for n in full)
    assert any("Dk=128 Dv=64" in n for n in full) and any("Dk=64 Dv=128" in n for n in full)
    from fasttrain.selftest import harness
    for name, run, impl in gated_delta_cases(torch.device("cpu"), quick=False):
        if "Dk=96" in name or "Dk=128 Dv=64" in name or "Dk=64 Dv=128" in name:   # (the 27B rows: the quick run)
            chk = harness.Check()
            run(chk)
            assert chk.row("gated_delta_rule", name, 0, 0, impl).passed, name


@pytest.mark.cuda
def test_cuda_path_matches_the_float64_reference():
    from fasttrain.selftest.cases.gated_delta import gated_delta_cases
    from fasttrain.selftest import harness
    from fasttrain.ops.kernels import fused_only
    for name, run, impl in gated_delta_cases(torch.device("cuda"), quick=False):
        chk = harness.Check()
        with fused_only():
            run(chk)
        row = chk.row("gated_delta_rule", name, 0, 0, impl)
        assert row.passed, (name, row)
