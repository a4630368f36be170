"""Each model family's surgery, by name (SURGERY): what turns a model of the family, as transformers
builds or the streamed load reads it, into the one fasttrain trains, before the NF4 and adapter
surgery every family's projections take (fasttrain.nn.surgery, on the family's projections,
models/families.py). A dense family has none; a mixture of experts' sparse blocks become
fasttrain.nn.MoEBlock (models/moe.py, on a built model), and the streamed NF4 load quantizes each
expert as it is read (models/moe_stream.py's ExpertCollector, the load's claim on the tensors no
projection holds).

    model = family_surgery(model, nf4=True)       # in place; a dense family's model unchanged
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .families import family_of, text_config
from .moe import family_renormalizes, moe_surgery

__all__ = ["FamilySurgery", "SURGERY", "family_surgery", "streamed_claim"]


def _expert_collector(family, config):
    """The streamed load's piece for a mixture of experts (each expert quantized as read)."""
    from .moe_stream import ExpertCollector
    config = text_config(config)          # a vision-language checkpoint's MoE facts are its text tower's
    return ExpertCollector(config.num_experts_per_tok, family_renormalizes(family, config))


@dataclass(frozen=True)
class FamilySurgery:
    """`built(model, nf4=...)`: the family's surgery on a built model (in place, returns it);
    `streamed(family, config)`: its claim for the streamed NF4 load (models/stream_load.py); None
    where the family has none."""

    built: Callable | None = None
    streamed: Callable | None = None


_MOE = FamilySurgery(built=moe_surgery, streamed=_expert_collector)

SURGERY: dict[str, FamilySurgery] = {
    "llama": FamilySurgery(),
    "qwen3_5": FamilySurgery(),
    "qwen3_moe": _MOE,
    "qwen3_5_moe": _MOE,
}


def family_surgery(model, nf4: bool):
    """The surgery of `model`'s family on it (in place; returns the model). A model outside the
    families (a user factory's Llama-shaped one, models/family_check.py) has none."""
    try:
        name = family_of(model).name
    except ValueError:
        return model
    built = SURGERY[name].built
    return model if built is None else built(model, nf4=nf4)


def streamed_claim(family, config):
    """The streamed NF4 load's claim of `family` for a checkpoint with `config`, or None."""
    streamed = SURGERY[family.name].streamed
    return None if streamed is None else streamed(family, config)
