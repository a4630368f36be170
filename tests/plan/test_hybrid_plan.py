"""fasttrain.plan for Qwen3.5 hybrids on paper: the bundled qwen3.5-27b config gives the published
size, the KV cache lives in the 16 full-attention layers only, each sequence carries the fixed
Gated DeltaNet state (48 layers x 48 value heads x 128 x 128 x 4 B = 144 MiB of float32 recurrent
state, plus the conv windows), and the step's FLOPs count the state math."""
import pytest

from fasttrain.plan import Device, meta_policy, model_config, plan_memory
from fasttrain.plan.run_shape import RunShape
from fasttrain.plan.speed import _forward_flops

MIB = 2 ** 20


@pytest.fixture(scope="module")
def m27():
    return meta_policy(model_config("qwen3.5-27b"), name="qwen3.5-27b", rank=16, alpha=32)


def test_27b_size_layers_and_state(m27):
    assert m27.architecture == "Qwen3_5ForCausalLM" and m27.model_type == "qwen3_5_text"
    assert round(m27.params / 1e9, 2) == 26.90                       # the model card's 27B text tower
    assert (m27.layers, m27.kv_layers) == (64, 16)
    recurrent = 48 * 48 * 128 * 128 * 4
    assert recurrent == 144 * MIB
    conv = 48 * 3 * (2 * 16 * 128 + 48 * 128) * 2                     # K-1 = 3 inputs of 10,240 channels, bf16
    assert m27.state_bytes == recurrent + conv
    # in_proj_b / in_proj_a stay 16-bit under NF4 (bf16, 2 bytes each) beside the NF4 projections
    n_ab = 48 * 2 * 48 * 5120
    nf4 = sum(o * i for o, i in m27.projections) - n_ab
    assert m27.resident["nf4_base"] == nf4 // 2 + nf4 // 64 * 4 + n_ab * 2


def test_rollout_memory_counts_kv_of_full_layers_and_the_state_per_row(m27):
    s = RunShape(prompts=2, group=8, prompt_tokens=360, new_tokens=32, micro_batch=8, passes=2)
    plan = plan_memory(m27, s, Device("cuda"))
    r = plan.phases["rollout"]
    B, n, S = 16, 2, 392
    # the B rows' cache, each row's states apart; the n prompts' own states live during the prefill
    # only, with its activations
    assert r["kv_cache"] == 16 * 2 * B * 4 * S * 256 * 2
    assert (r["recurrent_state"], r["conv_state"]) == (B * m27.recurrent_bytes, B * m27.conv_bytes)
    assert r["recurrent_state"] + r["conv_state"] == B * m27.state_bytes


def test_forward_flops_add_the_state_math(m27):
    plain = 2.0 * m27.linear_params + 2.0 * m27.rank * sum(o + i for o, i in m27.projections)
    attn = 4.0 * 16 * 24 * 256 * 100
    assert _forward_flops(m27, 1, 100) == pytest.approx(plain + attn + m27.state_flops, rel=1e-12)
    assert m27.state_flops == pytest.approx(48 * (8.0 * 48 * 128 * 128 + 2 * 4 * 10240))
