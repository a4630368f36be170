"""The CPU kernel of moe_experts (fasttrain::moe_experts): the face runs it on CPU tensors; it
matches the float64 reference within the selftest's derived bounds in the decode case (a handful of
tokens, k experts each, weights wide enough for several decoded tiles per projection) and the
update case (many tokens per expert), NF4 and 16-bit stacks; in float64 its backward passes
gradcheck (NF4 decodes exactly, so the op is smooth in x, the routing weights and the factors);
a fresh forward without gradients saves nothing; bad expert indices are one-line errors; the fake
kernel and the autograd registration pass opcheck."""
import importlib

import pytest
import torch

from fasttrain.selftest import harness
from fasttrain.selftest.cases.moe import moe_case, moe_inputs

pytestmark = pytest.mark.one_thread      # the one-thread default (tests/conftest.py)

M = importlib.import_module("fasttrain.ops.moe_experts")  # the module (fasttrain.ops.moe_experts is the face)
_ops = torch.ops.fasttrain


@pytest.mark.parametrize("shape", [
    # decode: 3 tokens x k=2; H=1024, I=128 gives 4 gate/up tiles and 2 down tiles (256 KiB each)
    dict(N=3, H=1024, I=128, E=6, k=2, r=4, dtype=torch.float32, nf4=True),
    # update: ~100 tokens per expert
    dict(N=160, H=64, I=32, E=4, k=2, r=4, dtype=torch.float32, nf4=False),
    dict(N=96, H=64, I=48, E=5, k=3, r=8, dtype=torch.bfloat16, nf4=True),
], ids=["decode-fp32-nf4", "update-fp32-16bit", "update-bf16-nf4"])
def test_kernel_matches_the_float64_reference(shape, monkeypatch):
    calls = []
    kernel = M._moe_experts_kernel
    monkeypatch.setattr(M, "_moe_experts_kernel", lambda *a: calls.append(1) or kernel(*a))
    name, run = moe_case(torch.device("cpu"), shape["N"], shape["H"], shape["I"], shape["E"], shape["k"], shape["r"],
                      shape["dtype"], shape["nf4"])
    check = harness.Check()
    row = check.row("moe_experts", name, *run(check))
    assert calls, "the face did not run the kernel on CPU tensors"
    assert row.passed, row


@pytest.mark.parametrize("nf4", [False, True], ids=["16-bit", "nf4"])
def test_float64_gradcheck(nf4):
    x, idx, w, gu, dn, gul, dnl, _ = moe_inputs(4, 8, 4, 4, 2, 2, torch.float64, nf4=nf4, seed=3)
    leaves = [t.clone().requires_grad_() for t in (x, w, *gul, *dnl)]

    def f(x, w, ga, gb, da, db):
        return M._moe_experts_kernel(x, idx, w, gu, dn, (ga, gb), (da, db), 1.5)
    assert torch.autograd.gradcheck(f, leaves)   # the full Jacobians (fast mode misses a 1% slip in dx)


def test_forward_without_gradients_saves_nothing_and_experts_without_tokens_are_skipped():
    x, idx, w, gu, dn, gul, dnl, _ = moe_inputs(5, 64, 32, 4, 2, 0, torch.float32, nf4=True)
    y, order, offsets, h, out = _ops.moe_experts(x, idx, w, gu.qweight, gu.absmax, dn.qweight, dn.absmax, 64, 32,
                                                 None, None, None, None, 1.0, False)
    assert h.numel() == 0 and out.numel() == 0 and y.shape == x.shape
    counts = torch.bincount(idx.reshape(-1), minlength=4)
    assert torch.equal(offsets, torch.cat([counts.new_zeros(1), counts.cumsum(0)]))
    assert torch.equal(idx.reshape(-1)[order], idx.reshape(-1).sort(stable=True).values)   # grouped, stable
    assert counts[3] == 0


def test_bad_expert_index_is_named():
    x, idx, w, gu, dn, *_ = moe_inputs(5, 64, 32, 4, 2, 0, torch.float32, nf4=False)
    bad = idx.clone()
    bad[2, 1] = 4
    with pytest.raises(RuntimeError, match=r"'expert_index' holds 4 .*outside \[0, E=4\)"):
        M.moe_experts(x, bad, w, gu, dn)


def test_opcheck():
    x, idx, w, gu, dn, gul, dnl, _ = moe_inputs(5, 16, 8, 3, 2, 2, torch.float32, nf4=True)
    args = (x.requires_grad_(), idx, w.requires_grad_(), gu.qweight, gu.absmax, dn.qweight, dn.absmax, 64, 8,
            *(t.clone().requires_grad_() for t in (*gul, *dnl)), 2.0, True)
    # the schema, the fake kernel and the autograd registration (the AOT-dispatch checks take ~15 s here)
    torch.library.opcheck(_ops.moe_experts.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
