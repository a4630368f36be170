"""A model from a `module:factory` goes through the family check a folder's goes through: one of a
kind fasttrain does not drive is refused by build_policy with a one-paragraph ConfigError (never
a traceback from inside the model), and the two MoE families are accepted."""

import pytest
import torch

from fasttrain.train.config import ConfigError, load_config
from fasttrain.train.policy import build_policy


def _build(factory: str, **policy):
    cfg = load_config({"policy": {"model": f"support.moe_factories:{factory}", "dtype": "float32", "rank": 2,
                                  "alpha": 4.0, **policy}})
    return build_policy(cfg, torch.device("cpu"))


@pytest.mark.parametrize("factory, why", [("mixtral", r"layer 0 is a mixture of experts \(MixtralSparseMoeBlock\)"),
                                          ("qwen2_moe", r"layer 0 is a mixture of experts \(Qwen2MoeSparseMoeBlock\)"),
                                          ("gemma3", r"the kind\(s\) 'sliding_attention'")])
def test_a_factory_of_a_kind_fasttrain_does_not_drive_is_refused_in_one_paragraph(factory, why):
    with pytest.raises(ConfigError, match=why) as e:
        _build(factory)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"policy.model = 'support.moe_factories:{factory}'")
    assert "qwen3_moe" in msg and "fasttrain trains" in msg


@pytest.mark.parametrize("factory", ["qwen3_moe", "qwen3_5_moe"])
def test_the_moe_families_from_a_factory_are_built_with_expert_adapters(factory):
    from fasttrain.nn.moe_experts import MoEBlock
    model, _, params = _build(factory, quantize="nf4")
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    assert blocks and all(b.experts.nf4 and b.experts.adapter == "lora" for b in blocks)
    assert any(".experts.gate_up_lora_A" in n for n in params)
    assert not any(n.endswith("mlp.gate.weight") for n in params)          # the router is frozen


def test_dora_on_the_experts_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="DoRA on mixture-of-experts experts is not built. PEFT's target_parameters"):
        _build("qwen3_moe", adapter="dora")
    model, _, params = _build("qwen3_moe", adapter="dora", targets=["q_proj", "v_proj"])   # DoRA elsewhere is fine
    assert params and not any("experts" in n for n in params)


def test_a_llama_family_checkpoint_with_sliding_window_layers_still_passes():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fasttrain.models.family_check import drivable_problem
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, use_sliding_window=True, max_window_layers=1, sliding_window=16)
    assert "sliding_attention" in cfg.layer_types
    assert drivable_problem(Qwen2ForCausalLM(cfg)) is None
