"""Adapters saved and loaded in PEFT's on-disk format, so `peft.PeftModel.from_pretrained` reads them.

A directory holds adapter_config.json (a LoraConfig: r, lora_alpha, target_modules, use_dora,
use_rslora) and adapter_model.safetensors with keys
  base_model.model.<module path>.lora_A.weight         [r, in]
  base_model.model.<module path>.lora_B.weight         [out, r]
  base_model.model.<module path>.lora_magnitude_vector [out]   (DoRA)
(PEFT drops the adapter name from saved keys.) Tensors are fp32, as trained. LoRA on the routed
experts of a mixture of experts is saved in PEFT's target_parameters format (fasttrain.nn.moe_peft).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn
from safetensors.torch import load_file, save_file

from fasttrain.nn.adapted_linear import adapted_layers

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_PREFIX = "base_model.model."


def _adapted(model: nn.Module):
    from fasttrain.nn.moe_peft import moe_adapter_kind
    layers = [(n, m) for n, m in adapted_layers(model) if m.adapter is not None]
    experts = moe_adapter_kind(model)
    if not layers and not experts:
        raise ValueError("save_adapter: the model has no adapters (call attach_adapters first)")
    kinds = {(m.adapter, m.r, m.alpha, m.rslora) for _, m in layers} | experts
    if len(kinds) != 1:
        raise ValueError(f"save_adapter: PEFT's format holds one (kind, r, alpha, rslora) per file, found {kinds}")
    return layers, kinds.pop()


def save_adapter(model: nn.Module, directory: str | os.PathLike, base_model: str | None = None) -> Path:
    """Write adapter_config.json + adapter_model.safetensors (PEFT format) into `directory`."""
    layers, (kind, r, alpha, rslora) = _adapted(model)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, m in layers:
        tensors[f"{_PREFIX}{name}.lora_A.weight"] = m.lora_A.detach().float().contiguous().cpu()
        tensors[f"{_PREFIX}{name}.lora_B.weight"] = m.lora_B.detach().float().contiguous().cpu()
        if kind == "dora":
            tensors[f"{_PREFIX}{name}.lora_magnitude_vector"] = m.lora_magnitude.detach().float().contiguous().cpu()
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": r, "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "target_modules": sorted({n.rpartition(".")[2] for n, _ in layers}),
        "use_dora": kind == "dora", "use_rslora": rslora, "init_lora_weights": True,
        "inference_mode": True, "modules_to_save": None,
    }
    from fasttrain.nn.moe_peft import TARGET_PARAMETERS, moe_adapter_tensors
    experts = moe_adapter_tensors(model, _PREFIX)       # routed experts: PEFT's target_parameters format
    if experts:
        tensors.update(experts)
        config["target_parameters"] = TARGET_PARAMETERS
    # Atomic writes: a crash mid-save never leaves a half-written adapter behind.
    tmp = d / (WEIGHTS_NAME + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, d / WEIGHTS_NAME)
    tmp = d / (CONFIG_NAME + ".tmp")
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True))
    os.replace(tmp, d / CONFIG_NAME)
    return d


def load_adapter(model: nn.Module, directory: str | os.PathLike) -> list[nn.Parameter]:
    """Attach the adapter stored in `directory` (PEFT format, LoRA or DoRA) to a model whose layers are
    adaptable (quantize_model or adaptable_model).
    Returns the adapter parameters. Every adapted layer named in the file must exist in the model."""
    d = Path(directory)
    config = json.loads((d / CONFIG_NAME).read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"load_adapter: only LoRA/DoRA adapters are supported, got {config.get('peft_type')}")
    tensors = load_file(str(d / WEIGHTS_NAME))
    kind = "dora" if config.get("use_dora") else "lora"
    r, alpha, rslora = int(config["r"]), float(config["lora_alpha"]), bool(config.get("use_rslora", False))
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError("load_adapter: per-module rank_pattern/alpha_pattern is not supported")
    from fasttrain.nn.moe_peft import load_moe_adapter_tensors
    params, used = load_moe_adapter_tensors(model, tensors, _PREFIX, r, alpha, rslora)
    layers = dict(adapted_layers(model))
    names = sorted({k[len(_PREFIX):].rpartition(".lora_")[0] for k in tensors if k.startswith(_PREFIX)
                    and k not in used})
    missing = [n for n in names if n not in layers]
    if missing:
        raise ValueError(f"load_adapter: the model has no adaptable layer named {missing[:3]} "
                         "(call quantize_model or adaptable_model first)")
    for name in names:
        layer = layers[name]
        params += layer.attach_adapter(kind, r, alpha, rslora)
        with torch.no_grad():
            layer.lora_A.copy_(tensors[f"{_PREFIX}{name}.lora_A.weight"])
            layer.lora_B.copy_(tensors[f"{_PREFIX}{name}.lora_B.weight"])
            if kind == "dora":
                layer.lora_magnitude.copy_(tensors[f"{_PREFIX}{name}.lora_magnitude_vector"])
    return params
