"""The model families fasttrain drives, and what each place of the code needs to know about one.

A family is named once here with the facts the rest of the code asks for: which checkpoint
`model_type`s it covers, which linear projections take NF4 and adapters, which of those stay in
16-bit under NF4 (and why), and its layer kinds. Each place that runs a family keeps its own
piece keyed by the family name (rollout/families.py: the decoder; train/prefix_forward.py: the
update's shared-prefix forward; plan/: its costs), so a new family is one entry here and one piece
per place, not a condition in every function.

What this is not: a loader (models/loading.py) or a model implementation (transformers' classes run).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Family", "FAMILIES", "SUPPORTED_FAMILIES", "family_of", "family_of_type", "adapter_targets", "nf4_targets",
           "text_config", "is_composite", "text_tower_key", "released_key"]


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]     # config.model_type values of checkpoints in this family
    projections: tuple[str, ...]     # nn.Linear names (last part) that take NF4 and adapters
    keep_16bit: tuple[str, ...]      # of those, the ones left in 16-bit under NF4 (they still take adapters)
    layer_kinds: tuple[str, ...]     # the token mixers its decoder layers use
    moe: bool = False                # routed experts in (some of) its layers (models/moe.py)
    mlp_width: str = "intermediate_size"   # the config key of its MLP width (a MoE: an expert's)
    # a mixture of experts' top-k routing weights renormalised to sum 1: True always, False as the
    # config's norm_topk_prob says
    renormalize_topk: bool = False
    # its checkpoints may be vision-language ones whose text tower (config.text_config) is the model
    composite: bool = False


LLAMA = Family(
    name="llama", model_types=("llama", "qwen2", "qwen3", "mistral"),
    projections=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    keep_16bit=(), layer_kinds=("full_attention",))

# Qwen3.5 (transformers' qwen3_5 / qwen3_5_text): Gated DeltaNet layers (linear_attn) and gated
# full-attention layers (self_attn), each followed by a SwiGLU MLP. in_proj_b and in_proj_a are
# narrow (one output per value head) and feed sigmoid / softplus·exp: the write strength and the
# decay of the recurrent state, which every later token reads. Measured (bench/nf4_hybrid_error.py,
# bench/results/nf4_hybrid_error.md; Gaussian and Student-t weights): alone in NF4 they add a mean
# |Δ logit| of 0.0007-0.0010 for 0.3% of the projection bytes, about 9x the error per byte of
# in_proj_qkv/z + out_proj, so they stay 16-bit (0.1% of the 27B's projection weights).
QWEN3_5 = Family(
    name="qwen3_5", model_types=("qwen3_5", "qwen3_5_text"),
    projections=("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                 "out_proj", "gate_proj", "up_proj", "down_proj"),
    keep_16bit=("in_proj_b", "in_proj_a"), layer_kinds=("linear_attention", "full_attention"), composite=True)

# Mixtures of experts (models/moe.py builds their expert blocks): the routed experts are fused 3-D
# stacks, not nn.Linear; they take NF4 and LoRA through fasttrain.nn.moe_experts. The projections
# named here are the attention ones, the dense MLP of qwen3_moe's mlp_only / non-sparse layers and
# qwen3_5_moe's shared expert. The router (mlp.gate) and the shared-expert gate are not among them:
# they stay 16-bit and frozen (docs/models.md: the measured logit error of each in NF4).
QWEN3_MOE = Family(
    name="qwen3_moe", model_types=("qwen3_moe",), projections=LLAMA.projections, keep_16bit=(),
    layer_kinds=("full_attention",), moe=True, mlp_width="moe_intermediate_size")
QWEN3_5_MOE = Family(
    name="qwen3_5_moe", model_types=("qwen3_5_moe", "qwen3_5_moe_text"), projections=QWEN3_5.projections,
    keep_16bit=QWEN3_5.keep_16bit, layer_kinds=QWEN3_5.layer_kinds, moe=True, renormalize_topk=True, composite=True,
    mlp_width="moe_intermediate_size")

FAMILIES: tuple[Family, ...] = (LLAMA, QWEN3_5, QWEN3_MOE, QWEN3_5_MOE)
SUPPORTED_FAMILIES: tuple[str, ...] = tuple(t for f in FAMILIES for t in f.model_types)


def family_of_type(model_type: str, where: str = "model") -> Family:
    """The family of a checkpoint's model_type; a ValueError naming the supported ones otherwise."""
    for f in FAMILIES:
        if model_type in f.model_types:
            return f
    raise ValueError(f"{where}: model_type {model_type!r} is not supported; fasttrain supports "
                     f"{', '.join(SUPPORTED_FAMILIES)}")


def family_of(model, where: str = "model") -> Family:
    """The family of a model (a PEFT wrapper, a *ForCausalLM) or of a transformers config."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    cfg = getattr(model, "config", model)
    return family_of_type(getattr(cfg, "model_type", None), where)


def _family_or_none(model_type) -> Family | None:
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def adapter_targets(model) -> tuple[str, ...]:
    """Every projection of `model`'s family that takes an adapter (16-bit or NF4 base); a model
    outside the families gets the Llama names."""
    try:
        return family_of(model).projections
    except ValueError:
        return LLAMA.projections


def nf4_targets(model) -> tuple[str, ...]:
    """The projections to quantize to NF4 in `model`'s family (its projections but the 16-bit ones);
    a model outside the families (a user factory's Llama-like model) gets the Llama names."""
    try:
        f = family_of(model)
    except ValueError:
        f = LLAMA
    return tuple(p for p in f.projections if p not in f.keep_16bit)


def text_config(config):
    """The config of the text tower: a composite vision-language config (qwen3_5, qwen3_5_moe) gives its
    text_config (the vision tower is never built or loaded); any other config is returned as is."""
    family = _family_or_none(config.model_type)
    sub = getattr(config, "text_config", None) if family is not None and family.composite else None
    return sub if sub is not None else config


# A qwen3_5 or qwen3_5_moe (vision-language) checkpoint names its text tower's tensors "model.language_model.X" for
# the text model's "model.X" (lm_head is lm_head); its vision tower ("model.visual.") and its
# multi-token-prediction head ("mtp.") are not part of the text model. transformers' Qwen3_5ForCausalLM
# renames and skips the same way when it loads such a checkpoint.
_TEXT_TOWER = ("model.", "model.language_model.")
_NOT_TEXT = ("model.visual.", "mtp.")


def is_composite(config) -> bool:
    """Whether a config is a vision-language one whose text tower is what fasttrain loads."""
    return text_config(config) is not config


def text_tower_key(key: str, config) -> str | None:
    """The text model's name for checkpoint tensor `key` of a checkpoint with `config`, or None for a
    tensor outside the text tower (the vision tower, the MTP head). Other configs: the key itself."""
    family = _family_or_none(config.model_type)
    if family is None or not family.composite:
        return key
    if key.startswith(_NOT_TEXT):
        return None
    if is_composite(config) and key.startswith(_TEXT_TOWER[1]):
        return _TEXT_TOWER[0] + key[len(_TEXT_TOWER[1]):]
    return key


def released_key(key: str, config) -> str:
    """The checkpoint's name for the text model's tensor `key` (the inverse of text_tower_key)."""
    if is_composite(config) and key.startswith(_TEXT_TOWER[0]):
        return _TEXT_TOWER[1] + key[len(_TEXT_TOWER[0]):]
    return key
