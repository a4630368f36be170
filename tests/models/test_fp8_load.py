"""Block-FP8 checkpoints (fasttrain.models.block_fp8) load tensor by tensor into the NF4 or the
16-bit base with the same bytes as transformers' own FP8 dequantization followed by fasttrain's
quantization, within the plan's load phase; every other quantized layout is refused in one paragraph.

Oracles: for a Llama-family checkpoint whose shapes are whole 128 x 128 blocks, transformers'
from_pretrained itself (on a CPU it dequantizes FP8 on load); for partial edge blocks, which
transformers' load-time dequantization refuses (it derives the block from the scale grid), its FP8
layer's decode of the weight (`_dequantize_fp8_weight`) in float32, cast once to the model's dtype,
written as a 16-bit checkpoint and loaded by from_pretrained.
"""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from fasttrain.models import load_policy
from fasttrain.models.families import nf4_targets, text_config
from fasttrain.models.stream_load import load_streamed
from fasttrain.nn import quantize_model

from support.checkpoints import (HYBRID_TEXT, LOAD_PEAK_TOL, LOAD_SHAPE, allocated_peak, assert_same_bytes,
                                 word_tokenizer)
from support.fp8_checkpoints import write_fp8_checkpoint

BLOCK = (128, 128)


def _llama(seed: int = 0):
    # q 256x128, k/v 128x128, o 128x256, gate/up 256x128, down 128x256: whole 128 x 128 blocks
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=64,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)


def _transformers_fp8(path, dtype, quantize: str, targets=None):
    """transformers' load of the FP8 checkpoint (dequantized on a CPU), then fasttrain's NF4."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    assert not any("FP8" in type(m).__name__ for m in model.modules())     # dequantized, plain nn.Linear
    if quantize == "nf4":
        quantize_model(model, targets=targets or nf4_targets(model))
    return model.eval()


@pytest.mark.parametrize("dtype,quantize", [(torch.bfloat16, "nf4"), (torch.float32, "none")])
def test_llama_fp8_equals_transformers_dequantization_then_quantization(tmp_path, dtype, quantize):
    """128 x 128 blocks, a weight and its scale in different shards, one projection left 16-bit
    (modules_to_not_convert)."""
    kept = "model.layers.1.mlp.down_proj"
    path = write_fp8_checkpoint(_llama(), tmp_path, BLOCK, not_converted=("lm_head", kept), shards=True)
    stored = {k: v.dtype for f in path.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert stored["model.layers.0.self_attn.q_proj.weight"] == torch.float8_e4m3fn
    assert stored[kept + ".weight"] == torch.bfloat16
    ours = load_streamed(path, dtype, quantize)
    assert assert_same_bytes(ours, _transformers_fp8(path, dtype, quantize)) > 0
    assert getattr(ours.config, "quantization_config", None) is None


def _partial_block_oracle(fp8_dir, out_dir):
    """The FP8 checkpoint decoded by transformers' FP8 layer math (float32 product, one cast to
    bfloat16), saved as a 16-bit checkpoint of the same names."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    state = load_file(str(fp8_dir / "model.safetensors"))
    out = {}
    for k, v in state.items():
        if k.endswith("_scale_inv"):
            continue
        if v.dtype == torch.float8_e4m3fn:
            v = _dequantize_fp8_weight(v, state[k + "_scale_inv"], list(BLOCK), torch.float32).to(torch.bfloat16)
        out[k] = v
    out_dir.mkdir()
    save_file(out, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((fp8_dir / "config.json").read_text())
    del cfg["quantization_config"]
    (out_dir / "config.json").write_text(json.dumps(cfg))
    (out_dir / "generation_config.json").write_bytes((fp8_dir / "generation_config.json").read_bytes())
    return out_dir


def test_hybrid_vision_language_fp8_with_partial_blocks_loads_its_text_tower(tmp_path):
    """Qwen3.5 as released: a vision-language checkpoint, its text projections block-FP8 with every
    block partial (64-wide weights in 128 x 128 blocks), lm_head, in_proj_a/b and the vision tower
    left 16-bit; NF4 and 16-bit bases equal the oracle's bytes."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    cfg = Qwen3_5Config(text_config=HYBRID_TEXT, vision_config=dict(depth=1, hidden_size=16, intermediate_size=32,
                                                            num_heads=2, out_hidden_size=32))
    torch.manual_seed(2)
    src = Qwen3_5ForConditionalGeneration(cfg).to(torch.bfloat16)
    fp8 = write_fp8_checkpoint(src, tmp_path / "fp8", BLOCK, not_converted=("lm_head", "in_proj_a", "in_proj_b", "visual"))
    word_tokenizer(fp8)
    stored = load_file(str(fp8 / "model.safetensors"))
    assert stored["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.language_model.layers.0.linear_attn.in_proj_qkv.weight_scale_inv"].shape == (1, 1)
    assert stored["model.language_model.layers.0.linear_attn.in_proj_a.weight"].dtype == torch.bfloat16
    oracle_dir = _partial_block_oracle(fp8, tmp_path / "oracle")
    text = text_config(AutoConfig.from_pretrained(oracle_dir))
    for quantize in ("nf4", "none"):
        model, _ = load_policy(str(fp8), dtype=torch.bfloat16, quantize=quantize)
        assert type(model).__name__ == "Qwen3_5ForCausalLM"
        oracle = AutoModelForCausalLM.from_pretrained(oracle_dir, config=text, dtype=torch.bfloat16).eval()
        if quantize == "nf4":
            quantize_model(oracle, targets=nf4_targets(oracle))
        assert assert_same_bytes(model, oracle) > 0


@pytest.mark.parametrize("quantize", ["nf4", "none"])
def test_fp8_load_peak_is_within_the_plans_load_phase(tmp_path, quantize):
    from fasttrain.plan import Device, meta_policy, model_config, plan_memory

    path = write_fp8_checkpoint(_llama(), tmp_path, BLOCK, shards=True)
    _, peak, final = allocated_peak(lambda: load_streamed(path, torch.bfloat16, quantize))
    m = meta_policy(model_config(str(path)), dtype="bfloat16", quantize=quantize)
    load = plan_memory(m, LOAD_SHAPE, Device("cpu")).phases["load"]
    planned, resident = sum(load.values()), load["nf4_base"] + load["dense_parts"]
    print(f"\nFP8 tiny llama, base {quantize}: load peak planned {planned / 2**20:.3f} MiB, measured {peak / 2**20:.3f} MiB")
    assert final == resident
    assert peak <= planned <= (1 + LOAD_PEAK_TOL) * peak


def _edit_config(path, **qc):
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"].update(qc)
    cfg["quantization_config"] = {k: v for k, v in cfg["quantization_config"].items() if v is not None}
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("edit,says", [
    (dict(quant_method="gptq"), "quant_method 'gptq'"),
    (dict(weight_block_size=None), "no weight_block_size"),
    (dict(weight_block_size=[128]), "not two positive integers"),
    (dict(activation_scheme="static"), "static activation scales"),
    (dict(scale_fmt="ue8m0"), "stored as 'ue8m0'"),
    (dict(fmt="e5m2"), "FP8 format is 'e5m2'"),
])
def test_other_quantizations_are_refused_in_one_paragraph(tmp_path, edit, says):
    path = write_fp8_checkpoint(_llama(), tmp_path, BLOCK)
    _edit_config(path, **edit)
    with pytest.raises(ValueError, match=says) as err:
        load_streamed(path, torch.bfloat16, "nf4")
    assert "fasttrain reads block-FP8 checkpoints" in str(err.value) and "\n" not in str(err.value)


def test_broken_fp8_tensors_are_clear_errors(tmp_path):
    path = write_fp8_checkpoint(_llama(), tmp_path, BLOCK)
    f = path / "model.safetensors"
    state = load_file(str(f))
    key = "model.layers.0.mlp.up_proj.weight"
    cases = [({key + "_scale_inv": None}, "has no .*up_proj.weight_scale_inv"),
             ({key + "_scale_inv": state[key + "_scale_inv"].to(torch.bfloat16)}, "is BF16 .*needs F32"),
             ({key + "_scale_inv": torch.ones(1, 1)}, r"is F32 \(1, 1\).*needs F32 \(2, 1\)")]
    for change, says in cases:
        edited = {k: v for k, v in {**state, **change}.items() if v is not None}
        save_file(edited, str(f))
        with pytest.raises(ValueError, match=says):
            load_streamed(path, torch.bfloat16, "nf4")
    save_file(state, str(f))
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="float8_e4m3fn, but config.json declares no FP8"):
        load_streamed(path, torch.bfloat16, "none")


def test_a_refused_checkpoint_is_a_config_error_for_a_run(tmp_path):
    from fasttrain.train.config import ConfigError
    from fasttrain.train.policy import _load_base

    path = write_fp8_checkpoint(_llama(), tmp_path, BLOCK)
    word_tokenizer(path)
    _edit_config(path, quant_method="awq")
    with pytest.raises(ConfigError, match="quant_method 'awq'.*policy.model"):
        _load_base(str(path), "bfloat16", "nf4")
