"""fasttrain.nn: NF4Linear, quantize_model / attach_adapters / adapters_disabled / merge_adapters /
resident_bytes, and PEFT-format save/load checked by PEFT itself, on a tiny random Llama."""
import copy
import json

import pytest
import torch
from torch import nn

import fasttrain.ops as F
from fasttrain.nn import (NF4Linear, adapters_disabled, attach_adapters, load_adapter, merge_adapters,
                          quantize_model, resident_bytes, save_adapter)

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def tiny_llama(bias: bool = False):
    torch.manual_seed(0)
    if bias:
        cfg = transformers.Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        return transformers.Qwen2ForCausalLM(cfg).eval()
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).eval()


def dequantised_float_copy(qmodel: nn.Module, like: nn.Module) -> nn.Module:
    """A float model whose targeted Linear weights are our NF4 weights dequantised (the PEFT base)."""
    ref = copy.deepcopy(like)
    for name, layer in qmodel.named_modules():
        if isinstance(layer, NF4Linear):
            lin = ref.get_submodule(name)
            with torch.no_grad():
                lin.weight.copy_(layer.dequantized_weight(torch.float32))
    return ref


def randomise_adapters(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, NF4Linear) and m.adapter:
                m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.05)
                if m.lora_magnitude is not None:
                    m.lora_magnitude.mul_(1 + 0.1 * torch.rand(m.lora_magnitude.shape, generator=g))


def test_nf4linear_from_linear_and_init_equals_base():
    lin = nn.Linear(70, 37, bias=True)
    layer = NF4Linear.from_linear(lin)
    w = layer.dequantized_weight(torch.float32)
    assert (w - lin.weight).abs().max() <= lin.weight.abs().max() * 0.2  # NF4 rounding, coarse sanity
    x = torch.randn(3, 4, 70)
    base = x @ w.T + lin.bias
    torch.testing.assert_close(layer(x), base, rtol=1e-5, atol=1e-5)
    for kind in ("lora", "dora"):
        params = layer.attach_adapter(kind, r=8, alpha=16)
        assert all(p.dtype == torch.float32 and p.requires_grad for p in params)
        assert torch.count_nonzero(layer.lora_B) == 0 and layer.scale == 2.0
        bound = 1 / 70**0.5  # PEFT: kaiming_uniform_(a=sqrt(5)) -> U(-1/sqrt(in), 1/sqrt(in))
        assert layer.lora_A.abs().max() <= bound and layer.lora_A.abs().max() > 0.9 * bound
        if kind == "dora":
            torch.testing.assert_close(layer.lora_magnitude, w.double().norm(dim=1).float(), rtol=1e-6, atol=0)
        torch.testing.assert_close(layer(x), base, rtol=1e-5, atol=1e-5)
    layer.attach_adapter("lora", r=16, alpha=8, rslora=True)
    assert layer.scale == 2.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M", [5, 100], ids=["decode-M5", "gemm-M100"])
@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
def test_dora_at_init_equals_the_base_bit_for_bit(dtype, M, grad):
    """At initialisation (B = 0, m = ‖W‖) DoRA's scale m/‖W + s·B·A‖ is exactly 1 and the base term is
    computed as without adapters, so the output equals the base bit for bit, in the training forward
    (grad) and the cached rollout path (no grad). Formed as m · (1/‖W‖) the scale is 1 ± 1 ulp on some
    rows, which moves fp32 outputs by an ulp and flips the bf16 rounding of some of them."""
    torch.manual_seed(0)
    layer = NF4Linear.from_linear(nn.Linear(576, 1536).to(dtype))
    layer.attach_adapter("dora", r=8, alpha=16)
    x = torch.randn(M, 576, dtype=dtype)
    with torch.no_grad():
        layer.adapters_enabled = False
        base = layer(x)
        layer.adapters_enabled = True
    with torch.set_grad_enabled(grad):
        y = layer(x)
    assert y.dtype == base.dtype and torch.equal(y, base), (y.float() - base.float()).abs().max()
    # and the same layout: a transposed output would send attention down another kernel downstream
    assert y.is_contiguous() and y.stride() == base.stride()


def test_gradients_flow_only_to_adapters():
    model = quantize_model(tiny_llama())
    params = attach_adapters(model, "dora", r=4, alpha=8)
    assert len(params) == 2 * 3 * 7 and all(p.requires_grad for p in params)
    assert {id(p) for p in model.parameters() if p.requires_grad} == {id(p) for p in params}
    ids = torch.randint(0, 97, (2, 9))
    model(ids).logits.float().square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params)
    assert any(p.grad.abs().sum() > 0 for p in params if p.dim() == 1)  # magnitudes get gradient


@pytest.mark.parametrize("kind", ["lora", "dora"])
@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qwen2-bias"])
def test_model_matches_peft_and_peft_loads_our_adapter(tmp_path, kind, bias):
    float_model = tiny_llama(bias).double()
    model = quantize_model(copy.deepcopy(float_model))
    n_layers = sum(isinstance(m, NF4Linear) for m in model.modules())
    assert n_layers == 7 * 2
    attach_adapters(model, kind, r=4, alpha=8, seed=0)
    randomise_adapters(model)
    save_adapter(model, tmp_path, base_model="tiny")
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["use_dora"] == (kind == "dora") and cfg["r"] == 4 and cfg["lora_alpha"] == 8
    ref = peft.PeftModel.from_pretrained(dequantised_float_copy(model, float_model), tmp_path).eval()
    ids = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        ours = model(ids).logits
        theirs = ref(ids).logits
    # model in fp64 except our fp32 adapter masters (the op computes fp64 since x is fp64): tight bound
    torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-9)
    # ... and PEFT saving its own model gives the same keys we write
    ref.save_pretrained(tmp_path / "peft")
    from safetensors.torch import load_file
    assert set(load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))) == \
        set(load_file(str(tmp_path / "adapter_model.safetensors")))
    # round trip through our own loader
    model2 = quantize_model(copy.deepcopy(float_model))
    load_adapter(model2, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(model2(ids).logits, ours, rtol=0, atol=0)


def test_adapters_disabled_is_the_base_and_merge_exports_plain_model():
    float_model = tiny_llama()
    model = quantize_model(copy.deepcopy(float_model))
    base_float = dequantised_float_copy(model, float_model)
    ids = torch.randint(0, 97, (2, 7))
    with torch.no_grad():
        base_logits = model(ids).logits
        torch.testing.assert_close(base_logits, base_float(ids).logits, rtol=1e-5, atol=1e-5)
        attach_adapters(model, "dora", r=4, alpha=8)
        randomise_adapters(model)
        adapted = model(ids).logits
        assert (adapted - base_logits).abs().max() > 1e-3
        with adapters_disabled(model):
            assert torch.equal(model(ids).logits, base_logits)
        with torch.enable_grad():  # the training path (norm recomputed in the op) equals the cached one
            torch.testing.assert_close(model(ids).logits.detach(), adapted, rtol=1e-5, atol=1e-5)
        with torch.no_grad():  # the cache follows an in-place update of B
            q = model.model.layers[0].self_attn.q_proj
            q.lora_B.mul_(2.0)
            moved = model(ids).logits
            with torch.enable_grad():
                torch.testing.assert_close(model(ids).logits.detach(), moved, rtol=1e-5, atol=1e-5)
            q.lora_B.mul_(0.5)
        torch.testing.assert_close(model(ids).logits, adapted, rtol=0, atol=0)
        merged = merge_adapters(copy.deepcopy(model), dtype=torch.float32)
        assert not any(isinstance(m, NF4Linear) for m in merged.modules())
        torch.testing.assert_close(merged(ids).logits, adapted, rtol=1e-4, atol=1e-4)
        bf = merge_adapters(copy.deepcopy(model))
        assert bf.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16


def test_resident_bytes_report():
    model = quantize_model(tiny_llama(), double_quant=True)
    rep = resident_bytes(model)
    q = rep["model.layers.0.self_attn.q_proj"]
    assert q["weights"] == 64 * 64 and q["adapter"] == 0
    # 4 bits + 8-bit absmax per 64 + one fp32 absmax2 per 256 blocks + code (1 KiB) + offset
    assert q["base"] == 64 * 64 // 2 + 64 + 4 + 1024 + 4
    attach_adapters(model, "lora", r=4, alpha=8)
    assert resident_bytes(model)["model.layers.0.mlp.up_proj"]["adapter"] == 4 * (4 * 64 + 96 * 4)


def test_quantize_model_rejects_missing_targets():
    with pytest.raises(ValueError, match="no nn.Linear"):
        quantize_model(tiny_llama(), targets=("nope",))
    with pytest.raises(ValueError, match="kind"):
        attach_adapters(quantize_model(tiny_llama()), "ia3")
