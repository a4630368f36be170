"""GGUF file -> plain safetensors directory (model + tokenizer + chat template), done once.

transformers loads a GGUF by dequantizing it, but the loaded model keeps
`quantization_config = gguf`, and then `save_pretrained` and training refuse it. So we build a
plain model from the same config without that field, copy the state dict (all keys match) and
save that. The write is atomic: a temporary sibling folder, renamed into place when complete,
so an interrupted conversion never leaves a half-written cache entry.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

COMPLETE_MARKER = "fasttrain_converted.txt"


def is_converted(out_dir: Path) -> bool:
    return (Path(out_dir) / COMPLETE_MARKER).is_file()


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Dequantize `gguf_path` into a safetensors Hugging Face directory at `out_dir`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_path, out_dir = Path(gguf_path).resolve(), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"gguf file not found: {gguf_path}")
    src_dir, name = str(gguf_path.parent), gguf_path.name

    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name, local_files_only=True)
    quantized = AutoModelForCausalLM.from_pretrained(
        src_dir, gguf_file=name, local_files_only=True, dtype=torch.float32)
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name, local_files_only=True)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = quantized.state_dict()
    missing, unexpected = plain.load_state_dict(state, strict=False, assign=True)
    # Tied lm_head weights are absent from the state dict by design; anything else is a bug.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"gguf conversion of {gguf_path}: state dict mismatch, "
                           f"missing={missing[:5]} unexpected={unexpected[:5]}")
    if config.tie_word_embeddings:
        plain.tie_weights()
    plain.generation_config = quantized.generation_config
    del quantized

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        plain.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; the cache entry should read like any folder
        (tmp / COMPLETE_MARKER).write_text(f"converted from {gguf_path}\n")
        if out_dir.exists():  # a stale or concurrent conversion; keep exactly one complete copy
            if is_converted(out_dir):
                shutil.rmtree(tmp)
                return out_dir
            shutil.rmtree(out_dir)
        try:
            os.replace(tmp, out_dir)
        except OSError:  # another process renamed its copy in first
            if not is_converted(out_dir):
                raise
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
