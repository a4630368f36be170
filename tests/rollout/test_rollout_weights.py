"""Dense rollout weights (merged base + adapter copies): the rollout on them equals the rollout on
the adapted modules, NF4 or 16-bit (float64: to rounding; same tokens), they follow the adapters
after an update, adapters switched off give the base, and merging never writes into the base."""
import pytest
import torch

from fasttrain.models import tiny_llama
from fasttrain.nn import RolloutWeights, adaptable_model, attach_adapters, quantize_model
from fasttrain.rollout import sample

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 10]]


QUANTIZE = pytest.mark.parametrize("quantize", ["nf4", "none"])


def adapted(kind: str, quantize: str = "nf4"):
    model = tiny_llama(vocab_size=128, seed=1, dtype=torch.float64)
    quantize_model(model) if quantize == "nf4" else adaptable_model(model)
    torch.manual_seed(4)
    params = attach_adapters(model, kind=kind, r=4, alpha=8)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn_like(p) * 0.2)      # B != 0 (and m moved): the adapters matter
    return model, params


def run(model, weights, seed=3):
    return sample(model, PROMPTS, group_size=2, max_new_tokens=10, temperature=1.0, eos_token_ids=[],
                  seed=seed, pad_token_id=0, weights=weights)


@QUANTIZE
@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_rollout_on_dense_weights_equals_the_adapted_modules_in_float64(kind, quantize):
    model, params = adapted(kind, quantize)
    base = [m.base_weight() for m in model.modules() if hasattr(m, "base_weight")]
    w = RolloutWeights(model)
    a, b = run(model, None), run(model, w)
    assert torch.equal(a.completion_ids, b.completion_ids)
    # float64: the two sum W·x + s·B·(A·x) and (W + s·B·A)·x in different orders
    torch.testing.assert_close(b.logprobs, a.logprobs, rtol=0, atol=1e-9)
    # q/k/v and gate/up are one stacked weight per layer
    layer = model.model.layers[0]
    qkv = w.fused((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj))
    assert qkv is not None and qkv.shape == (64 + 32 + 32, 64)
    w.refresh()
    assert all(torch.equal(a, m.base_weight()) for a, m in zip(base, [m for m in model.modules()
                                                                     if hasattr(m, "base_weight")]))


@QUANTIZE
def test_dense_weights_follow_the_adapters_and_adapters_off(quantize):
    from fasttrain.nn import adapters_disabled
    model, params = adapted("lora", quantize)
    w = RolloutWeights(model)
    assert w.refresh() == 0                          # nothing changed since construction
    before = run(model, w).logprobs
    with torch.no_grad():
        params[1].mul_(3.0)                          # one layer's B: an optimizer step on it
    # not yet refreshed: the rollout reads the dense copy, not the modules
    torch.testing.assert_close(run(model, w).logprobs, before, rtol=0, atol=0)
    assert w.refresh() == 1                          # only that layer is merged again
    after_nf4, after_dense = run(model, None), run(model, w)
    assert not torch.allclose(after_dense.logprobs, before)
    torch.testing.assert_close(after_dense.logprobs, after_nf4.logprobs, rtol=0, atol=1e-9)
    with adapters_disabled(model):
        w.refresh()
        torch.testing.assert_close(run(model, w).logprobs, run(model, None).logprobs, rtol=0, atol=1e-9)


@QUANTIZE
@pytest.mark.parametrize("dense", [False, True])
def test_compiled_decode_samples_the_eager_tokens(dense, quantize):
    """The static-shape decode step (written column as a tensor, every cache column read under the
    key mask, cache length rounded up) traced by torch.compile gives eager's tokens under the same
    seed, twice in a row (the kept cache is reused), on the adapted modules (NF4 and 16-bit) and on
    dense weights.
    The "aot_eager" backend runs the traced, functionalised graph without code generation
    (inductor's C++ build takes minutes on a small CI machine; bench_rollout measures it)."""
    import torch._dynamo
    torch._dynamo.reset()
    backend = "aot_eager"
    model, params = adapted("dora" if quantize == "none" else "lora", quantize)
    w = RolloutWeights(model) if dense else None
    ref = run(model, w)
    for seed in (3, 3):
        got = sample(model, PROMPTS, group_size=2, max_new_tokens=10, temperature=1.0, eos_token_ids=[],
                     seed=seed, pad_token_id=0, weights=w, compile=backend)
        assert torch.equal(got.completion_ids, ref.completion_ids)
        # float64: masked columns add exact zeros; only the reduction order may differ
        torch.testing.assert_close(got.logprobs, ref.logprobs, rtol=0, atol=1e-9)
    other = sample(model, PROMPTS[:2], group_size=3, max_new_tokens=4, temperature=1.0, eos_token_ids=[2],
                   seed=5, pad_token_id=0, weights=w, compile=backend)
    plain = sample(model, PROMPTS[:2], group_size=3, max_new_tokens=4, temperature=1.0, eos_token_ids=[2],
                   seed=5, pad_token_id=0, weights=w)
    assert torch.equal(other.completion_ids, plain.completion_ids)     # a new batch shape: a new cache


def test_rollout_base_weights_setting_picks_the_weights():
    from fasttrain.train.config import ConfigError, load_config
    from fasttrain.train.policy import rollout_weights
    model, _ = adapted("lora")
    pick = {v: rollout_weights(load_config({"rollout": {"base_weights": v}}), model) for v in ("nf4", "dequantized")}
    assert pick["nf4"] is None and isinstance(pick["dequantized"], RolloutWeights)
    with pytest.raises(ConfigError, match=r"rollout.base_weights: 'bf16' is not allowed; allowed values: 'auto', "
                                          r"'nf4', 'dequantized'"):
        load_config({"rollout": {"base_weights": "bf16"}})


def test_a_model_without_adapted_layers_keeps_no_dense_copy():
    """A plain model has nothing to merge, so even "dequantized" keeps no copy."""
    from fasttrain.nn.rollout_weights import rollout_weights_for
    plain = tiny_llama(vocab_size=128, seed=1, dtype=torch.float64)
    assert rollout_weights_for("dequantized", plain) is None
    model, _ = adapted("lora")
    assert isinstance(rollout_weights_for("dequantized", model), RolloutWeights)
    assert rollout_weights_for("nf4", model) is None


_BF16_PACKED = pytest.mark.skipif(
    not __import__("fasttrain.nn.rollout_weights", fromlist=["packable"]).packable(torch.bfloat16, torch.device("cpu")),
    reason="this CPU has no native bf16 GEMM (or this torch no oneDNN): rollout weights stay plain here")


def _bf16_policy(kind):
    model = tiny_llama(vocab_size=128, seed=2, dtype=torch.bfloat16)
    quantize_model(model)
    torch.manual_seed(5)
    params = attach_adapters(model, kind=kind, r=4, alpha=8)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn_like(p) * 0.2)
    return model, params


def _within_product_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y = x·wᵀ from bf16 x, w: the float64 product of the same values, to fp32 sums over k terms
    (k·u32·Σ|x||w|) and one rounding of the result to bf16 (u16·|ref|)."""
    x64, w64 = x.double(), w.double()
    ref = x64 @ w64.T
    k = x.shape[-1]
    bound = k * 2.0 ** -24 * (x64.abs() @ w64.abs().T) + 2.0 ** -8 * ref.abs()
    assert y.dtype == torch.bfloat16
    assert ((y.double() - ref).abs() <= bound).all()


@_BF16_PACKED
@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_packed_rollout_weights_multiply_as_the_merged_matrices(kind):
    """Packed (oneDNN's layout, the CPU default for bf16 where its GEMMs are native), each stacked and
    single weight multiplies as the plain merged matrix does, to the bound of a bf16 product with fp32
    sums; after an adapter changes, refresh packs the new merge; a rollout runs on them, and where it
    draws the plain rollout's token (same seed) the behaviour log-probs agree to bf16 rounding."""
    from fasttrain.nn.rollout_weights import rollout_linear
    model, params = _bf16_policy(kind)
    packed, plain = RolloutWeights(model), RolloutWeights(model, pack=False)
    head = model.lm_head.weight
    assert packed.packed and not plain.packed
    assert packed.nbytes() == plain.nbytes() + head.numel() * head.element_size()    # + the packed head
    assert packed.nbytes(head=False) == plain.nbytes() == plain.nbytes(head=False)
    layer = model.model.layers[1]
    groups = [(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
              (layer.mlp.gate_proj, layer.mlp.up_proj)]
    x = torch.randn(7, 64).bfloat16()
    for mods in groups:
        w = packed.fused(mods)
        assert w.is_mkldnn and all(packed.linear(m) is None for m in mods)
        _within_product_bound(rollout_linear(x, w), x, plain.fused(mods))
    single = layer.self_attn.o_proj
    assert packed.linear(single).is_mkldnn
    _within_product_bound(rollout_linear(x, packed.linear(single)), x, plain.linear(single))
    with torch.no_grad():
        layer.mlp.up_proj.lora_B.mul_(3.0)
    assert packed.refresh() == 1 and plain.refresh() == 1
    _within_product_bound(rollout_linear(x, packed.fused(groups[1])), x, plain.fused(groups[1]))
    with torch.inference_mode():
        a = sample(model, PROMPTS, group_size=2, max_new_tokens=1, temperature=1.0, eos_token_ids=[], seed=3,
                   pad_token_id=0, weights=packed)
        b = sample(model, PROMPTS, group_size=2, max_new_tokens=1, temperature=1.0, eos_token_ids=[], seed=3,
                   pad_token_id=0, weights=plain)
    assert a.completion_ids.shape == b.completion_ids.shape == (6, 1)
    same = a.completion_ids == b.completion_ids
    assert same.any()
    # the logits of the two agree to a few bf16 ulps (|logit| < 8 here: 2^-5 each); a log-prob is a
    # logit minus a log-sum-exp, each moved by at most that
    assert ((a.logprobs - b.logprobs).abs()[same] <= 0.25).all()


@_BF16_PACKED
def test_packed_head_multiplies_as_the_head_and_follows_its_weight():
    """Packed rollout weights pack the output head too (made once, kept): its logits are the plain
    head's product to the bound of a bf16 product with fp32 sums, for one row and a batch; a change
    of the head's weight packs it again; plain weights give the head unchanged."""
    from fasttrain.nn.rollout_weights import PackedHead
    from fasttrain.rollout.families import decoder_for
    model, _ = _bf16_policy("lora")
    packed, plain = RolloutWeights(model), RolloutWeights(model, pack=False)
    head = model.lm_head
    h = packed.head(head)
    assert isinstance(h, PackedHead) and h.packed.is_mkldnn and packed.head(head) is h
    assert decoder_for(model, packed).lm_head is h
    assert plain.head(head) is head and decoder_for(model, plain).lm_head is head
    x = torch.randn(7, head.in_features).bfloat16()
    with torch.no_grad():
        _within_product_bound(h(x), x, head.weight)
        _within_product_bound(h(x[2])[None], x[2:3], head.weight)
        head.weight.mul_(-2.0)
    h2 = packed.head(head)
    assert h2 is not h
    with torch.no_grad():
        _within_product_bound(h2(x), x, head.weight)
    packed.forget()
    assert packed.head(head) is not h2


def test_packing_is_refused_where_it_cannot_run_and_with_compile():
    model, _ = adapted("lora")                    # float64 layers: never packed
    assert not RolloutWeights(model).packed
    with pytest.raises(ValueError, match="pack=True needs bf16"):
        RolloutWeights(model, pack=True)
    if __import__("fasttrain.nn.rollout_weights", fromlist=["packable"]).packable(torch.bfloat16,
                                                                                   torch.device("cpu")):
        bf, _ = _bf16_policy("lora")
        with pytest.raises(ValueError, match="pack=False"):
            sample(bf, PROMPTS, group_size=1, max_new_tokens=2, eos_token_ids=[], seed=0, pad_token_id=0,
                   weights=RolloutWeights(bf), compile="aot_eager")


def _lora_16bit(dtype, family="llama"):
    if family == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM
        torch.manual_seed(3)
        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                             max_position_embeddings=512, tie_word_embeddings=False))
        with torch.no_grad():
            for layer in model.model.layers:           # q/k norms that are not the identity
                for n in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    n.weight.uniform_(0.5, 1.5)
        model = model.to(dtype).eval()
    else:
        model = tiny_llama(vocab_size=128, seed=1, dtype=dtype)
    adaptable_model(model)
    torch.manual_seed(4)
    params = attach_adapters(model, kind="lora", r=4, alpha=8)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn_like(p) * 0.2)
    return model


def _float64_logp(model, r):
    import copy
    m = copy.deepcopy(model).to(torch.float64)
    with torch.no_grad():
        logits = m(input_ids=r.input_ids, attention_mask=r.attention_mask, position_ids=r.position_ids).logits
    lp = torch.log_softmax(logits[:, r.prompt_len - 1:-1], dim=-1)
    return lp.gather(2, r.completion_ids[..., None])[..., 0]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_step_computes_what_the_modules_compute(dtype, family, monkeypatch):
    """On the CPU, with rollout weights, a Llama or Qwen3 (q/k norms) decode step runs through fasttrain.ops.decode_fused
    (norm, rotary + cache write, SwiGLU, residual + norm in 4 ops a layer). Those ops round where the
    modules round and differ only in the order of the norm's sum and in exp's last ulp, so against the
    float64 forward of the same weights the fused rollout's log-probs are within 2x the module path's
    own error (floor: 8 ulps of the dtype at |log p| ~ 8), and in float32 it draws the module path's tokens."""
    from fasttrain.rollout import decoder as D
    model = _lora_16bit(dtype, family)
    w = RolloutWeights(model)
    calls = {"fused": 0}
    fused = D.LlamaFamilyDecoder._decode_fused

    def counted(self, *a, **k):
        calls["fused"] += 1
        return fused(self, *a, **k)
    monkeypatch.setattr(D.LlamaFamilyDecoder, "_decode_fused", counted)
    prompts = PROMPTS + [[40]]
    kw = dict(group_size=3, max_new_tokens=12, temperature=1.0, eos_token_ids=[], seed=5, pad_token_id=0, weights=w)
    got = sample(model, prompts, **kw)
    assert calls["fused"] == 11                     # every decode step (the first token comes from the prefill)
    monkeypatch.setattr(D.LlamaFamilyDecoder, "_fused_units", lambda self, tokens: None)
    plain = sample(model, prompts, **kw)
    assert calls["fused"] == 11
    if dtype == torch.float32:
        assert torch.equal(got.completion_ids, plain.completion_ids)
    err = (got.logprobs.double() - _float64_logp(model, got)).abs().max().item()
    own = (plain.logprobs.double() - _float64_logp(model, plain)).abs().max().item()
    assert err <= max(2 * own, 8 * 8 * torch.finfo(dtype).eps), (err, own)


def test_compiled_and_eager_decoders_sample_the_same_tokens_in_float32():
    """The compiled decode step (static cache, torch's SDPA over every column under the mask) and the
    eager one (fasttrain's decode attention and fused elementwise ops) on the same float32 rollout
    weights draw the same tokens under one seed; each one's log-probs are within 2x the other's error
    against the float64 forward of the same weights (floor: 8 float32 ulps at |log p| ~ 8).
    "aot_eager" traces the graph inductor would compile, without its C++ build (bench_rollout
    --compile times inductor)."""
    import torch._dynamo
    torch._dynamo.reset()
    model = _lora_16bit(torch.float32)
    w = RolloutWeights(model, pack=False)
    kw = dict(group_size=3, max_new_tokens=12, temperature=1.0, eos_token_ids=[], seed=[5, 6, 7, 8],
              pad_token_id=0, weights=w)
    prompts = PROMPTS + [[40]]
    eager = sample(model, prompts, **kw)
    compiled = sample(model, prompts, compile="aot_eager", **kw)
    assert torch.equal(eager.completion_ids, compiled.completion_ids)
    e = (eager.logprobs.double() - _float64_logp(model, eager)).abs().max().item()
    c = (compiled.logprobs.double() - _float64_logp(model, compiled)).abs().max().item()
    floor = 8 * 8 * torch.finfo(torch.float32).eps
    assert e <= max(2 * c, floor) and c <= max(2 * e, floor), (e, c)
