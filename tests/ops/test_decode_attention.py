"""fasttrain.ops.decode_attention (one query per row against a KV cache) against the float64 definition.

The op reads strided cache views, skips the keys a row does not attend, and serves the G query heads of
a KV head from one read of its keys and values. Oracle: softmax(scale·q·kᵀ over the valid keys)·v in
float64 from the same input values. Bound, per output element, for float32 sums (u = 2^-24) over D-term
dots and S-term sums: each score is off by at most D·u·Σ_d|q_d k_d|·scale (+ its rounding), which
moves every softmax weight by a relative 2·max δs (exp's own error adds 2u, Sleef's is 1 ulp), so the
output moves by at most (2·max δs + (S + 8)·u)·max|v| before its rounding to the output dtype
(u_out·|ref|). float64 inputs: the same with u = 2^-53.
"""
import pytest
import torch

from fasttrain.ops import decode_attention, decode_attention_backend, reference
from fasttrain.ops.kernels import use_kernels
from fasttrain.selftest.bounds import U



def _case(B, H, G, D, S, S_max, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, G, D, generator=g) * 2).to(dtype)
    cache = (torch.randn(2, B, H, S_max, D, generator=g) * 2).to(dtype)
    k, v = cache[0][:, :, :S], cache[1][:, :, :S]             # strided views of a longer cache
    valid_all = torch.rand(B, S_max, generator=g) > 0.3
    valid = valid_all[:, :S]
    valid[:, -1] = True                                        # the row's own new key
    return q, k, v, valid


def _check(o, q, k, v, valid, scale):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    u = U[acc]
    ref = reference.decode_attention(q.double(), k.double(), v.double(), valid, scale)
    q64, k64 = q.double(), k.double()
    D, S = q.shape[-1], k.shape[2]
    ds = D * u * (q64.abs() @ k64.abs().transpose(-1, -2)).amax(-1, keepdim=True) * scale    # [B, H, G, 1]
    vmax = v.double().abs().amax(dim=(2, 3))[:, :, None, None]
    bound = (2 * ds + (S + 8) * u) * vmax + U[q.dtype] * ref.abs()
    assert o.dtype == q.dtype and o.shape == q.shape
    err = (o.double() - ref).abs()
    assert (err <= bound).all(), (err - bound).max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", [(5, 3, 3, 64, 37, 50), (2, 2, 1, 128, 300, 310), (3, 1, 8, 32, 19, 19),
                                   (2, 2, 5, 40, 23, 30)], ids=["gqa3-d64", "mha-d128", "g8-d32", "g5-d40"])
def test_decode_attention_matches_the_float64_definition(dtype, shape):
    """Shapes: the compiled (G, head width) pairs and two the generic loops take (G 5, D 40: not a
    multiple of any vector width)."""
    q, k, v, valid = _case(*shape, dtype)
    assert decode_attention_backend(q) == "kernel"
    with torch.no_grad():
        o = decode_attention(q, k, v, valid, 0.125)
    _check(o, q, k, v, valid, 0.125)


def test_rows_without_keys_give_zeros_and_threads_give_the_same_bits():
    q, k, v, valid = _case(6, 2, 3, 64, 40, 40, torch.bfloat16, seed=3)
    valid[2] = False
    old = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(decode_attention(q, k, v, valid, 0.2))
    finally:
        torch.set_num_threads(old)
    assert torch.equal(outs[0], outs[1])
    assert (outs[0][2] == 0).all()
    keep = torch.ones(6, dtype=torch.bool)
    keep[2] = False
    _check(outs[0][keep], q[keep], k[keep], v[keep], valid[keep], 0.2)


def test_the_reference_and_sdpa_faces_agree_and_bad_inputs_are_named():
    q, k, v, valid = _case(2, 2, 2, 64, 9, 12, torch.float32, seed=5)
    with use_kernels("reference"):
        assert decode_attention_backend(q) == "reference"
        _check(decode_attention(q, k, v, valid, 0.3), q, k, v, valid, 0.3)
    qg = q.clone().requires_grad_(True)
    assert decode_attention_backend(qg) == "sdpa"           # with autograd: torch's, which has a backward
    o = decode_attention(qg, k, v, valid, 0.3)
    o.sum().backward()
    _check(o.detach(), q, k, v, valid, 0.3)
    with pytest.raises(RuntimeError, match="key_valid"):
        torch.ops.fasttrain.decode_attention(q, k, v, valid[:, :5], 0.3)
    with pytest.raises(RuntimeError, match="last dimension"):
        torch.ops.fasttrain.decode_attention(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, valid, 0.3)
