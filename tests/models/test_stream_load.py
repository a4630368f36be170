"""fasttrain.models.stream_load: the same bytes as loading in 16 bits and then quantizing, and a
peak during the load within the plan's `load` phase.

The peak is measured as the bytes of live tensors: every allocation and free through torch's CPU
allocator while the loader runs (the profiler's memory events, as tests/plan measures the steps),
from zero when it starts. That counts every tensor the loader makes, because the loader reads each
checkpoint tensor into a tensor torch allocates (nothing is memory-mapped); the resident set size
would count file pages and the allocator's cached free blocks instead of tensors.
"""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from fasttrain.models.stream_load import load_streamed
from fasttrain.nn import quantize_model
from fasttrain.plan import Device, meta_policy, model_config, plan_memory

from support.checkpoints import LOAD_PEAK_TOL, LOAD_SHAPE, allocated_peak, assert_same_bytes

def _tiny(family: str, tied: bool, seed: int = 0):
    common = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tied)
    cfg = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family](**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():                   # non-trivial norms and biases, so a swapped tensor shows
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.uniform_(0.5, 1.5)
    return model


def _checkpoint(tmp_path, family: str, tied: bool, stored: torch.dtype, shards: bool):
    model = _tiny(family, tied).to(stored)
    model.save_pretrained(tmp_path, max_shard_size="200KB" if shards else "1GB")
    return tmp_path


def _today(path, dtype, quantize: str):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    if quantize == "nf4":
        quantize_model(model)
    return model.eval()


@pytest.mark.parametrize("family,tied,stored,dtype,quantize,shards", [
    ("llama", False, torch.float32, torch.float32, "nf4", False),
    ("llama", True, torch.float32, torch.bfloat16, "nf4", True),        # cast on load, tied, shards
    ("qwen2", False, torch.bfloat16, torch.float32, "nf4", True),       # q/k/v biases, upcast
    ("qwen3", True, torch.bfloat16, torch.bfloat16, "nf4", False),      # per-head q/k norms
    ("llama", True, torch.float32, torch.bfloat16, "none", True),
])
def test_same_bytes_as_loading_then_quantizing(tmp_path, family, tied, stored, dtype, quantize, shards):
    path = _checkpoint(tmp_path, family, tied, stored, shards)
    if shards:
        assert (path / "model.safetensors.index.json").is_file()
    ours = load_streamed(path, dtype, quantize)
    assert assert_same_bytes(ours, _today(path, dtype, quantize)) > 0
    assert not any(p.requires_grad for p in ours.parameters()) and not ours.training


@pytest.mark.parametrize("same", [True, False])
def test_a_tied_checkpoint_that_stores_both_tensors_loads_as_from_pretrained(tmp_path, same):
    """A tied model's checkpoint that stores lm_head.weight beside the embedding (some exports do):
    from_pretrained keeps them tied when the values agree and gives each its own when they differ;
    so does the loader."""
    from safetensors.torch import save_file

    model = _tiny("llama", tied=True)
    model.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    embed = state["model.embed_tokens.weight"]
    state["lm_head.weight"] = embed.clone() if same else torch.randn_like(embed)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ours = load_streamed(tmp_path, torch.float32, "nf4")
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == same
    assert torch.equal(ours.lm_head.weight, state["lm_head.weight"])
    assert_same_bytes(ours, _today(tmp_path, torch.float32, "nf4"))


def _planned_load(path, dtype: str) -> tuple[int, int]:
    """(planned load peak, planned resident base) for the checkpoint at `path` loaded in `dtype`."""
    m = meta_policy(model_config(str(path)), dtype=dtype)
    load = plan_memory(m, LOAD_SHAPE, Device("cpu")).phases["load"]
    return sum(load.values()), load["nf4_base"] + load["dense_parts"]


def _check_peak(path, dtype: torch.dtype, label: str):
    model, peak, final = allocated_peak(lambda: load_streamed(path, dtype, "nf4"))
    planned, resident = _planned_load(path, str(dtype).removeprefix("torch."))
    print(f"\n{label}: load peak planned {planned / 2**20:.2f} MiB, measured {peak / 2**20:.2f} MiB "
          f"(ratio {planned / peak:.3f}); resident after the load planned {resident / 2**20:.2f} MiB, "
          f"measured {final / 2**20:.2f} MiB")
    assert final == resident                       # the loaded model holds exactly the plan's base bytes
    assert peak <= planned <= (1 + LOAD_PEAK_TOL) * peak
    return model, peak


@pytest.mark.parametrize("stored,dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                          (torch.bfloat16, torch.bfloat16)])
def test_tiny_model_load_peak_is_within_the_plans_load_phase(tmp_path, stored, dtype):
    path = _checkpoint(tmp_path, "llama", True, stored, shards=True)
    _check_peak(path, dtype, f"tiny llama stored {stored} loaded {dtype}")


def test_the_bundled_converted_checkpoint_names_its_dtype():
    """The plan reads the stored dtype from config.json (SmolLM2's converted checkpoint is fp32).
    The conversion is made here when no earlier test made it (under pytest-xdist the test that
    loads the model first may run on the other worker, or after this one)."""
    from fasttrain.models.bundled import bundled_gguf
    from fasttrain.models.loading import gguf_as_dir
    cfg = gguf_as_dir(bundled_gguf()) / "config.json"          # converts once, then cached
    assert json.loads(cfg.read_text()).get("dtype") == "float32"
    assert meta_policy(model_config(str(cfg.parent)), dtype="bfloat16").stored_w == 4


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_smollm2_loads_layer_by_layer_with_the_same_bytes_within_the_plan(dtype):
    """SmolLM2-135M (tied embeddings, fp32 checkpoint): the same bytes as from_pretrained +
    quantize_model, the peak within the plan; today's path's allocated peak printed beside it."""
    from fasttrain.models import load_policy
    from fasttrain.models.bundled import bundled_gguf, converted_dir_for

    load_policy()                                  # converts the bundled GGUF once (cached)
    path = converted_dir_for(bundled_gguf())
    ours, peak = _check_peak(path, dtype, f"SmolLM2-135M in {dtype}")
    today, today_peak, _ = allocated_peak(lambda: _today(path, dtype, "nf4"))
    print(f"  today's path (from_pretrained, then quantize_model): allocated peak {today_peak / 2**20:.1f} MiB")
    assert_same_bytes(ours, today)
    model, _ = load_policy(None, dtype=dtype, quantize="nf4")
    assert_same_bytes(model, ours)


def test_missing_and_misshapen_tensors_are_clear_errors(tmp_path):
    from safetensors.torch import load_file, save_file

    path = _checkpoint(tmp_path, "llama", False, torch.float32, shards=False)
    state = load_file(str(path / "model.safetensors"))
    save_file({k: v for k, v in state.items() if k != "model.norm.weight"}, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks 1 tensor.*model.norm.weight"):
        load_streamed(path, torch.float32, "nf4")
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"][:, :8].contiguous()
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"up_proj.weight' has shape \(128, 8\).*expects \(128, 64\)"):
        load_streamed(path, torch.float32, "nf4")
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(128, 64)
    save_file(state, str(path / "model.safetensors"))
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(ValueError, match="cut short"):
        load_streamed(path, torch.float32, "nf4")
    with pytest.raises(ValueError, match="quantize='int8': allowed values are 'nf4', 'none'"):
        load_streamed(path, torch.float32, "int8")
