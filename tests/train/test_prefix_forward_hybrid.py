"""The update's shared-prefix forward on Qwen3.5 hybrids equals the oracle's full forward
(transformers' Qwen3_5ForCausalLM in float64 with fasttrain.ops.reference's delta rule and conv):
hidden states, and gradients with respect to the adapters, which reach the prompt through its
conv and recurrent states and its keys/values; with and without gradient checkpointing; on the
three layouts of the rollout tests. NF4 base + LoRA/DoRA adapters on every NF4 projection of both
layer kinds (the adapters' B is random, so they change the output).

Tolerance: float64 with different summation orders; the bound of tests/rollout/test_hybrid_decoder.py
(layers·(H + 2·S·D)·u·1e3) for values, and for gradients the same relative to each gradient's
largest entry. The adapter masters are float32, so their gradients are compared at float32
precision: 8·eps32 of the largest entry, as for the Llama-family forward."""
import pytest
import torch

from fasttrain.models import tiny_qwen3_5
from fasttrain.models.families import nf4_targets
from fasttrain.nn import attach_adapters, quantize_model
from fasttrain.train.prefix_forward import shared_prefix_hidden

from support.hf_oracle import hf_float64_oracle
from support.tolerances import forward_tol

pytestmark = pytest.mark.one_thread         # tiny models (tests/conftest.py)

LAYOUTS = {
    "interval4-gqa-rep2": dict(layers=4, interval=4, heads=4, kv_heads=2, value_heads_per_key=2),
    "interval2-mha-rep1": dict(layers=4, interval=2, heads=4, kv_heads=4, value_heads_per_key=1),
    "interval2-gqa-rep3": dict(layers=4, interval=2, heads=4, kv_heads=1, value_heads_per_key=3),
}


def adapted(layout, kind="lora"):
    model = tiny_qwen3_5(vocab_size=97, dtype=torch.float64, **LAYOUTS[layout])
    quantize_model(model, targets=nf4_targets(model))
    torch.manual_seed(3)
    params = attach_adapters(model, kind=kind, r=4, alpha=8.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0.0, 0.05)
    for p in params:
        p.requires_grad_(True)
    return model, params


def batch(G=3):
    """Two prompts (one left-padded) x G answers of T = 6 tokens, some ending early."""
    P, T = 7, 6
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    g = torch.Generator().manual_seed(0)
    ids = torch.zeros(2 * G, P + T, dtype=torch.long)
    am = torch.zeros_like(ids)
    for b in range(2 * G):
        p = prompts[b // G]
        ids[b, P - len(p):P] = torch.tensor(p)
        am[b, P - len(p):P] = 1
        n = T - (b % 3)                       # answer lengths 6, 5, 4
        ids[b, P:P + n] = torch.randint(3, 97, (n,), generator=g)
        am[b, P:P + n] = 1
    pos = (am.cumsum(1) - 1).clamp(min=0)
    return ids, am, pos, P, T, torch.arange(2 * G) // G


def tol(model, S):
    return forward_tol(model.config, S)


def run(model, params, fn, cot, mask):
    for p in params:
        p.grad = None
    with hf_float64_oracle():          # the oracle's functions in the backward too (checkpointing recomputes)
        h = fn()
        (h * cot * mask[..., None]).sum().backward()
    return h.detach(), [p.grad.clone() for p in params]


@pytest.mark.parametrize("layout,kind,checkpointing", [("interval4-gqa-rep2", "lora", False),
                                                       ("interval4-gqa-rep2", "dora", True),
                                                       ("interval2-mha-rep1", "lora", True),
                                                       ("interval2-gqa-rep3", "dora", False)])
def test_shared_prefix_equals_the_oracle_full_forward(layout, kind, checkpointing):
    model, params = adapted(layout, kind)
    ids, am, pos, P, T, groups = batch()
    if checkpointing:
        model.train()
        model.activation_checkpointing_enable({"use_reentrant": False})
    cot = torch.randn(ids.shape[0], T, model.config.hidden_size, dtype=torch.float64,
                      generator=torch.Generator().manual_seed(1))
    mask = am[:, P:].double()                          # a position is used when its target exists

    def full():
        return model.model(input_ids=ids, attention_mask=am, position_ids=pos).last_hidden_state[:, P - 1:P - 1 + T]

    h_full, g_full = run(model, params, full, cot, mask)
    calls = []
    hook = model.model.embed_tokens.register_forward_pre_hook(lambda m, a: calls.append(tuple(a[0].shape)))
    try:
        h_shared, g_shared = run(model, params, lambda: shared_prefix_hidden(model, ids, am, pos, P, T, groups),
                                 cot, mask)
    finally:
        hook.remove()
    assert calls[0] == (2, P)                            # each distinct prompt ran once
    m = mask.bool()
    assert (h_shared - h_full)[m].abs().max() <= tol(model, P + T)
    for a, b in zip(g_full, g_shared):
        scale = float(a.abs().max())
        assert a.dtype == torch.float32 and scale > 0
        assert (a - b).abs().max() <= 8 * torch.finfo(torch.float32).eps * scale
    # the adapters of the first (Gated DeltaNet) layer get gradient from the answers through the
    # prompt's state: zero the answers' own path and it is still there (checked by its size)
    assert any(float(p.grad.abs().max()) > 0 for n, p in model.named_parameters()
               if "layers.0.linear_attn" in n and p.grad is not None)


def test_checkpointed_layers_keep_only_their_inputs():
    model, params = adapted("interval4-gqa-rep2")
    ids, am, pos, P, T, groups = batch(G=4)
    model.train()
    kept = []
    for on in (False, True):
        if on:
            model.activation_checkpointing_enable({"use_reentrant": False})
        numel = [0]

        def pack(t):
            numel[0] += t.numel()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            h = shared_prefix_hidden(model, ids, am, pos, P, T, groups)
        assert h.requires_grad
        kept.append(numel[0])
    assert kept[1] < kept[0] / 4

