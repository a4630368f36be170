"""moe_experts' CUDA kernels (cuda/kernels/moe_experts.cuh: the grouping on the device, the grouped
projections with NF4 decoded inside, the fused SwiGLU and its backward, the factorised LoRA, the
combine, the routing weights' and the LoRA factors' gradients) on the emulator, forward and backward,
against the float64 reference (fasttrain.ops.reference.moe_experts and its autograd) and the peer
(the CPU kernel, or with FASTTRAIN_EMU_PEER=cuda the CUDA op on a GPU), under two schedules.

Shapes: the experts of Qwen3-30B-A3B (hidden 2048, moe_intermediate 768) and Qwen3.5-35B-A3B (hidden
2048, moe_intermediate 512), as the bundled configs give them, but 3-4 experts and 4 tokens so that
the emulator runs each case in seconds (its cost is the active experts times H·I, whatever their
tokens): 32 steps of 64 over the 2048-wide input, 24 and 16 gate/up tiles, 32 down tiles, partial
token tiles; a decode step (3 tokens, each to 8 of 10 experts: single-pair tiles in most experts) at
H = 200, I = 80, so that every tiling ends in a partial tile (200 = 3·64 + 8 outputs and reduction
columns, 80 = 2·32 + 16 gate/up pairs, 80 = 64 + 16 down columns); every case leaves its last expert without tokens (moe_inputs), whose LoRA gradients must come out
exactly zero.

Bounds: the selftest's (fasttrain/selftest/cases/moe.py, shared with tests/ops/test_moe_*.py): every output
is a chain of sums of products, so its error is at most (L + c)·u times the chain's magnitude with every factor
replaced by its absolute value, L the longest sums (H + 2I + 2r + k, plus N for a parameter's
gradient) and c the roundings on the way; the grouping (order, offsets) is compared exactly.
"""
from __future__ import annotations

import importlib

import pytest
import torch

from fasttrain.ops import reference as R
from fasttrain.selftest.cases.moe import moe_inputs, moe_magnitudes, moe_tolerance

from cuda_emu.emulator import assert_within, emu, peer

pytestmark = pytest.mark.cuda_emu
S = 2.0   # the adapters' scale
BS = 64   # NF4 blocksize
# (N, H, I, E, k, r, dtype, nf4)
CASES = {
    "qwen3-30b-a3b-nf4-fp32": (4, 2048, 768, 4, 2, 4, torch.float32, True),
    "qwen3.5-35b-a3b-bf16-stack": (4, 2048, 512, 3, 2, 4, torch.bfloat16, False),
    "decode-3-tokens-top8": (3, 200, 80, 10, 8, 4, torch.float32, True),
    # DeepSeek-V3's 256 experts, top 8, at a narrow width: 257 count bins run the rank and scan
    # kernels' bin loops (step 256) twice; 528 pairs run the position, SwiGLU and routing-gradient
    # grid-stride loops past the emulator's grid cap; H = 64 runs the routing gradient's lane loop twice
    "256-experts-top8": (66, 64, 32, 256, 8, 2, torch.float32, True),
    # 70 tokens over two experts (the third empty): 70 pairs an expert, so the LoRA gradients' reduction
    # over an expert's pairs (wgrad_kernel, kTK = 64 pairs a shared-memory step) takes a second, partial
    # step, and the barrier before the next step's tile load is needed
    "70-pairs-an-expert-lora": (70, 64, 32, 3, 2, 2, torch.float32, False),
}


def op_args(x, idx, w, gu, dn, gul, dnl):
    """The arguments of torch.ops.fasttrain.moe_experts after x, idx, w (what the face passes)."""
    stack = (lambda s: (s.qweight, s.absmax_fp32().contiguous()) if s.nf4 else (s.weight, None))
    (g, ga), (d, da) = stack(gu), stack(dn)
    return (g, ga, d, da, BS, dn.in_features, *(gul or (None, None)), *(dnl or (None, None)), S)


def reference(x, idx, w, gu, dn, gul, dnl, dy):
    """y and the gradients (x, routing weights, each LoRA factor) in float64 on the same inputs."""
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    l64 = [None if l is None else tuple(t.double().requires_grad_() for t in l) for l in (gul, dnl)]
    f64 = (lambda s: s if s.nf4 else type(s)(s.E, s.out_features, s.in_features, torch.float64,
                                               weight=s.weight.double()))
    y = R.moe_experts(x64, idx, w64, f64(gu), f64(dn), l64[0], l64[1], S)
    leaves = [x64, w64, *[t for l in l64 if l is not None for t in l]]
    grads = torch.autograd.grad((y * dy).sum(), leaves)
    return y.detach(), grads


_ORACLE: dict = {}


def case_data(case):
    """(inputs, float64 y and gradients, magnitudes) of a case, built once for both schedules."""
    if case not in _ORACLE:
        N, H, I, E, k, r, dtype, nf4 = CASES[case]
        ins = moe_inputs(N, H, I, E, k, r, dtype, nf4, seed=7)
        _ORACLE[case] = ins, reference(*ins), moe_magnitudes(*ins, S)
    return _ORACLE[case]


@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_backward_match_float64_and_the_peer(case, schedule):
    N, H, I, E, k, r, dtype, nf4 = CASES[case]
    (x, idx, w, gu, dn, gul, dnl, dy), (y64, grads64), (fwd, gmag) = case_data(case)
    rest = op_args(x, idx, w, gu, dn, gul, dnl)
    y, order, offsets, h, out = emu().moe_experts(x, idx, w, *rest, True)

    # the grouping: pairs stably sorted by expert, offsets the running counts (the last expert empty)
    flat = idx.reshape(-1)
    counts = torch.bincount(flat, minlength=E)
    assert counts[-1] == 0
    assert torch.equal(order, torch.argsort(flat, stable=True))
    assert torch.equal(offsets, torch.cat([counts.new_zeros(1), counts.cumsum(0)]))

    bound = moe_tolerance(fwd, y64, dtype, H, I, r, k)
    assert_within("y", y, y64, bound)
    p = peer()
    y_p = p.moe_experts(x, idx, w, *rest, False)[0]
    assert_within("y vs peer", y, y_p, 2 * bound)

    dy_x = dy.to(dtype)  # what autograd hands the backward: the gradient of y in y's dtype
    got = emu().moe_experts_backward(dy_x, x, idx, w, *rest, order, offsets, h, out, [True, True, True])
    names = ["x", "routing_weights", "gate_up_lora_A", "gate_up_lora_B", "down_lora_A", "down_lora_B"]
    for name, g, g64 in zip(names, got, grads64):
        tol = moe_tolerance(gmag[name], g64, dtype, H, I, r, k, 0 if name == "x" else N)
        assert_within("d" + name, g, g64, tol)
    # the empty expert's LoRA gradients: no pair, so exactly zero
    for g in got[2:]:
        assert torch.equal(g[-1], torch.zeros_like(g[-1]))
    # the peer's backward from its own forward's saved tensors
    _, po, poff, ph, pout = p.moe_experts(x, idx, w, *rest, True)
    got_p = p.moe_experts_backward(dy_x, x, idx, w, *rest, po, poff, ph, pout, [True, True, True])
    for name, g, gp, g64 in zip(names, got, got_p, grads64):
        tol = moe_tolerance(gmag[name], g64, dtype, H, I, r, k, 0 if name == "x" else N)
        assert_within("d" + name + " vs peer", g, gp, 2 * tol)


def small_inputs(seed=0, r=2):
    return moe_inputs(5, 64, 32, 4, 2, r, torch.float32, True, seed=seed)


@pytest.mark.parametrize("mask", [[False, True, False], [True, False, False], [False, False, True]],
                         ids=["weights-only", "x-only", "lora-only"])
def test_each_gradient_alone_matches_the_full_backward(mask, schedule):
    """An output_mask with one bit set skips the other gradients' kernels (each is [0]) and gives the
    one asked for bit for bit as the full backward does."""
    x, idx, w, gu, dn, gul, dnl, dy = small_inputs()
    rest = op_args(x, idx, w, gu, dn, gul, dnl)
    _, order, offsets, h, out = emu().moe_experts(x, idx, w, *rest, True)
    full = emu().moe_experts_backward(dy.float(), x, idx, w, *rest, order, offsets, h, out, [True, True, True])
    part = emu().moe_experts_backward(dy.float(), x, idx, w, *rest, order, offsets, h, out, mask)
    on = [mask[0], mask[1], mask[2], mask[2], mask[2], mask[2]]
    for i, (f, g) in enumerate(zip(full, part)):
        if on[i]:
            assert torch.equal(f, g), i
        else:
            assert g.numel() == 0, i


def test_an_expert_index_outside_the_stack_makes_its_token_nan_and_no_other():
    """The GPU cannot raise without a host sync: a pair routed outside [0, E) reaches no expert, its
    token's output is NaN, the other tokens are untouched, and offsets[E] counts the valid pairs."""
    x, idx, w, gu, dn, gul, dnl, _ = small_inputs(r=0)
    rest = op_args(x, idx, w, gu, dn, gul, dnl)
    y_ok = emu().moe_experts(x, idx, w, *rest, False)[0]
    bad = idx.clone()
    bad[2, 1] = 4
    y, order, offsets, _, _ = emu().moe_experts(x, bad, w, *rest, False)
    assert torch.isnan(y[2]).all()
    keep = torch.arange(5) != 2
    assert torch.equal(y[keep], y_ok[keep])  # same pairs, same order within each expert, same sums
    assert int(offsets[-1]) == bad.numel() - 1 and int(order[-1]) == 2 * 2 + 1


# (token, slot) of the pairs routed outside the stack, and their pair numbers (token x 8 + slot)
OUTSIDE = {
    "both-chunks": ([(10, 3), (60, 5)], [83, 485]),
    # chunk 0 has no outside pair, so no pair of it writes the outside bucket's count: that count is the
    # rank kernel's zero fill, second trip (bucket 256 = kChunk), and chunk 1's outside pair starts there
    "second-chunk-only": ([(60, 5)], [485]),
    "first-chunk-only": ([(10, 3)], [83]),
}


@pytest.mark.parametrize("where", list(OUTSIDE))
def test_pairs_outside_a_256_expert_stack_in_two_chunks_sort_last_in_order(where):
    """257 buckets (the last: pairs outside the stack) over two 256-pair chunks: the rank and scan
    kernels' bucket loops run a second trip for the outside bucket, whose per-chunk bases place the
    outside pairs last, in pair order, whichever chunks hold them."""
    N, H, I, E, k, r, dtype, nf4 = CASES["256-experts-top8"]
    x, idx, w, gu, dn, gul, dnl, _ = moe_inputs(N, H, I, E, k, 0, dtype, nf4, seed=7)
    rest = op_args(x, idx, w, gu, dn, None, None)
    y_ok = emu().moe_experts(x, idx, w, *rest, False)[0]
    bad = idx.clone()
    slots, pairs = OUTSIDE[where]
    for j, (n, s) in enumerate(slots):
        bad[n, s] = E + 44 * j  # E itself, then an index past it
    y, order, offsets, _, _ = emu().moe_experts(x, bad, w, *rest, False)
    bucket = bad.reshape(-1).clamp(max=E)
    assert torch.equal(order, torch.argsort(bucket, stable=True))
    assert order[-len(pairs):].tolist() == pairs and int(offsets[-1]) == bad.numel() - len(pairs)
    tokens = [n for n, _ in slots]
    assert bool(torch.isnan(y[tokens]).all())
    keep = torch.ones(N, dtype=torch.bool)
    keep[tokens] = False
    assert torch.equal(y[keep], y_ok[keep])


def test_no_tokens():
    x, idx, w, gu, dn, gul, dnl, _ = small_inputs()
    rest = op_args(x, idx, w, gu, dn, gul, dnl)
    y, order, offsets, h, out = emu().moe_experts(x[:0], idx[:0], w[:0], *rest, True)
    assert y.shape == (0, 64) and order.numel() == 0 and torch.equal(offsets, torch.zeros(5, dtype=torch.long))
    got = emu().moe_experts_backward(x[:0], x[:0], idx[:0], w[:0], *rest, order, offsets, h, out, [True, True, True])
    assert got[0].shape == (0, 64) and got[1].shape == (0, 2)
    for g, t in zip(got[2:], (*gul, *dnl)):   # a LoRA factor's gradient over no pairs: zeros of its shape
        assert torch.equal(g, torch.zeros_like(t))


def test_float64_is_refused_with_a_clear_error():
    x, idx, w, gu, dn, gul, dnl, _ = small_inputs()
    with pytest.raises(RuntimeError, match="float64: the CUDA kernels compute in float32"):
        emu().moe_experts(x.double(), idx, w, *op_args(x, idx, w, gu, dn, gul, dnl), False)


def test_the_face_sends_cuda_tensors_to_the_kernel_unless_told_or_unable(monkeypatch):
    """fasttrain.ops.moe_experts on CUDA: the kernel when this build registered it, the torch form
    for float64, under FASTTRAIN_MOE_CUDA=torch, and a clear error for an unknown value."""
    face = importlib.import_module("fasttrain.ops.moe_experts")
    x, idx, w, gu, dn, *_ = small_inputs()
    built = torch._C._dispatch_has_kernel_for_dispatch_key("fasttrain::moe_experts", "CUDA")
    assert face._cuda_kernel_runs(x, gu, dn) == built
    assert not face._cuda_kernel_runs(x.double(), gu, dn)
    monkeypatch.setenv(face.CUDA_FORM_VAR, "torch")
    assert not face._cuda_kernel_runs(x, gu, dn)
    monkeypatch.setenv(face.CUDA_FORM_VAR, "cublas")
    with pytest.raises(ValueError, match="FASTTRAIN_MOE_CUDA='cublas': allowed values are 'kernel'"):
        face._cuda_kernel_runs(x, gu, dn)
