"""fasttrain.plan for the mixtures of experts on paper: the bundled qwen3-30b-a3b and qwen3.5-35b-a3b
configs give the published sizes, the experts' bytes are NF4 per expert slice (codes + one fp32 absmax
per 64 weights) or the 16-bit stacks, the router and the shared-expert gate stay 16-bit, the expert
LoRA is r per expert, the routing record is layers x k integers per token, and every part prints as
its own line with the time terms on paper saying so. (tests/plan/test_measured_peaks.py checks
the activations against measured steps of tiny MoEs of both families.)"""
import pytest

from fasttrain.plan import Device, gpu_spec, meta_policy, model_config, plan_memory
from fasttrain.plan.meta_model import MoEShape
from fasttrain.plan.moe_memory import PARTS
from fasttrain.plan.moe_speed import ASSUMPTION
from fasttrain.plan.run_shape import RunShape
from fasttrain.plan.speed import plan_time

R = 16


def _nf4(n: int) -> int:
    return n // 2 + n // 64 * 4


@pytest.fixture(scope="module")
def m30():
    return meta_policy(model_config("qwen3-30b-a3b"), name="qwen3-30b-a3b", rank=R, alpha=32)


@pytest.fixture(scope="module")
def m35_16bit():
    return meta_policy(model_config("qwen3.5-35b-a3b"), name="qwen3.5-35b-a3b", rank=R, alpha=32, quantize="none")


def test_30b_experts_router_and_lora_bytes(m30):
    assert m30.architecture == "Qwen3MoeForCausalLM" and round(m30.params / 1e9, 2) == 30.53   # the card's 30.5 B
    assert m30.moe == MoEShape(128, 8, 768, 48, 0)                      # E, k, expert width, MoE layers, no shared expert
    H, I, E, L = 2048, 768, 128, 48
    assert m30.resident["moe_experts"] == L * E * (_nf4(2 * I * H) + _nf4(H * I))
    assert m30.resident["moe_router"] == L * E * H * 2         # bf16 router, no shared-expert gate
    assert m30.resident["moe_adapter_masters"] == L * E * R * ((H + 2 * I) + (I + H)) * 4
    assert m30.moe_active_params == L * 8 * 3 * I * H           # 3.6 B of the experts run per token


def test_35b_16bit_stacks_and_shared_expert(m35_16bit):
    m = m35_16bit
    assert m.architecture == "Qwen3_5MoeForCausalLM" and m.model_type == "qwen3_5_moe_text"
    assert round(m.params / 1e9, 2) == 34.66                    # the text tower of the 35B
    assert m.moe == MoEShape(256, 8, 512, 40, 512) and (m.layers, m.kv_layers) == (40, 10)
    H, I, E, L = 2048, 512, 256, 40
    assert m.resident["moe_experts"] == L * E * 3 * I * H * 2   # the bf16 stacks themselves
    assert m.resident["moe_router"] == L * (E * H + H) * 2      # router + shared-expert gate, bf16
    # the shared expert is a dense MLP of the base: adapted, counted with the other projections (its
    # gate and up beside the 10 attention layers' k and v, [512, 2048] too)
    assert sum(1 for o, i in m.projections if (o, i) == (I, H)) == 2 * L + 2 * m.kv_layers


def test_plan_prints_every_moe_part_and_the_record(m30):
    s = RunShape(prompts=4, group=12, prompt_tokens=360, new_tokens=128, micro_batch=8, passes=2)
    plan = plan_memory(m30, s, Device("cuda"))
    up = plan.phases["update"]
    assert up["moe_routing"] == 48 * (360 + 128) * 48 * 8       # rows x columns x layers x k, uint8
    assert up["moe_adam_moments"] == 2 * m30.resident["moe_adapter_masters"]
    for phase in ("rollout", "probe", "scores", "update"):
        assert plan.phases[phase]["moe_activations"] > 0 and plan.phases[phase]["moe_experts"] > 0
    assert set(PARTS) <= set(up)
    t = plan_time(m30, s, gpu_spec("h100-sxm-80gb"))
    assert ASSUMPTION in t.assumptions and all(v >= 0 for v in t.seconds.values()) and t.total > 0


def test_time_from_measured_host_rates_runs_for_moe(m30):
    """With a host's measured rates (fasttrain.plan.host_speed) the MoE plan is timed too, its routed
    experts from fasttrain.ops.moe_experts' own rates (here the host's reference ones: the rates'
    clock is not one a plan measures with; tests/plan/test_moe_time.py checks the arithmetic)."""
    from dataclasses import replace

    from support.rates import fake_rates as _fake_rates
    s = RunShape(prompts=2, group=4, prompt_tokens=64, new_tokens=16, micro_batch=4, passes=1)
    t = plan_time(m30, s, replace(gpu_spec("cpu"), rates=_fake_rates(clock="given")), compute_dtype="float32")
    assert t.total > 0 and any("MoE: the routed experts timed from fasttrain.ops.moe_experts" in a for a in t.assumptions)
