"""The pinned benchmark models: random transformers models of the shapes in models/configs, over
the bundled SmolLM2 tokenizer and vocabulary, so the built-in environments' prompts run.

    policy.model = "fasttrain.models.bench_model:qwen3_5_bench"      # a recipe (a model factory)
    policy.model = "fasttrain.models.bench_model:qwen3_moe_bench"

qwen3_5_bench    Qwen3_5ForCausalLM, qwen3.5-bench-100m.json: 109 M parameters, the 27B's 3:1 layer
                 layout at hidden 512.
qwen3_moe_bench  Qwen3MoeForCausalLM, qwen3-moe-bench-100m.json: 103.5 M parameters, Qwen3-30B-A3B's
                 layers at hidden 512 (32 experts top-4 in each of 5 layers; no load-balancing loss).

Seeded: the same weights in every process (bench/bench_step.py builds it once per side), drawn by
transformers' own initialisation (a router of std 0.02 gives logits of std ~0.45 on unit-RMS
inputs: no ties, the top-k spread over the experts). What it is not: a trained model; its answers
are noise, which is all a speed benchmark needs.
"""
from __future__ import annotations

import json
from importlib import resources

import torch

__all__ = ["BENCH_CONFIG", "MOE_BENCH_CONFIG", "bench_config", "qwen3_5_bench", "qwen3_moe_bench"]

BENCH_CONFIG = "qwen3.5-bench-100m"
MOE_BENCH_CONFIG = "qwen3-moe-bench-100m"


def bench_config(name: str):
    """The transformers config of the bundled benchmark config `name` (keys starting with "_" dropped)."""
    from transformers import AutoConfig
    data = json.loads(resources.files("fasttrain.models").joinpath("configs", f"{name}.json").read_text())
    data = {k: v for k, v in data.items() if not k.startswith("_")}
    return AutoConfig.for_model(data.pop("model_type"), **data)


def qwen3_5_bench(dtype: str = "bfloat16", seed: int = 0):
    """(model, tokenizer): the random benchmark hybrid in `dtype` and SmolLM2's tokenizer."""
    return _build(BENCH_CONFIG, dtype, seed)


def qwen3_moe_bench(dtype: str = "bfloat16", seed: int = 0):
    """(model, tokenizer): the random benchmark mixture of experts in `dtype` and SmolLM2's tokenizer."""
    return _build(MOE_BENCH_CONFIG, dtype, seed)


def _build(name: str, dtype, seed: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .bundled import bundled_gguf
    from .loading import gguf_as_dir, set_offline

    set_offline()
    cfg = bench_config(name)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
    tok = AutoTokenizer.from_pretrained(gguf_as_dir(bundled_gguf()), local_files_only=True)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype).eval(), tok
