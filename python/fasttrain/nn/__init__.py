"""NF4 linear layers with LoRA/DoRA adapters, model surgery and PEFT-format adapter files."""
from fasttrain.nn.nf4_linear import NF4Linear
from fasttrain.nn.peft_adapter import load_adapter, save_adapter
from fasttrain.nn.rollout_weights import RolloutWeights
from fasttrain.nn.surgery import (PROJECTIONS, adapters_disabled, attach_adapters, merge_adapters, nf4_layers,
                                  quantize_model, resident_bytes)

__all__ = ["NF4Linear", "PROJECTIONS", "quantize_model", "attach_adapters", "adapters_disabled", "merge_adapters",
           "resident_bytes", "save_adapter", "load_adapter", "nf4_layers", "RolloutWeights"]
