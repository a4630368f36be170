"""fasttrain.ops.nf4_linear against PEFT's LoRA/DoRA on an nn.Linear holding the NF4 weight decoded by
table in float64 (forward and every gradient), for odd shapes and M in {1, 7, 64, 65, 300}; and against
fasttrain.ops.reference (the plain-PyTorch oracle) elsewhere.

bitsandbytes is used only for its format: its quantized bytes and absmax must equal ours. Its own
dequantize is never ground truth (its CPU kernel is wrong for some shapes on some AVX-512 hosts).
bitsandbytes and peft are imported by the tests that need them, so the others run where they are absent
(the GPU image has neither)."""
import pytest
import torch
from torch import nn

import fasttrain.ops as F
from fasttrain.ops import reference as R


def _bnb():
    return pytest.importorskip("bitsandbytes.functional")


def _peft():
    return pytest.importorskip("peft")


class OneLinear(nn.Module):
    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.proj = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
        with torch.no_grad():
            self.proj.weight.copy_(w)

    def forward(self, x):
        return self.proj(x)


def table_decode_float64(packed: torch.Tensor, absmax: torch.Tensor, shape, blocksize: int = 64) -> torch.Tensor:
    """The NF4 weight decoded by table, returned in float64: the format's value is the float32 product
    level[code] * absmax (one rounding, as bitsandbytes defines it), element 2j from the high nibble."""
    levels = torch.tensor(R.NF4_LEVELS, dtype=torch.float32)
    packed = packed.reshape(-1)
    n = shape[0] * shape[1]
    codes = torch.stack([packed >> 4, packed & 15], dim=1).reshape(-1)[:n].long()
    return (levels[codes] * absmax.float().repeat_interleave(blocksize)[:n]).double().view(shape)


def peft_reference(w64: torch.Tensor, a, b, m, r, alpha, dora: bool, rslora: bool = False):
    peft = _peft()
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=["proj"], use_dora=dora, use_rslora=rslora,
                          lora_dropout=0.0)
    model = peft.get_peft_model(OneLinear(w64), cfg)
    layer = model.base_model.model.proj
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(a)
        layer.lora_B["default"].weight.copy_(b)
        if dora:
            layer.lora_magnitude_vector["default"].weight.copy_(m)
    params = [layer.lora_A["default"].weight, layer.lora_B["default"].weight]
    if dora:
        params.append(layer.lora_magnitude_vector["default"].weight)
    return model.double(), params


SHAPES = [(37, 70, 5), (129, 96, 8), (64, 33, 3)]  # (out N, in K, r): odd N, odd K, K*N odd


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("M", [1, 7, 64, 65, 300])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_peft_float64(shape, M, dora):
    N, K, r = shape
    alpha = 2.0 * r + 1
    bnbf = _bnb()
    w = torch.randn(N, K)
    q, st = F.nf4_quantize(w, blocksize=64)
    q_bnb, st_bnb = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4")
    assert torch.equal(q, q_bnb.reshape(-1)), "our NF4 bytes must be bitsandbytes' bit for bit"
    assert torch.equal(st.absmax, st_bnb.absmax), "our absmax must be bitsandbytes' bit for bit"
    w64 = table_decode_float64(q, st.absmax, (N, K))
    assert torch.equal(F.nf4_dequantize(q, st, torch.float32).double(), w64)
    a = torch.randn(r, K, dtype=torch.float64) / K**0.5
    b = torch.randn(N, r, dtype=torch.float64) * 0.3
    m = (w64 + alpha / r * b @ a).norm(dim=1) * (1 + 0.2 * torch.rand(N, dtype=torch.float64))
    ref, ref_params = peft_reference(w64, a, b, m, r, alpha, dora)
    x = torch.randn(2, M, K, dtype=torch.float64) if M != 1 else torch.randn(M, K, dtype=torch.float64)
    x_ref = x.clone().requires_grad_(True)
    y_ref = ref(x_ref)
    xs, as_, bs, ms = (t.clone().requires_grad_(True) for t in (x, a, b, m))
    y = F.nf4_linear(xs, q, st, as_, bs, alpha / r, ms if dora else None)
    assert y.shape == y_ref.shape and y.dtype == torch.float64
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    gy = torch.randn_like(y)
    ours = torch.autograd.grad(y, [xs, as_, bs] + ([ms] if dora else []), gy)
    theirs = torch.autograd.grad(y_ref, [x_ref] + ref_params, gy)
    for name, g, g_ref in zip(["x", "A", "B", "m"], ours, theirs):
        torch.testing.assert_close(g, g_ref, rtol=1e-11, atol=1e-11, msg=lambda s: f"grad {name}: {s}")


def test_rslora_scale_matches_peft():
    N, K, r, alpha = 40, 64, 16, 8.0
    w = torch.randn(N, K)
    q, st = F.nf4_quantize(w)
    w64 = table_decode_float64(q, st.absmax, (N, K))
    a, b = torch.randn(r, K, dtype=torch.float64), torch.randn(N, r, dtype=torch.float64)
    ref, _ = peft_reference(w64, a, b, None, r, alpha, dora=False, rslora=True)
    x = torch.randn(5, K, dtype=torch.float64)
    torch.testing.assert_close(F.nf4_linear(x, q, st, a, b, alpha / r**0.5), ref(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_dora_factorised_norm_equals_explicit(shape):
    N, K, r = shape
    w = torch.randn(N, K)
    q, st = F.nf4_quantize(w)
    w64 = R.nf4_decode_weight(q, st, torch.float64)
    a, b, s = torch.randn(r, K, dtype=torch.float64), torch.randn(N, r, dtype=torch.float64), 1.7
    explicit = R.nf4_dora_norm(q, st, a, b, s)
    torch.testing.assert_close(F.nf4_dora_norm(q, st, a, b, s), explicit, rtol=1e-12, atol=0)
    wsq = F.nf4_weight_sq_norm(q, st)
    torch.testing.assert_close(wsq.double(), (w64**2).sum(1), rtol=1e-6, atol=0)  # fp32 storage of an fp64 sum
    # fp32 path with the cached ‖W‖²: error of fp32 arithmetic only (a few ulp of the norm)
    n32 = F.nf4_dora_norm(q, st, a.float(), b.float(), s, wsq)
    torch.testing.assert_close(n32.double(), explicit, rtol=2e-5, atol=0)


def test_fp32_and_bf16_inputs_within_derived_tolerance():
    # Tolerance: at most 2x PyTorch's own error for the same computation in that dtype vs float64.
    N, K, r, M = 96, 200, 8, 33
    w = torch.randn(N, K)
    q, st = F.nf4_quantize(w)
    w64 = R.nf4_decode_weight(q, st, torch.float64)
    a, b, s = torch.randn(r, K) / 10, torch.randn(N, r) / 10, 2.0
    x = torch.randn(M, K)
    for dt in (torch.float32, torch.bfloat16):
        xd = x.to(dt)
        ref_d = R.nf4_linear(xd.double(), q, st, a.double(), b.double(), s)  # the float64 oracle
        torch_err = ((xd @ w64.to(dt).T + s * (xd @ a.to(dt).T) @ b.to(dt).T).double() - ref_d).abs().max()
        ours = F.nf4_linear(xd, q, st, a, b, s)
        assert ours.dtype == dt
        err = (ours.double() - ref_d).abs().max()
        assert err <= 2 * torch_err + 1e-7, (dt, err, torch_err)


def test_base_only_and_leading_dims():
    w = torch.randn(24, 40)
    q, st = F.nf4_quantize(w)
    x = torch.randn(2, 3, 5, 40, dtype=torch.float64)
    y = F.nf4_linear(x, q, st)
    torch.testing.assert_close(y, R.nf4_linear(x, q, st), rtol=1e-13, atol=1e-13)
    assert y.shape == (2, 3, 5, 24)


def test_double_quant_state():
    w = torch.randn(64, 300)
    q, st = F.nf4_quantize(w, double_quant=True)
    x = torch.randn(9, 300, dtype=torch.float64)
    torch.testing.assert_close(F.nf4_linear(x, q, st), R.nf4_linear(x, q, st), rtol=1e-13, atol=1e-13)


def test_bad_inputs_name_the_argument():
    w = torch.randn(16, 32)
    q, st = F.nf4_quantize(w)
    with pytest.raises(ValueError, match="x must have shape"):
        F.nf4_linear(torch.randn(3, 31), q, st)
    with pytest.raises(ValueError, match="together"):
        F.nf4_linear(torch.randn(3, 32), q, st, torch.randn(2, 32), None)
    with pytest.raises(RuntimeError, match="lora_b"):
        F.nf4_linear(torch.randn(3, 32), q, st, torch.randn(2, 32), torch.randn(16, 3))
    with pytest.raises(RuntimeError, match="dora_m"):
        F.nf4_linear(torch.randn(3, 32), q, st, torch.randn(2, 32), torch.randn(16, 2), 1.0, torch.randn(15))
    with pytest.raises(RuntimeError, match="x"):
        F.nf4_linear(torch.randn(3, 32, dtype=torch.float64).to(torch.int64).float().long(), q, st)


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_opcheck(dora):
    N, K, r, M = 24, 40, 4, 6
    q, st = F.nf4_quantize(torch.randn(N, K))
    args = (torch.randn(M, K, requires_grad=True), q, st.absmax, 64, N, torch.randn(r, K, requires_grad=True),
            torch.randn(N, r, requires_grad=True), 0.5, torch.rand(N, requires_grad=True) if dora else None, None)
    torch.library.opcheck(torch.ops.fasttrain.nf4_linear.default, args)


def test_torch_compile_fullgraph():
    N, K, r = 24, 40, 4
    q, st = F.nf4_quantize(torch.randn(N, K))
    a, b = torch.randn(r, K, requires_grad=True), torch.randn(N, r, requires_grad=True)
    fn = torch.compile(lambda x: F.nf4_linear(x, q, st, a, b, 0.5).sum(), fullgraph=True, backend="eager")
    x = torch.randn(5, K, dtype=torch.float32)
    out = fn(x)
    torch.testing.assert_close(out, F.nf4_linear(x, q, st, a, b, 0.5).sum())


@pytest.mark.cuda
@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("M", [1, 7, 48, 64, 65, 300])
def test_cuda_matches_cpu(M, dora):
    # CUDA computes in the input dtype (bf16 here) with fp32 accumulation: compare with the fp64 CPU
    # op within 2x torch's own bf16 error on the same computation.
    N, K, r = 1000, 584, 16
    w = torch.randn(N, K)
    q, st = F.nf4_quantize(w)
    a, b, s = torch.randn(r, K) / 20, torch.randn(N, r) / 20, 2.0
    m = torch.rand(N) + 5 if dora else None
    x = torch.randn(M, K).bfloat16()
    ref = F.nf4_linear(x.double(), q, st, a.double(), b.double(), s, None if m is None else m.double())
    w64 = F.nf4_dequantize(q, st, torch.float32).double()
    xc = x.cuda()
    y = F.nf4_linear(xc, q.cuda(), st.to("cuda"), a.cuda(), b.cuda(), s, None if m is None else m.cuda())
    wb = w64.to(torch.bfloat16).cuda()
    base = xc @ wb.T + (s * (xc.float() @ a.cuda().T) @ b.cuda().T).bfloat16()
    if dora:
        n = (w64 + s * b.double() @ a.double()).norm(dim=1)
        base = base * (m.double() / n).cuda().bfloat16()
    torch_err = (base.double().cpu() - ref).abs().max()
    assert (y.double().cpu() - ref).abs().max() <= 2 * torch_err + 1e-6


@pytest.mark.parametrize("N,K", [(37, 48), (37, 96), (5, 200), (130, 64)])
def test_bf16_weights_are_the_fp32_decode_rounded_once(N, K):
    """In bf16 the kernel decodes W straight to bf16 (a vector path on AVX2 hosts, scalar elsewhere):
    each value must be level·absmax formed in fp32 and rounded to nearest even once, whatever the
    path. Read back exactly through an identity input (one nonzero product per output; M = K <= 64
    takes the tiled decode, M > 64 the whole-matrix one). Rows of K = 48, 200 start blocks mid-row,
    so the 16-value vector steps meet block ends at every offset."""
    torch.manual_seed(K)
    w = torch.randn(N, K) * torch.linspace(0.1, 3.0, N)[:, None]
    q, st = F.nf4_quantize(w)
    eye = torch.eye(K, dtype=torch.bfloat16)
    got = F.nf4_linear(eye, q, st)                                   # [K, N] = Wᵀ
    want = R.nf4_dequantize(q, st, torch.float32).to(torch.bfloat16)
    assert torch.equal(got.t(), want)
