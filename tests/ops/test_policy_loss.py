"""fasttrain.ops.policy_loss against fasttrain.ops.reference in float64 (both KL estimators),
hand-computed cases that tell the losses and the estimators apart, invariants (REPO-R identity at zeta=0, no sign flip,
micro-batch accumulation), opcheck and torch.compile."""
import math

import pytest
import torch

import fasttrain.ops as ops
from fasttrain.ops import reference as R
from fasttrain.ops.policy_loss import POLICY_LOSS_STATS

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
LOSSES = ["cispo", "dapo", "grpo"]
EPS32 = torch.finfo(torch.float32).eps


def reference(logp, old, adv, mask, *, loss="cispo", ref=None, beta=0.0, eps_low=0.2, eps_high=0.28, cap=1.2,
              zeta=0.0, token_normalizer=None, kl="k3_ratio"):
    """fasttrain.ops.reference.policy_loss in the dtype of its inputs (float64: the oracle; float32:
    eager float32, the yardstick of the 2x rule). Returns (loss, stats) with one more entry,
    `_loss_abs_scale`: the sum of the tokens' |loss| over the active tokens, what a float32 sum's error
    scales with."""
    kw = dict(loss=loss, ref_logp=ref, beta=beta, eps_low=eps_low, eps_high=eps_high, cispo_cap=cap, zeta=zeta,
              kl=kl)
    out, stats = R.policy_loss(logp, old, adv, mask, token_normalizer=token_normalizer, **kw)
    terms = R.policy_loss_terms(logp.detach(), old, adv, mask, **kw)
    return out, dict(stats, _loss_abs_scale=terms["loss"].abs().sum() / terms["weight"].sum())


def make_batch(B=6, T=37, *, seed=0, per_token_adv=False, with_ref=True):
    """Random log-probs with log-ratios kept 1e-3 away from every clip/cap edge, so float32 and float64
    agree on which branch each token takes (an edge token's gradient jumps by A r)."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 6 - 0.01
    log_ratio = (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 1.4
    for edge in (math.log(0.8), math.log(1.28), math.log(1.2)):
        near = (log_ratio - edge).abs() < 1e-3
        log_ratio = torch.where(near, log_ratio + 3e-3, log_ratio)
    old = logp - log_ratio
    ref = logp + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) if with_ref else None
    adv = torch.randn(B, T, generator=g, dtype=torch.float64) if per_token_adv else torch.randn(B, generator=g, dtype=torch.float64)
    adv = torch.where(adv.abs() < 0.05, torch.zeros_like(adv), adv)  # some exact zeros
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[0, :] = True
    return logp, old, adv, mask, ref


def run(op_or_ref, logp, old, adv, mask, ref, dtype, device="cpu", **kw):
    lp = logp.to(device=device, dtype=dtype).detach().requires_grad_()
    args = (lp, old.to(device=device, dtype=dtype), adv.to(device=device, dtype=dtype if op_or_ref is reference else torch.float32),
            mask.to(device))
    r = None if ref is None else ref.to(device=device, dtype=dtype)
    if op_or_ref is reference:
        out, stats = reference(*args, ref=r, **kw)
    else:
        kw = dict(kw)
        if "cap" in kw:
            kw["cispo_cap"] = kw.pop("cap")
        out, stats = ops.policy_loss(*args, ref_logp=r, **kw)
    out.backward()
    return out.detach().double().cpu(), lp.grad.double().cpu(), {k: v.double().cpu() for k, v in stats.items()}


def max_err(a, b):
    return (a - b).abs().max().item()


def assert_derived_close(ours, ref64, eager32, what, scale=None):
    """Error against float64 at most 2x eager float32's own error, plus 2 float32 ulps of the value's
    scale (eager's error can be exactly 0 on a tensor by luck). A sum's scale is the sum of its terms'
    magnitudes, not its (possibly cancelled) value."""
    scale = ref64.abs().max().item() if scale is None else scale
    tol = 2 * max_err(eager32, ref64) + 2 * EPS32 * max(scale, 1e-30)
    err = max_err(ours, ref64)
    assert err <= tol, f"{what}: error {err:.3g} > derived tolerance {tol:.3g}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("per_token_adv", [False, True])
@pytest.mark.parametrize("beta,zeta,kl", [(0.0, 0.0, "k3_ratio"), (0.04, 0.0, "k3_ratio"), (0.04, 0.0, "k3"),
                                         (0.04, 0.03, "k3_ratio"), (0.04, 0.03, "k3")])
def test_matches_float64_reference(loss, per_token_adv, beta, zeta, kl, device):
    logp, old, adv, mask, ref = make_batch(per_token_adv=per_token_adv, seed=2 * LOSSES.index(loss) + per_token_adv)
    kw = dict(loss=loss, beta=beta, zeta=zeta, kl=kl)
    l64, g64, s64 = run(reference, logp, old, adv, mask, ref, torch.float64, **kw)
    l32, g32, s32 = run(reference, logp, old, adv, mask, ref, torch.float32, **kw)
    lo, go, so = run(ops, logp, old, adv, mask, ref, torch.float32, device, **kw)
    assert_derived_close(lo, l64, l32, "loss", s64["_loss_abs_scale"].item())
    assert_derived_close(go, g64, g32, "grad")
    for k in POLICY_LOSS_STATS:
        assert_derived_close(so[k], s64[k], s32[k], k)
    assert go[~mask].abs().max() == 0, "masked tokens must get exactly zero gradient"


def one_token(loss, r, A, **kw):
    logp = torch.tensor([[-0.7]], dtype=torch.float64)
    old = logp - math.log(r)
    lp = logp.float().requires_grad_()
    out, stats = ops.policy_loss(lp, old.float(), torch.tensor([A]), torch.ones(1, 1), loss=loss, **kw)
    out.backward()
    return out.item(), lp.grad.item(), {k: v.item() for k, v in stats.items()}


def test_hand_cases_tell_the_losses_apart():
    # r = 1.5, A = +1: CISPO's weight is capped at 1.2 and its gradient stays -1.2; DAPO is clipped (grad 0).
    l, g, s = one_token("cispo", 1.5, 1.0)
    assert l == pytest.approx(-1.2 * -0.7, rel=1e-6) and g == pytest.approx(-1.2, rel=1e-6)
    assert s["cap_frac"] == 1.0 and s["ratio_mean"] == pytest.approx(1.5, rel=1e-6)
    l, g, s = one_token("dapo", 1.5, 1.0)
    assert l == pytest.approx(-1.28, rel=1e-6) and g == 0.0
    assert s["clip_high_frac"] == 1.0 and s["clip_low_frac"] == 0.0
    # GRPO clips symmetrically at 1 + eps_low = 1.2.
    l, g, s = one_token("grpo", 1.5, 1.0)
    assert l == pytest.approx(-1.2, rel=1e-6) and g == 0.0 and s["clip_high_frac"] == 1.0
    # r = 1.25 (inside DAPO's clip-higher, outside GRPO's): DAPO learns, GRPO does not.
    assert one_token("dapo", 1.25, 1.0)[1] == pytest.approx(-1.25, rel=1e-6)
    assert one_token("grpo", 1.25, 1.0)[1] == 0.0
    # r = 0.5, A = -1: DAPO clipped low (loss -min(-0.5, -0.8) = 0.8, grad 0); CISPO grad -0.5 * -1 = 0.5.
    l, g, s = one_token("dapo", 0.5, -1.0)
    assert l == pytest.approx(0.8, rel=1e-6) and g == 0.0 and s["clip_low_frac"] == 1.0
    l, g, s = one_token("cispo", 0.5, -1.0)
    assert l == pytest.approx(-0.5 * -1 * -0.7, rel=1e-6) and g == pytest.approx(0.5, rel=1e-6) and s["cap_frac"] == 0.0
    # r = 0.5, A = +1 is not clipped (pessimistic branch): DAPO grad -A r = -0.5.
    assert one_token("dapo", 0.5, 1.0)[1] == pytest.approx(-0.5, rel=1e-6)
    # k3 KL: ref - logp = 0.5: kl = e^0.5 - 1.5, grad beta (1 - e^0.5), added to the policy term.
    lp = torch.tensor([[-0.7]], requires_grad=True)
    out, s = ops.policy_loss(lp, lp.detach(), torch.tensor([0.0]), torch.ones(1, 1), loss="dapo",
                             ref_logp=torch.tensor([[-0.2]]), beta=0.1, kl="k3")
    out.backward()
    kl = math.exp(0.5) - 1.5
    assert out.item() == pytest.approx(0.1 * kl, rel=1e-5) and s["kl_mean"].item() == pytest.approx(kl, rel=1e-5)
    assert lp.grad.item() == pytest.approx(0.1 * (1 - math.exp(0.5)), rel=1e-5)


def test_k3_ratio_hand_values_and_no_clamp():
    """k3_ratio (the default): loss beta r k3, gradient beta r (logp - ref), kl_mean r k3. r = 1.5, ref -
    logp = 0.5: k3 = e^0.5 - 1.5; the gradient -0.1 * 1.5 * 0.5 = -0.075 (k3's would be 0.1 (1 - e^0.5)).
    On-policy (r = 1) the value is k3's but the gradient is still -beta d, not beta (1 - e^d)."""
    for r, ref in ((1.5, -0.2), (1.0, -0.2), (1.5, -1.5)):
        lp = torch.tensor([[-0.7]], requires_grad=True)
        old = torch.tensor([[-0.7 - math.log(r)]])
        out, s = ops.policy_loss(lp, old, torch.tensor([0.0]), torch.ones(1, 1), loss="dapo",
                                 ref_logp=torch.tensor([[ref]]), beta=0.1)
        out.backward()
        d = ref + 0.7
        k3 = math.exp(d) - d - 1
        assert s["kl_mean"].item() == pytest.approx(r * k3, rel=1e-5)
        assert out.item() == pytest.approx(0.1 * r * k3, rel=1e-5)
        assert lp.grad.item() == pytest.approx(-0.1 * r * d, rel=1e-5)
    # Not clamped: d = 4, r = 2 puts r k3 = 2 (e^4 - 5) = 99.2 far above Unsloth's +-10 clamp, and the
    # token keeps the full pull back to the reference, beta r (logp - ref) = -0.1 * 2 * 4 (a clamp
    # would give 10 and gradient 0, the most diverged tokens losing their KL term first).
    lp = torch.tensor([[-5.0]], requires_grad=True)
    out, s = ops.policy_loss(lp, torch.tensor([[-5.0 - math.log(2.0)]]), torch.tensor([0.0]), torch.ones(1, 1),
                             loss="cispo", ref_logp=torch.tensor([[-1.0]]), beta=0.1)
    out.backward()
    assert s["kl_mean"].item() == pytest.approx(2 * (math.exp(4) - 5), rel=1e-5) and s["kl_mean"].item() > 10
    assert lp.grad.item() == pytest.approx(-0.8, rel=1e-5)


def test_the_kl_is_charged_on_the_mask_tokens_only():
    """Which tokens pay the KL is the op's mask, the same as the policy term's (the trainer passes the
    loss mask, or every sampled token with loss.normalize = "trl"): with A = 0, exactly the masked-in
    tokens get the KL gradient, each beta r (logp - ref) / (active tokens)."""
    logp, old, _, mask, ref = (t.float().double() if t.is_floating_point() else t for t in make_batch(seed=31))
    adv = torch.zeros(logp.shape[0], dtype=torch.float64)
    _, g, _ = run(ops, logp, old, adv, mask, ref, torch.float32, loss="dapo", beta=0.5)
    want = 0.5 * torch.exp(logp - old) * (logp - ref) / mask.sum()
    assert g[~mask].abs().max() == 0 and (g[mask] != 0).all()
    # from the same float32 inputs: the ratio's difference and exp, ref - logp, three products, the
    # mask weight, 1/N and the backward's two products: 10 roundings of at most EPS32/2 each
    assert ((g - want).abs()[mask] <= 10 * EPS32 * want.abs()[mask]).all()


def test_repo_r_factor_hand_values_and_identity():
    # A > 0, p = 0.5, zeta = 0.05: A' = A (1 + 0.05 ln 2); A < 0: A (1 - 0.05 ln 2). r = 1 so CISPO grad = -A'.
    for A, f in ((2.0, 1 + 0.05 * math.log(2)), (-2.0, 1 - 0.05 * math.log(2))):
        lp = torch.tensor([[math.log(0.5)]], requires_grad=True)
        out, s = ops.policy_loss(lp, lp.detach(), torch.tensor([A]), torch.ones(1, 1), zeta=0.05)
        out.backward()
        assert s["repo_r_factor_mean"].item() == pytest.approx(f, rel=1e-6)
        assert lp.grad.item() == pytest.approx(-A * f, rel=1e-6)
    # log p clamped at -20: p = e^-50 with zeta = 0.01 gives factor 1.2, not 1.5.
    lp = torch.tensor([[-50.0]], requires_grad=True)
    _, s = ops.policy_loss(lp, lp.detach(), torch.tensor([1.0]), torch.ones(1, 1), zeta=0.01)
    assert s["repo_r_factor_mean"].item() == pytest.approx(1.2, rel=1e-6)
    # zeta = 0 is exactly the identity: same bits as with the factor left out of the formula.
    logp, old, adv, mask, ref = make_batch()
    for loss in LOSSES:
        a = run(ops, logp, old, adv, mask, ref, torch.float32, loss=loss, zeta=0.0)
        b = run(reference, logp, old, adv, mask, ref, torch.float64, loss=loss, zeta=0.0)
        assert a[2]["repo_r_factor_mean"].item() == 1.0
        assert max_err(a[1], b[1]) < 1e-6


@pytest.mark.parametrize("loss", LOSSES)
def test_repo_r_never_flips_the_sign(loss):
    logp, old, adv, mask, _ = make_batch(per_token_adv=True, seed=3)
    logp = logp * 5  # log p down to -30 (clamped at -20)
    lp = logp.float().requires_grad_()
    out, s = ops.policy_loss(lp, old.float(), adv.float(), mask, loss=loss, zeta=10.0)
    out.backward()
    g = lp.grad.double()
    # d loss/d logp = -w A' (CISPO) or -A' r (DAPO): never the sign of +A.
    assert (g * adv.sign() <= 0).all(), "REPO-R flipped an advantage's sign"
    assert torch.isfinite(out) and s["repo_r_factor_mean"] >= 0


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("as_tensor", [False, True])
def test_micro_batches_accumulate_to_the_full_batch(loss, as_tensor):
    logp, old, adv, mask, ref = make_batch(B=9, T=50, seed=5)
    mask[4] = False  # an empty sequence in the middle
    lp = logp.float().requires_grad_()
    full, _ = ops.policy_loss(lp, old.float(), adv.float(), mask, loss=loss, ref_logp=ref.float(), beta=0.02)
    full.backward()
    g_full = lp.grad.clone()
    lp.grad = None
    n = (mask.any(-1).sum() if loss == "grpo" else mask.sum()).float()
    norm = n if as_tensor else n.item()
    total = 0.0
    for rows in (slice(0, 2), slice(2, 7), slice(7, 9)):
        part, _ = ops.policy_loss(lp[rows], old[rows].float(), adv[rows].float(), mask[rows], loss=loss,
                                  ref_logp=ref[rows].float(), beta=0.02, token_normalizer=norm)
        part.backward()
        total = total + part.detach()
    assert total.item() == pytest.approx(full.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(lp.grad, g_full, rtol=1e-5, atol=1e-8)


def test_grpo_is_a_mean_of_sequence_means():
    # Two sequences, r = 1 everywhere (no clipping): loss = mean_b( mean_t( -A_b ) ).
    lp = torch.zeros(2, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    out, s = ops.policy_loss(lp, lp.detach(), torch.tensor([1.0, -3.0]), mask, loss="grpo")
    out.backward()
    assert out.item() == pytest.approx((-1.0 + 3.0) / 2)
    torch.testing.assert_close(lp.grad, torch.tensor([[-1 / 8] * 4, [3 / 2, 0, 0, 0]]))
    # DAPO, the same batch, token level: (4 * -1 + 3) / 5.
    out, _ = ops.policy_loss(lp, lp.detach(), torch.tensor([1.0, -3.0]), mask, loss="dapo")
    assert out.item() == pytest.approx(-1 / 5)
    assert s["active_tokens"].item() == 5


def test_mask_semantics():
    logp, old, adv, mask, ref = make_batch(seed=7)
    # Masked tokens may hold garbage (padding): they change nothing.
    bad_old = old.clone()
    bad_old[~mask] = float("nan")
    a = run(ops, logp, old, adv, mask, ref, torch.float32, loss="dapo", beta=0.1)
    b = run(ops, logp, bad_old, adv, mask, ref, torch.float32, loss="dapo", beta=0.1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # A float mask weights tokens (matches the reference); a bool mask equals its float 0/1.
    c = run(ops, logp, old, adv, mask.float(), ref, torch.float32, loss="dapo", beta=0.1)
    assert torch.equal(a[0], c[0]) and torch.equal(a[1], c[1])
    wmask = mask.double() * torch.rand(mask.shape, dtype=torch.float64)
    wmask = wmask.float().double()
    o = run(ops, logp, old, adv, wmask.float(), ref, torch.float32, loss="cispo")
    r = run(reference, logp, old, adv, wmask, ref, torch.float64, loss="cispo")
    assert max_err(o[0], r[0]) < 1e-5 and max_err(o[1], r[1]) < 1e-6
    # No active token: loss 0, zero gradient, neutral stats, no NaN.
    z = run(ops, logp, old, adv, torch.zeros_like(mask), ref, torch.float32, loss="grpo")
    assert z[0].item() == 0 and z[1].abs().max() == 0 and z[2]["ratio_mean"].item() == 1.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("loss", LOSSES)
def test_low_precision_inputs(dtype, loss, device):
    """bf16/fp16 log-probs are computed in fp32 inside: the loss is fp32-accurate for the rounded inputs,
    and the gradient (returned in the input dtype) is off by at most its own rounding (half an ulp)."""
    logp, old, adv, mask, ref = make_batch(seed=11)
    logp, old, ref = logp.to(dtype).double(), old.to(dtype).double(), ref.to(dtype).double()
    lo, go, so = run(ops, logp, old, adv, mask, ref, dtype, device, loss=loss, beta=0.04, zeta=0.02)
    l64, g64, s64 = run(reference, logp, old, adv, mask, ref, torch.float64, loss=loss, beta=0.04, zeta=0.02)
    l32, g32, _ = run(reference, logp, old, adv, mask, ref, torch.float32, loss=loss, beta=0.04, zeta=0.02)
    assert_derived_close(lo, l64, l32, "loss", s64["_loss_abs_scale"].item())
    fi = torch.finfo(dtype)
    half_ulp = fi.eps * g64.abs().clamp(min=fi.tiny) / 2  # rounding to dtype (subnormal spacing below tiny)
    tol = half_ulp + 2 * max_err(g32, g64) + 2 * EPS32 * g64.abs().max()
    assert ((go - g64).abs() <= tol).all(), f"grad error {max_err(go, g64):.3g} beyond {dtype} rounding"


def test_dtype_mixing_promotes():
    logp, old, adv, mask, _ = make_batch(seed=13)
    lp = logp.float().requires_grad_()
    out, _ = ops.policy_loss(lp, old.bfloat16(), adv.float(), mask)
    out.backward()
    assert lp.grad.dtype == torch.float32
    want, _, _ = run(reference, logp, old.bfloat16().double(), adv, mask, None, torch.float64)
    assert out.item() == pytest.approx(want.item(), rel=1e-5)


def test_bad_input_errors_name_the_argument():
    lp, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="loss"):
        ops.policy_loss(lp, lp, torch.zeros(2), m, loss="ppo")
    with pytest.raises(ValueError, match="mask"):
        ops.policy_loss(lp, lp, torch.zeros(2), torch.ones(2, 4))
    with pytest.raises(RuntimeError, match="advantages"):
        ops.policy_loss(lp, lp, torch.zeros(3), m)
    with pytest.raises(RuntimeError, match="old_logp"):
        ops.policy_loss(lp, torch.zeros(2, 4), torch.zeros(2), m)
    with pytest.raises(TypeError, match="logp"):
        ops.policy_loss(lp.long(), lp, torch.zeros(2), m)
    with pytest.raises(ValueError, match="token_normalizer"):
        ops.policy_loss(lp, lp, torch.zeros(2), m, token_normalizer=0)
    with pytest.raises(ValueError, match="zeta"):
        ops.policy_loss(lp, lp, torch.zeros(2), m, zeta=-1.0)
    with pytest.raises(ValueError, match="kl"):
        ops.policy_loss(lp, lp, torch.zeros(2), m, kl="k2")
    with pytest.raises(RuntimeError, match="kl_type"):
        torch.ops.fasttrain.policy_loss(lp, lp, torch.zeros(2), m, None, None, 0, 0.1, 0.2, 0.28, 1.2, 0.0, 0.0, 2)


def test_the_ops_schema_defaults_to_k3():
    """kl_type is the schema's last argument with default 0 (k3), so a caller written before it gets
    what it got then; fasttrain.ops.policy_loss passes it explicitly (default "k3_ratio")."""
    logp, old, adv, mask, ref = make_batch(B=3, T=9, seed=37)
    a = [t.float() for t in (logp, old, adv)]
    no_arg = torch.ops.fasttrain.policy_loss(*a, mask, ref.float(), None, 1, 0.1, 0.2, 0.28, 1.2, 0.0, 0.0)
    k3 = torch.ops.fasttrain.policy_loss(*a, mask, ref.float(), None, 1, 0.1, 0.2, 0.28, 1.2, 0.0, 0.0, 0)
    ratio = torch.ops.fasttrain.policy_loss(*a, mask, ref.float(), None, 1, 0.1, 0.2, 0.28, 1.2, 0.0, 0.0, 1)
    assert all(torch.equal(x, y) for x, y in zip(no_arg, k3))
    assert not torch.equal(no_arg[2], ratio[2])
    lp = a[0].clone().requires_grad_()
    out, _ = ops.policy_loss(lp, a[1], a[2], mask, loss="dapo", ref_logp=ref.float(), beta=0.1)
    assert torch.equal(out.detach(), ratio[0])


def _samples(device="cpu"):
    logp, old, adv, mask, ref = make_batch(B=3, T=9, seed=17)
    f = lambda t: t.float().to(device)  # noqa: E731
    out = []
    for loss_type in (0, 1, 2):
        out.append((f(logp).requires_grad_(), f(old), f(adv), f(mask), f(ref), None, loss_type, 0.05, 0.2, 0.28, 1.2,
                    0.01, 0.0))
    out.append((f(logp).requires_grad_(), f(old), f(adv)[:, None].expand(3, 9).contiguous(), f(mask), None,
                torch.tensor(20.0, device=device), 1, 0.0, 0.2, 0.28, 1.2, 0.0, 0.0))
    out.append((f(logp).requires_grad_(), f(old), f(adv), mask.to(device), f(ref), None, 2, 0.05, 0.2, 0.28, 1.2,
                0.01, 0.0))  # bool mask, read by the kernels as it is
    for loss_type in (0, 2):  # k3_ratio (kl_type 1); the samples above take the schema's default, k3
        out.append((f(logp).requires_grad_(), f(old), f(adv), f(mask), f(ref), None, loss_type, 0.05, 0.2, 0.28, 1.2,
                    0.01, 0.0, 1))
    return out


def test_only_logp_gets_a_gradient():
    """The C++ autograd treats old_logp, advantages, mask and ref_logp as data, as the detached inputs
    of the recipe: no gradient reaches them, and without a logp that requires grad the loss has none."""
    logp, old, adv, mask, ref = make_batch(seed=23)
    old_g, adv_g, ref_g = (t.float().requires_grad_() for t in (old, adv, ref))
    out, stats = ops.policy_loss(logp.float(), old_g, adv_g, mask, loss="dapo", ref_logp=ref_g, beta=0.04)
    assert not out.requires_grad and not any(v.requires_grad for v in stats.values())
    lp = logp.float().requires_grad_()
    out, stats = ops.policy_loss(lp, old_g, adv_g, mask, loss="dapo", ref_logp=ref_g, beta=0.04)
    assert out.requires_grad and not any(v.requires_grad for v in stats.values())
    out.backward()
    assert lp.grad is not None and old_g.grad is None and adv_g.grad is None and ref_g.grad is None
    # The same gradient as the recipe's with every other input detached (float64 reference).
    _, g64, _ = run(reference, logp, old, adv, mask, ref, torch.float64, loss="dapo", beta=0.04)
    assert max_err(lp.grad.double(), g64) < 1e-6


@pytest.mark.parametrize("threads", [1, 2])
def test_thread_count_does_not_change_results(threads):
    """Big enough to be split across threads (more than the kernel's per-thread minimum): the fixed
    chunks make the results bit-identical whatever the thread count."""
    logp, old, adv, mask, ref = make_batch(B=24, T=3000, seed=29)
    before = torch.get_num_threads()
    try:
        res = []
        for n in (1, threads):
            torch.set_num_threads(n)
            res.append(run(ops, logp, old, adv, mask, ref, torch.float32, loss="grpo", beta=0.04, zeta=0.01))
    finally:
        torch.set_num_threads(before)
    (l1, g1, s1), (l2, g2, s2) = res
    assert torch.equal(l1, l2) and torch.equal(g1, g2) and all(torch.equal(s1[k], s2[k]) for k in s1)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for args in _samples(device):
        torch.library.opcheck(torch.ops.fasttrain.policy_loss.default, args)
    coef = torch.randn(3, 9, device=device)
    torch.library.opcheck(torch.ops.fasttrain.policy_loss_backward.default,
                          (torch.tensor(2.0, device=device), coef, torch.rand(3, device=device), torch.bfloat16))


def test_torch_compile_fullgraph():
    logp, old, adv, mask, ref = make_batch(seed=19)

    def step(lp, old, adv, mask, ref):
        loss, stats = ops.policy_loss(lp, old, adv, mask, loss="dapo", ref_logp=ref, beta=0.04, zeta=0.01)
        return loss * 2.0, stats["clip_high_frac"] + stats["kl_mean"]

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    res = []
    for fn in (step, compiled):
        lp = logp.float().requires_grad_()
        l, s = fn(lp, old.float(), adv.float(), mask, ref.float())
        l.backward()
        res.append((l.detach(), s, lp.grad))
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
