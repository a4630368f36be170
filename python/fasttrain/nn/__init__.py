"""Frozen-base linear layers with LoRA/DoRA adapters (NF4 or the model's 16-bit weight), model
surgery and PEFT-format adapter files."""
from fasttrain.nn.adapted_linear import AdaptedLinear, adapted_layers
from fasttrain.nn.dense_linear import DenseLinear
from fasttrain.nn.nf4_linear import NF4Linear
from fasttrain.nn.peft_adapter import load_adapter, save_adapter
from fasttrain.nn.rollout_weights import RolloutWeights
from fasttrain.nn.surgery import (PROJECTIONS, adaptable_model, adapters_disabled, attach_adapters, merge_adapters,
                                  nf4_layers, quantize_model, resident_bytes)

__all__ = ["AdaptedLinear", "DenseLinear", "NF4Linear", "PROJECTIONS", "quantize_model", "adaptable_model",
           "attach_adapters", "adapters_disabled", "merge_adapters", "resident_bytes", "save_adapter", "load_adapter",
           "nf4_layers", "adapted_layers", "RolloutWeights"]
