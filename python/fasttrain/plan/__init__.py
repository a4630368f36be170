"""`fasttrain plan`: will a recipe fit a GPU, and how long will a step take, on paper.

The model is built from its config.json on the meta device (no weights are read) with
fasttrain's own NF4 surgery and adapters; memory.py accounts for every buffer a step allocates,
by part and phase; picks.py picks the rollout's waves, the prefill chunks and the micro-batch that
fit; speed.py estimates each phase's time from FLOPs and bytes (host_speed.py and moe_speed.py
from the rates measured on this host's device, fasttrain.plan.host_rates); limits.py finds the largest
settings that fit (with those picks allowed); gpus.py holds the accelerators' datasheet numbers.
"""
from fasttrain.plan.gpus import GPU, GPUS, gpu_for_device, gpu_spec
from fasttrain.plan.memory import PARTS, Device, MemoryPlan, plan_memory
from fasttrain.plan.meta_model import ModelShape, bundled_configs, meta_policy, model_config
from fasttrain.plan.run_shape import RunShape, run_shape

__all__ = ["GPU", "GPUS", "PARTS", "Device", "MemoryPlan", "ModelShape", "RunShape", "bundled_configs",
           "gpu_for_device", "gpu_spec", "meta_policy", "model_config", "plan_memory", "run_shape"]
