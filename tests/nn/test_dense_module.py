"""fasttrain.nn.DenseLinear (policy.quantize = "none"): forward and backward against a float64
reference with tolerances from unit roundoff, on both of a bf16 model's base paths (the native bf16
GEMM, and fp32 sums where the CPU has no native bf16 GEMM: each forced in turn), a fresh adapter
that changes nothing bit for bit,
the model-level surgery (adapters off is the plain model, merge, resident bytes), and PEFT loading
our saved adapter on the plain Hugging Face model."""
import copy
import json

import pytest
import torch
from torch import nn

import fasttrain.nn.dense_linear as dl
from fasttrain.nn import (DenseLinear, NF4Linear, adaptable_model, adapted_layers, adapters_disabled,
                          attach_adapters, load_adapter, merge_adapters, resident_bytes, save_adapter)

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

U = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}


# (dtype, base path): fp64 and fp32 models have one path; a bf16 model runs the native bf16 GEMM or,
# on a CPU without one, fp32 sums (fasttrain.nn.dense_linear.fp32_base), each forced here by the flag
# the module reads, so every host runs both.
PATHS = [(torch.float64, "native"), (torch.float32, "native"), (torch.bfloat16, "native"), (torch.bfloat16, "fp32")]
PATH_IDS = ["fp64", "fp32", "bf16-native", "bf16-fp32-sums"]


@pytest.fixture
def base_path(monkeypatch):
    def force(path: str):
        monkeypatch.setattr(dl, "_NATIVE_BF16", path == "native")
    return force


def gamma(n: int, u: float) -> float:
    return n * u / (1 - n * u)


def tiny_model(bias: bool = False, dtype=torch.float32):
    torch.manual_seed(0)
    kw = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw)) if bias else \
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    return model.to(dtype).eval()


def randomise(layer_or_model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in layer_or_model.modules():
            if isinstance(m, (DenseLinear, NF4Linear)) and m.adapter:
                m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.05)
                if m.lora_magnitude is not None:
                    m.lora_magnitude.mul_(1 + 0.1 * torch.rand(m.lora_magnitude.shape, generator=g))


def reference(x, w, b, a, bb, m, s, kind, z=None):
    """y = g ⊙ (z + s·(x·Aᵀ)·Bᵀ) + b in float64, z = x·Wᵀ unless given, g = m/‖W + s·B·A‖ detached."""
    z = x @ w.T if z is None else z
    y = z + s * ((x @ a.T) @ bb.T)
    if kind == "dora":
        with torch.no_grad():
            norm = (w + s * (bb @ a)).norm(dim=1)
        y = (m / norm) * y
    return y if b is None else y + b


@pytest.mark.parametrize("dtype,path", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("kind", ["lora", "dora"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_forward_and_backward_match_float64(dtype, path, kind, bias, base_path):
    """Every product of the adapter and the DoRA scale runs in fp32 (fp64 for an fp64 model) and the
    result is rounded once to the model's dtype, so against a float64 reference an output is off by
    at most u_out·|y| + γ_n(u_c)·(magnitudes of the sums), n covering the longest chain of sums
    (x·Wᵀ over K, x·Aᵀ over K then ·Bᵀ over r, the row norm over K of r-term products, and the
    backward's sums over N and the M rows). A bf16 model's base term x·Wᵀ is its own bf16 GEMM,
    whose accumulation differs by host, or its fp32 sums: the bf16 reference starts from that same
    term (the fp32 path's own bound is test_fp32_sums_base_matches_float64)."""
    base_path(path)
    M, K, N, r, s = 7, 80, 48, 4, 2.0
    torch.manual_seed(0)
    lin = nn.Linear(K, N, bias=bias).to(dtype)
    layer = DenseLinear.from_linear(lin)
    layer.attach_adapter(kind, r=r, alpha=r * s)
    randomise(layer)
    x = torch.randn(M, K, dtype=dtype, requires_grad=True)
    y = layer(x)
    assert y.dtype == dtype
    dy = torch.randn(M, N, dtype=dtype)
    y.backward(dy)

    d = torch.float64
    w64 = lin.weight.detach().to(d)
    b64 = lin.bias.detach().to(d) if bias else None
    leaves = [t.detach().to(d).requires_grad_() for t in (x, layer.lora_A, layer.lora_B)]
    m64 = layer.lora_magnitude.detach().to(d).requires_grad_() if kind == "dora" else None
    z = None
    if dtype == torch.bfloat16:               # the layer's own bf16 base term, bias removed (exact in fp32)
        with torch.no_grad():
            z = (dl.base_term(x, lin.weight, lin.bias).to(d) - (b64 if bias else 0)).requires_grad_(False)
    ref = reference(leaves[0], w64, b64, leaves[1], leaves[2], m64, s, kind, z)
    ref.backward(dy.to(d))
    with torch.no_grad():                    # the same computation on absolute values: the sums' magnitudes
        absv = [t.detach().abs().requires_grad_() for t in leaves]
        am = m64.detach().abs().requires_grad_() if kind == "dora" else None
    mag = reference(absv[0], w64.abs(), b64.abs() if bias else None, absv[1], absv[2], am, s, kind,
                    None if z is None else z.abs())
    mag.backward(dy.to(d).abs())

    uc = U[torch.float64 if dtype == torch.float64 else torch.float32]
    g = gamma(2 * (K + N + r + M) + 16, uc)
    bound = U[dtype] * ref.detach().abs() + g * mag.detach()
    err = (y.detach().to(d) - ref.detach()).abs()
    assert (err <= bound).all(), (err - bound).max()
    grads = {"A": (layer.lora_A.grad, leaves[1], absv[1]), "B": (layer.lora_B.grad, leaves[2], absv[2])}
    if kind == "dora":
        grads["m"] = (layer.lora_magnitude.grad, m64, am)
    if dtype != torch.bfloat16:              # a bf16 x's gradient goes through the bf16 GEMM's backward
        grads["x"] = (x.grad, leaves[0], absv[0])
    for name, (got, want, size) in grads.items():
        # fp32 masters' gradients are rounded to fp32 once more
        tol = U[torch.float32] * want.grad.abs() + g * size.grad
        assert ((got.to(d) - want.grad).abs() <= tol).all(), (name, ((got.to(d) - want.grad).abs() - tol).max())
    if kind == "dora":                       # the bound is tight enough to see DoRA's scale left out
        with torch.no_grad():
            wrong = reference(leaves[0], w64, b64, leaves[1], leaves[2], None, s, "lora", z)
        assert ((wrong - ref.detach()).abs() > bound).any()


@pytest.mark.parametrize("dtype,path", PATHS[1:], ids=PATH_IDS[1:])
@pytest.mark.parametrize("kind", ["lora", "dora"])
@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
def test_a_fresh_adapter_leaves_the_linear_unchanged_bit_for_bit(dtype, path, kind, grad, base_path):
    """B = 0 and m = the row norms the first ‖W + s·B·A‖ gives (g = 1 exactly): the adapter adds exact
    zeros to the layer's base term, so the output is the original nn.Linear's, bit for bit (on the
    fp32-sums path: the same F.linear in fp32 from the same bf16 values, rounded once)."""
    base_path(path)
    torch.manual_seed(0)
    lin = nn.Linear(576, 1536, bias=True).to(dtype)
    x = torch.randn(33, 576, dtype=dtype)
    with torch.no_grad():
        want = lin(x) if path == "native" else \
            nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float()).to(dtype)
    layer = DenseLinear.from_linear(lin)
    layer.attach_adapter(kind, r=8, alpha=16)
    with torch.set_grad_enabled(grad):
        y = layer(x)
    assert y.dtype == want.dtype and torch.equal(y, want), (y.float() - want.float()).abs().max()


def test_the_base_path_follows_the_extension():
    """fp32 sums exactly where the extension says bf16 GEMMs are not native on this CPU."""
    from fasttrain.host import cpu_bf16_compute
    x, w = torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(3, 4, dtype=torch.bfloat16)
    assert dl.fp32_base(x, w) == (not cpu_bf16_compute())
    assert not dl.fp32_base(x.float(), w.float())


def test_fp32_sums_base_matches_float64(base_path):
    """The fp32-sums base of a bf16 layer (forward and the gradient to x, both rounded once to bf16)
    against float64 from the same bf16 values: |err| <= u_bf16·|y| + γ_K(u_fp32)·(|x|·|W|ᵀ) forward,
    K = in_features, and the same with N = out_features for dy·W. It must also be closer than the
"""
    base_path("fp32")
    torch.manual_seed(0)
    M, K, N = 9, 576, 1536
    w = torch.randn(N, K, dtype=torch.bfloat16) * 0.05
    b = torch.randn(N, dtype=torch.bfloat16)
    x = torch.randn(M, K, dtype=torch.bfloat16, requires_grad=True)
    y = dl.dense_linear(x, w, b)
    assert y.dtype == torch.bfloat16
    dy = torch.randn(M, N, dtype=torch.bfloat16)
    y.backward(dy)
    d = torch.float64
    ref = x.detach().to(d) @ w.to(d).T + b.to(d)
    mag = x.detach().to(d).abs() @ w.to(d).abs().T + b.to(d).abs()
    bound = U[torch.bfloat16] * ref.abs() + gamma(K + 1, U[torch.float32]) * mag
    assert ((y.to(d) - ref).abs() <= bound).all()
    gref = dy.to(d) @ w.to(d)
    gmag = dy.to(d).abs() @ w.to(d).abs()
    gbound = U[torch.bfloat16] * gref.abs() + gamma(N, U[torch.float32]) * gmag
    assert ((x.grad.to(d) - gref).abs() <= gbound).all()
    # the rollout's no-grad form: the same sums, the head's slices (rows > UPCAST_ROWS)
    wide = torch.randn(dl.UPCAST_ROWS + 100, K, dtype=torch.bfloat16)
    logits = dl.linear_bf16_as_fp32(x.detach(), wide, torch.float32)
    lref = x.detach().to(d) @ wide.to(d).T
    lbound = gamma(K, U[torch.float32]) * (x.detach().to(d).abs() @ wide.to(d).abs().T)
    assert logits.dtype == torch.float32 and ((logits.to(d) - lref).abs() <= lbound).all()


def test_surgery_shares_the_weights_and_adapters_off_is_the_plain_model():
    plain = tiny_model(bias=True)
    model = adaptable_model(copy.deepcopy(plain))
    layers = dict(adapted_layers(model))
    assert len(layers) == 7 * 2 and all(isinstance(m, DenseLinear) for m in layers.values())
    assert not any(p.requires_grad for p in model.parameters())
    params = attach_adapters(model, "dora", r=4, alpha=8, seed=0)
    assert {id(p) for p in model.parameters() if p.requires_grad} == {id(p) for p in params}
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        want = plain(ids).logits
        assert torch.equal(model(ids).logits, want)          # a fresh adapter changes nothing
        randomise(model)
        adapted = model(ids).logits
        assert (adapted - want).abs().max() > 1e-3
        with adapters_disabled(model):
            assert torch.equal(model(ids).logits, want)      # the reference policy is the plain model
        merged = merge_adapters(copy.deepcopy(model), dtype=torch.float32)
        assert not any(isinstance(m, DenseLinear) for m in merged.modules())
        torch.testing.assert_close(merged(ids).logits, adapted, rtol=1e-4, atol=1e-4)
    model(ids).logits.float().square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params)


def test_resident_bytes_are_the_models_own():
    plain = tiny_model(dtype=torch.bfloat16)
    own = sum(p.numel() * p.element_size() for p in plain.parameters()) + \
        sum(b.numel() * b.element_size() for b in plain.buffers())
    model = adaptable_model(plain)
    rep = resident_bytes(model)
    assert rep["model.layers.0.self_attn.q_proj"] == {"base": 64 * 64 * 2, "adapter": 0, "weights": 64 * 64,
                                                      "bits_per_weight": 16.0}
    assert rep["total"]["base"] + rep["total"]["other"] == own
    attach_adapters(model, "lora", r=4, alpha=8)
    assert resident_bytes(model)["model.layers.0.mlp.up_proj"]["adapter"] == 4 * (4 * 64 + 96 * 4)


@pytest.mark.parametrize("kind", ["lora", "dora"])
@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qwen2-bias"])
def test_peft_loads_our_adapter_on_the_plain_model(tmp_path, kind, bias):
    """Saved in PEFT's format, loaded by PEFT onto the plain fp64 model: the same logits. Both compute
    in fp64 from the same fp32 adapter values; they differ only in the order of roundings, each at
    most u64 relative to the sums' magnitudes, through 2 layers of 7 projections and the head."""
    plain = tiny_model(bias, torch.float64)
    model = adaptable_model(copy.deepcopy(plain))
    attach_adapters(model, kind, r=4, alpha=8, seed=0)
    randomise(model)
    save_adapter(model, tmp_path, base_model="tiny")
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["use_dora"] == (kind == "dora") and cfg["r"] == 4 and cfg["lora_alpha"] == 8
    ref = peft.PeftModel.from_pretrained(copy.deepcopy(plain), tmp_path).eval()
    ids = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        ours, theirs = model(ids).logits, ref(ids).logits
    # sums of at most (hidden + intermediate + vocab) terms per product, 2 layers x 7 products + head,
    # relative to logits of order 1
    n = 2 * 7 * (64 + 96 + 97)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=gamma(n, U[torch.float64]) * 16 * ours.abs().max().item())
    model2 = adaptable_model(copy.deepcopy(plain))
    load_adapter(model2, tmp_path)
    with torch.no_grad():
        assert torch.equal(model2(ids).logits, ours)
