"""The pinned hybrid benchmark model: a random Qwen3_5ForCausalLM of the shape in
models/configs/qwen3.5-bench-100m.json (109 M parameters, the 27B's 3:1 layer layout at hidden 512)
over the bundled SmolLM2 tokenizer and vocabulary, so the built-in environments' prompts run.

    policy.model = "fasttrain.models.bench_model:qwen3_5_bench"      # a recipe (a model factory)

Seeded: the same weights in every process (bench/bench_step.py builds it once per side). What it
is not: a trained model; its answers are noise, which is all a speed benchmark needs.
"""
from __future__ import annotations

import json
from importlib import resources

import torch

__all__ = ["BENCH_CONFIG", "qwen3_5_bench"]

BENCH_CONFIG = "qwen3.5-bench-100m"


def qwen3_5_bench(dtype: str = "bfloat16", seed: int = 0):
    """(model, tokenizer): the random benchmark hybrid in `dtype` and SmolLM2's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .bundled import bundled_gguf
    from .loading import _gguf_as_dir, _offline

    _offline()
    data = json.loads(resources.files("fasttrain.models").joinpath("configs", f"{BENCH_CONFIG}.json").read_text())
    data = {k: v for k, v in data.items() if not k.startswith("_")}
    cfg = AutoConfig.for_model(data.pop("model_type"), **data)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
    tok = AutoTokenizer.from_pretrained(_gguf_as_dir(bundled_gguf()), local_files_only=True)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype).eval(), tok
