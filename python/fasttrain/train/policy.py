"""Build the policy a run trains: base model (NF4 or 16-bit) + adapters, and pick the device."""
from __future__ import annotations

import importlib
from pathlib import Path

import torch

from fasttrain.train.config import Config, ConfigError

__all__ = ["build_policy", "pick_device", "adapter_parameters", "rollout_weights"]


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("run.device: 'cuda' was asked for but no CUDA GPU is visible; allowed here: 'auto', 'cpu'")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def is_factory(spec: str) -> bool:
    """Whether policy.model names a `module:factory` hook rather than a model to load."""
    return ":" in spec and not Path(spec).exists() and "/" not in spec.split(":")[0]


def _load_base(spec: str, dtype: str, quantize: str = "none"):
    """`module:factory` (a user hook returning (model, tokenizer)) or a fasttrain.models spec, which
    loads with its projections already in NF4 when `quantize` is "nf4" (layer by layer)."""
    if is_factory(spec):
        mod, _, fn = spec.partition(":")
        try:
            factory = getattr(importlib.import_module(mod), fn)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"policy.model: cannot load factory {spec!r}: {e}") from None
        return factory(dtype=dtype)
    from safetensors import SafetensorError

    from fasttrain.models import load_policy
    _check_model_folder(spec)
    try:
        return load_policy(None if spec in ("", "default") else spec, dtype=getattr(torch, dtype),
                           quantize=quantize)
    except (FileNotFoundError, ValueError, OSError, KeyError, SafetensorError) as e:   # one paragraph
        raise ConfigError(_cannot_load(spec, f"{str(e).strip().rstrip('.')}.")) from None


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")


def _cannot_load(spec: str, why: str) -> str:
    from fasttrain.models.loading import SUPPORTED_FAMILIES
    return (f"policy.model = {spec!r}: fasttrain cannot load it: {why} fasttrain trains "
            f"{', '.join(SUPPORTED_FAMILIES)} models from a Hugging Face folder (config.json, *.safetensors "
            f"weights, tokenizer files) or a .gguf file, or the bundled 'smollm2-135m'; set policy.model to one "
            f"of those, or to 'module:factory' returning (model, tokenizer).")


def _check_model_folder(spec: str) -> None:
    """A folder without weights or without a tokenizer fails before anything loads."""
    path = Path(spec).expanduser() if spec else None
    if path is None or not path.is_dir() or not (path / "config.json").is_file():
        return
    if not any(path.glob("*.safetensors")):
        raise ConfigError(_cannot_load(spec, "the folder has no *.safetensors weights (pickled .bin files are "
                                             "never loaded)."))
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise ConfigError(_cannot_load(spec, f"the folder has no tokenizer ({', '.join(_TOKENIZER_FILES)})."))


def build_policy(cfg: Config, device: torch.device):
    """(model, tokenizer, adapter params by name). The base is frozen; only adapters train."""
    from fasttrain.models import set_template_kwargs
    from fasttrain.nn import adaptable_model, attach_adapters, nf4_layers, quantize_model

    p = cfg.policy
    model, tokenizer = _load_base(p.model, p.dtype, p.quantize)
    _check_family(p.model, model)
    set_template_kwargs(tokenizer, p.chat_template_kwargs)   # the one reader: every prompt renders with them
    model.to(device)
    _use_gpu_packages(model, p, device)
    for prm in model.parameters():
        prm.requires_grad_(False)
    from fasttrain.models.families import adapter_targets, nf4_targets
    from fasttrain.models.family_surgery import family_surgery
    from fasttrain.models.moe import train_router
    family_surgery(model, nf4=p.quantize == "nf4")       # the family's own (the MoE families' experts)
    if p.quantize == "nf4" and next(nf4_layers(model), None) is None:   # not streamed: quantize here
        quantize_model(model, targets=nf4_targets(model))
    kept_16bit = tuple(t for t in adapter_targets(model) if p.quantize == "none" or t not in nf4_targets(model))
    if kept_16bit:                                        # "none", or a family's 16-bit projections under NF4
        adaptable_model(model, targets=kept_16bit)
    torch.manual_seed(cfg.run.seed)                       # adapter init is part of the run's seed
    try:
        params = attach_adapters(model, kind=p.adapter, r=p.rank, alpha=p.alpha, rslora=p.rslora,
                                 targets=list(p.targets) or None)
    except ValueError as e:                               # e.g. DoRA asked for on MoE experts: one paragraph
        raise ConfigError(str(e)) from None
    params += train_router(model, cfg.moe.train_router)
    model.to(device)
    if p.gradient_checkpointing is not False:            # "auto" builds it on; the trainer's plan may turn it off
        set_checkpointing(model, True)
    if hasattr(model, "config"):
        model.config.use_cache = False                   # training forward; rollout asks for its cache
    return model, tokenizer, adapter_parameters(model, params)


def set_checkpointing(model, on: bool) -> None:
    """Gradient checkpointing of the model's layers on (non-reentrant) or off, by transformers'
    own switches; a model without them is left as it is."""
    if on:
        if hasattr(model, "activation_checkpointing_enable"):          # transformers >= 5.2x
            model.activation_checkpointing_enable({"use_reentrant": False})
        elif hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    elif hasattr(model, "gradient_checkpointing_disable"):
        model.gradient_checkpointing_disable()


def checkpointing_on(model) -> bool:
    """Whether any of the model's modules is set to be checkpointed (the flag the update's
    forward reads, fasttrain.train.prefix_forward)."""
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def _check_family(spec: str, model) -> None:
    """A folder's model and a factory's alike: one fasttrain drives, or one paragraph saying why not."""
    from fasttrain.models.family_check import check_drivable
    try:
        check_drivable(model, f"policy.model = {spec!r}")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _use_gpu_packages(model, p, device: torch.device) -> None:
    """flash-attn 2 / Liger-Kernel where asked for and possible (fasttrain.models.gpu_packages)."""
    from fasttrain.models.gpu_packages import GpuPackageError, apply_liger, attention_implementation, set_attention
    try:
        impl = attention_implementation(p.attention, device, getattr(torch, p.dtype))
        if impl is not None and hasattr(model, "set_attn_implementation"):
            set_attention(model, impl)
        elif impl is not None:
            raise GpuPackageError(f"policy.attention = {p.attention!r}: the model {type(model).__name__} "
                                  "has no set_attn_implementation; use 'auto'")
        if p.liger:
            apply_liger(model, device)
    except GpuPackageError as e:
        raise ConfigError(str(e)) from None


def adapter_parameters(model: torch.nn.Module, params) -> dict[str, torch.nn.Parameter]:
    ids = {id(q) for q in params}
    named = {n: q for n, q in model.named_parameters() if id(q) in ids}
    if len(named) != len(ids):
        raise RuntimeError("attach_adapters returned parameters that are not in the model")
    bad = [n for n, q in named.items() if q.dtype != torch.float32]
    if bad:
        raise RuntimeError(f"adapter masters must be float32, got {named[bad[0]].dtype} for {bad[0]}")
    for q in named.values():
        q.requires_grad_(True)
    return named


def rollout_weights(cfg: Config, model):
    """The rollout's dense weights (fasttrain.nn.RolloutWeights) per `rollout.base_weights`, or None
    when the rollout decodes from the adapted layers themselves."""
    from fasttrain.nn.rollout_weights import rollout_weights_for
    # the compiled decode step traces plain weights (a packed oneDNN tensor has no storage to trace)
    return rollout_weights_for(cfg.rollout.base_weights, model, pack=False if cfg.rollout.compile else None)
