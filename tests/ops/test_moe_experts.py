"""fasttrain.ops.moe_experts: its selftest rows pass on the CPU and a wrong kernel fails them (the
derived bounds are not vacuous), each expert of an NF4 stack is an NF4 weight on its own (the
bytes nf4_quantize gives that expert), an expert with no tokens gets exact zero gradients, and bad
shapes are one-line errors naming the argument."""
import pytest
import torch

import fasttrain.ops as F
from fasttrain.selftest import harness
from fasttrain.ops.moe_experts import ExpertStack
from fasttrain.selftest.cases.moe import moe_cases, moe_inputs

pytestmark = pytest.mark.one_thread      # the one-thread default (tests/conftest.py)


def _rows(face, only: str = ""):
    before = harness.KERNELS.get("moe_experts")      # restored after: another test may have filled KERNELS
    harness.KERNELS["moe_experts"] = face
    try:
        out = []
        for name, run, _impl in moe_cases(torch.device("cpu"), quick=True):
            if only not in name:
                continue
            check = harness.Check()
            out.append(check.row("moe_experts", name, *run(check)))
        return out
    finally:
        if before is None:
            harness.KERNELS.pop("moe_experts", None)
        else:
            harness.KERNELS["moe_experts"] = before


def test_selftest_rows_pass_and_fail_for_a_one_percent_slip():
    rows = _rows(F.moe_experts)
    assert all(r.passed for r in rows), [r for r in rows if not r.passed]

    def weights_off(x, i, w, gu, dn, a=None, b=None, scale=1.0):
        return F.moe_experts(x, i, w * 1.01, gu, dn, a, b, scale)

    def lora_off(x, i, w, gu, dn, a=None, b=None, scale=1.0):
        return F.moe_experts(x, i, w, gu, dn, a, b, scale * 1.01)

    for wrong in (weights_off, lora_off):
        fp32 = _rows(wrong, "fp32 nf4")
        assert fp32 and not any(r.passed for r in fp32)


@pytest.mark.parametrize("double_quant", [False, True])
def test_each_expert_of_a_stack_is_its_own_nf4_weight(double_quant):
    w = torch.randn(3, 40, 24, dtype=torch.bfloat16)          # 960 values: 15 blocks of 64 per expert
    st = ExpertStack.quantize(w, double_quant=double_quant)
    for e in range(3):
        packed, state = F.nf4_quantize(w[e].contiguous(), double_quant=double_quant)
        assert torch.equal(st.qweight[e], packed)
        assert torch.equal(F.nf4_dequantize(st.qweight[e], st.expert_state(e), torch.float32),
                           F.nf4_dequantize(packed, state, torch.float32))


def test_an_expert_without_tokens_gets_zero_gradients():
    x, idx, w, gu, dn, gul, dnl, dy = moe_inputs(9, 64, 32, 5, 2, 4, torch.float32, nf4=True)
    assert not (idx == 4).any()                                # moe_inputs leaves the last expert empty
    leaves = [t.clone().requires_grad_() for t in (*gul, *dnl)]
    y = F.moe_experts(x, idx, w, gu, dn, tuple(leaves[:2]), tuple(leaves[2:]), 2.0)
    (y * dy.float()).sum().backward()
    for t in leaves:
        assert torch.equal(t.grad[4], torch.zeros_like(t.grad[4])) and t.grad[:4].abs().sum() > 0


def test_bad_shapes_are_named():
    x, idx, w, gu, dn, *_ = moe_inputs(5, 64, 32, 4, 2, 0, torch.float32, nf4=False)
    with pytest.raises(ValueError, match=r"x must be \[N, 64\]"):
        F.moe_experts(x[:, :10], idx, w, gu, dn)
    with pytest.raises(ValueError, match="expert_index and routing_weights"):
        F.moe_experts(x, idx, w[:, :1], gu, dn)
    with pytest.raises(ValueError, match="disagree"):
        F.moe_experts(x, idx, w, gu, gu)
