"""Tiny block-FP8 checkpoints written the way the FP8 releases are: each converted projection's
weight as float8_e4m3fn with a float32 weight_scale_inv per (partial) block (the block's absmax over
448, e4m3's largest value), everything else 16-bit, and config.json's quantization_config."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

E4M3_MAX = 448.0


def quantize_block_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv [ceil(N/bm), ceil(K/bn)]) of a 2-D weight."""
    n, k = w.shape
    bm, bn = block
    rb, cb = -(-n // bm), -(-k // bn)
    w32 = w.float()
    scale = torch.empty(rb, cb)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(rb):
        for j in range(cb):
            blk = w32[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
            s = blk.abs().amax().clamp(min=1e-12) / E4M3_MAX
            scale[i, j] = s
            q[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = (blk / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def write_fp8_checkpoint(model, path: Path, block=(128, 128), not_converted: tuple[str, ...] = (),
                         shards: bool = False,
                         extra: dict | None = None) -> Path:
    """Save `model` (a transformers model) at `path` with every projection's weight (a 2-D weight of a
    module whose name holds "proj") as block FP8, except modules named in `not_converted` (a name
    matches the module or a part of its dotted path; kept in the model's dtype, and listed in
    quantization_config.modules_to_not_convert). `extra`: more
    quantization_config keys. shards: two files and an index, a weight and its scale in different
    files where the split falls between them."""
    path = Path(path)
    model.save_pretrained(path)                       # config.json, generation_config.json, tokenizer-free
    for f in path.glob("*.safetensors"):
        f.unlink()
    (path / "model.safetensors.index.json").unlink(missing_ok=True)
    tensors = {}
    for key, t in model.state_dict().items():
        module = key.rpartition(".")[0]
        if (key.endswith(".weight") and t.dim() == 2 and "proj" in module.rpartition(".")[2]
                and not any(f".{m}." in f".{module}." for m in not_converted)):
            q, s = quantize_block_fp8(t, block)
            tensors[key], tensors[key + "_scale_inv"] = q, s
        else:
            tensors[key] = t.contiguous()
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    if shards:
        keys = list(tensors)
        half = {k: tensors[k] for k in keys[: len(keys) // 2]}
        rest = {k: tensors[k] for k in keys[len(keys) // 2:]}
        names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
        for name, part in zip(names, (half, rest)):
            save_file(part, str(path / name), metadata={"format": "pt"})
        index = {"metadata": {}, "weight_map": {k: names[0] if k in half else names[1] for k in keys}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": list(block), "modules_to_not_convert": list(not_converted),
                                  **(extra or {})}
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path
