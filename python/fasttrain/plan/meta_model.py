"""The policy built from its config.json alone, on the meta device: no weight is read.

`model_config(spec)` finds the config (a bundled name such as "qwen2.5-32b", a config.json file, or
a model folder holding one); `meta_policy(config, ...)` builds the causal LM with transformers on
the meta device, applies fasttrain's own surgery (NF4, or the 16-bit weights made adaptable for
`policy.quantize = "none"`) and adapters (fasttrain.nn, the same code a run uses, running on
shape-only tensors), and returns the shapes and resident bytes the plan
needs, each byte counted from a real tensor's shape and dtype.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from fasttrain.models import SUPPORTED_FAMILIES

__all__ = ["ModelShape", "MoEShape", "DeltaShape", "bundled_configs", "model_config", "meta_policy", "hybrid_state"]

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16,
           "float64": torch.float64}


def bundled_configs() -> list[str]:
    return sorted(Path(str(p)).stem for p in resources.files("fasttrain.models").joinpath("configs").iterdir()
                  if str(p).endswith(".json"))


def model_config(spec: str) -> dict:
    """The config dict of `spec`: a bundled name (see bundled_configs()), a config.json, or a
    folder with one. Keys starting with "_" (source notes) are dropped."""
    s = str(spec)
    bundled = resources.files("fasttrain.models").joinpath("configs", f"{s.lower()}.json")
    if bundled.is_file():
        text = bundled.read_text()
    else:
        p = Path(s).expanduser()
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise FileNotFoundError(
                f"--model {s!r}: not a bundled config nor a config.json / model folder; bundled: "
                f"{', '.join(bundled_configs())}")
        text = p.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--model {s!r}: config.json is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--model {s!r}: config.json must hold a JSON object")
    return {k: v for k, v in data.items() if not k.startswith("_")}


@dataclass(frozen=True)
class MoEShape:
    """A mixture of experts' routed experts (fasttrain.plan.moe_memory)."""

    experts: int                     # E experts per MoE layer
    active: int                      # k experts a token runs through
    width: int                       # I, an expert's intermediate width
    layers: int                      # MoE layers
    shared: int                      # the dense MLP of a MoE layer: the shared expert's width (0: none)


@dataclass(frozen=True)
class DeltaShape:
    """A hybrid's Gated DeltaNet heads (fasttrain.plan.hybrid_memory)."""

    key_heads: int                   # Hk
    key_dim: int                     # Dk
    value_heads: int                 # Hv
    value_dim: int                   # Dv
    conv_kernel: int                 # K, the causal conv's taps


@dataclass
class ModelShape:
    """What the memory and time model need, read off the built (meta) model."""
    name: str
    model_type: str
    architecture: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    dtype: torch.dtype
    params: int                      # parameters of the original model (embedding counted once)
    linear_params: int               # weights of the adapted projections (NF4 or 16-bit)
    projections: list = field(default_factory=list)   # (out, in) of each adapted layer
    quantize: str = "nf4"            # "nf4" | "none"
    adapter_params: int = 0
    adapter_kind: str = "lora"
    rank: int = 0
    # part -> bytes; "nf4_base" is the projections' frozen base: packed NF4 + absmax, or with
    # quantize "none" the model's own 16-bit weights (what decode reads either way)
    resident: dict = field(default_factory=dict)
    stored_w: int = 0                # bytes per element in the checkpoint (config.json's dtype); 0: unknown
    fp8_block: tuple = ()            # (rows, cols) of the scale blocks when the projections are stored block-FP8
    # hybrids (Gated DeltaNet + full attention): the layers that hold a KV cache (None: all), the
    # fixed per-sequence state of the others (conv window in the model's dtype + float32 recurrent
    # state, bytes per row), and the state math per token (FLOPs, outside the projections)
    full_layers: int | None = None
    state_bytes: int = 0             # conv_bytes + recurrent_bytes
    conv_bytes: int = 0              # per row: the conv windows of every Gated DeltaNet layer (model dtype)
    recurrent_bytes: int = 0         # per row: the recurrent states [Hv, Dk, Dv] of every such layer (float32)
    state_flops: float = 0.0
    delta: DeltaShape | None = None  # Gated DeltaNet heads; None for a model without such layers
    trailing_full: int = 0           # full-attention layers after the last Gated DeltaNet layer
    rotary_dim: int = 0              # dims the rotary embedding turns (0: all of head_dim)
    context: int = 0                 # max_position_embeddings (prompt + answer); 0: not given
    # mixtures of experts (fasttrain.plan.moe_memory): the routed experts; None for a dense model
    moe: MoEShape | None = None
    moe_active_params: int = 0       # expert weights one token runs through (k of E per MoE layer)
    # the update's attention backward is fasttrain's (fasttrain.ops.attention's rule for this model
    # on the planned device) for every call whose one row of scores fits its chunk: set by
    # fasttrain.plan.memory for the update phase only
    fasttrain_attention: bool = False

    @property
    def kv_layers(self) -> int:
        return self.layers if self.full_layers is None else self.full_layers

    @property
    def w(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def fasttrain_attention_call(m: ModelShape, h: int, M: int, L: int) -> bool:
    """Whether an attention call of the update with h heads, M query rows and L keys per row runs
    fasttrain's backward: the model-wide rule (m.fasttrain_attention) and the call's size
    (fasttrain.ops.attention's chunk holds at least one row's scores)."""
    from fasttrain.ops.attention import row_fits
    return m.fasttrain_attention and M > 0 and row_fits(h * M * L)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def meta_policy(config: dict | object, name: str = "model", dtype: str = "bfloat16", adapter: str = "lora",
                rank: int = 32, alpha: float = 64.0, targets: tuple[str, ...] = (), double_quant: bool = False,
                quantize: str = "nf4") -> ModelShape:
    """Build the NF4 (or, quantize "none", 16-bit) + adapter policy of `config` (a config dict or a
    transformers config) on the meta device and measure it. Raises ValueError for an unsupported
    architecture or quantize value."""
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

    from fasttrain.nn import adaptable_model, adapted_layers, attach_adapters, quantize_model
    from fasttrain.nn.nf4_linear import NF4Linear

    from fasttrain.models.block_fp8 import block_fp8_format
    from fasttrain.models.families import text_config
    fp8 = block_fp8_format(config, where=name)
    if isinstance(config, PretrainedConfig):
        cfg = text_config(config)
        stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    else:
        data = dict(config)
        mt = data.pop("model_type", None)
        if mt not in SUPPORTED_FAMILIES:
            raise ValueError(f"{name}: model_type {mt!r} is not supported by fasttrain; supported: "
                             f"{', '.join(SUPPORTED_FAMILIES)}")
        from fasttrain.models.families import family_of_type
        widths = (family_of_type(mt, name).mlp_width,)
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") + widths:
            if not isinstance(data.get(key), int) or data[key] <= 0:
                raise ValueError(f"{name}: config.json needs a positive integer {key!r}")
        stored = data.pop("dtype", None) or data.pop("torch_dtype", None)
        data.pop("torch_dtype", None)
        data.pop("quantization_config", None)         # the meta model is built 16-bit (or NF4), as loaded
        cfg = text_config(AutoConfig.for_model(mt, **data))
    if cfg.model_type not in SUPPORTED_FAMILIES:
        raise ValueError(f"{name}: model_type {cfg.model_type!r} is not supported by fasttrain; supported: "
                         f"{', '.join(SUPPORTED_FAMILIES)}")
    if quantize not in ("nf4", "none"):
        raise ValueError(f"policy.quantize {quantize!r}: allowed 'nf4', 'none'")
    if dtype not in _DTYPES:
        raise ValueError(f"policy.dtype {dtype!r}: allowed {', '.join(_DTYPES)}")
    td = _DTYPES[dtype]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=td)
    ids = set()
    params = 0
    for p in model.parameters():            # tied embeddings are one tensor: counted once
        if id(p) not in ids:
            ids.add(id(p))
            params += p.numel()
    from fasttrain.models.families import adapter_targets, nf4_targets
    from fasttrain.models.family_surgery import family_surgery
    family_surgery(model, nf4=quantize == "nf4")       # the family's own (the MoE families' experts), as build_policy
    if quantize == "nf4":
        quantize_model(model, targets=nf4_targets(model), double_quant=double_quant)
    kept = tuple(t for t in adapter_targets(model) if quantize == "none" or t not in nf4_targets(model))
    if kept:                          # "none", or a family's 16-bit projections under NF4 (as build_policy)
        adaptable_model(model, targets=kept)
    adapters = attach_adapters(model, kind=adapter, r=rank, alpha=alpha, targets=list(targets) or None)
    layers = list(adapted_layers(model))
    base = wsq = 0
    counted: set[int] = set()
    for _, m in layers:
        if not isinstance(m, NF4Linear):      # 16-bit (quantize "none", or a family's kept projections)
            base += _bytes(m.weight)
        for bn, b in m.named_buffers(recurse=False):
            if b is None or bn == "weight_sq_norm":
                continue
            if bn == "absmax_code":                # one shared 256-entry code per device
                if id(b) in counted:
                    continue
                counted.add(id(b))
            base += _bytes(b)
        if m.bias is not None:
            base += _bytes(m.bias)
        if getattr(m, "weight_sq_norm", None) is not None:
            wsq += _bytes(m.weight_sq_norm)
    from fasttrain.plan.moe_memory import moe_shape
    moe = moe_shape(model, cfg)           # the experts' stacks, router and LoRA apart ({} if dense)
    adapter_bytes = sum(_bytes(p) for p in adapters) - moe.get("resident", {}).get("moe_adapter_masters", 0)
    inside = {id(t) for _, m in layers for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))}
    inside |= moe.pop("tensors", set())
    other = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in inside or id(t) in other:
            continue
        other[id(t)] = _bytes(t)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return ModelShape(**hybrid_state(cfg, td), moe=MoEShape(**moe["moe"]) if moe else None, moe_active_params=moe.get("active", 0),
        name=name, model_type=cfg.model_type, architecture=type(model).__name__,
        layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, intermediate=moe.get("intermediate", getattr(
            cfg, "intermediate_size", 0)),
        heads=cfg.num_attention_heads, kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=head_dim, vocab=cfg.vocab_size, tied=bool(getattr(cfg, "tie_word_embeddings", False)),
        dtype=td, params=params, linear_params=sum(m.in_features * m.out_features for _, m in layers),
        projections=[(m.out_features, m.in_features) for _, m in layers], quantize=quantize,
        adapter_params=sum(p.numel() for p in adapters), adapter_kind=adapter, rank=rank,
        resident={"nf4_base": base, "dense_parts": sum(other.values()), "adapter_masters": adapter_bytes,
                  "dora_norms": wsq, **moe.get("resident", {})}, stored_w=_stored_w(stored),
        fp8_block=fp8.block if fp8 is not None else (),
        context=int(getattr(cfg, "max_position_embeddings", 0) or 0))


def hybrid_state(cfg, dtype: torch.dtype) -> dict:
    """full_layers, trailing_full (full-attention layers after the last Gated DeltaNet one),
    state_bytes (= conv_bytes + recurrent_bytes), state_flops, delta (the Gated DeltaNet head dims)
    and rotary_dim of a hybrid's config (nothing for a plain transformer).
    Per Gated DeltaNet layer and sequence: the conv window (K-1 inputs of the 2·Hk·Dk + Hv·Dv conv
    channels, model dtype) and the recurrent state [Hv, Dk, Dv] in float32 (float64 for a float64
    model). Per token and layer the recurrence reads and writes the state: decay, Sᵀk, the rank-1
    write and Sᵀq, about 8·Hv·Dk·Dv FLOPs; the conv 2·K per channel."""
    kinds = getattr(cfg, "layer_types", None)
    if not kinds or "linear_attention" not in kinds:
        return {}
    n_lin = sum(k == "linear_attention" for k in kinds)
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    Dk, Dv, K = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    w = torch.empty((), dtype=dtype).element_size()
    channels = 2 * Hk * Dk + Hv * Dv
    conv = (K - 1) * channels * w
    recurrent = Hv * Dk * Dv * (8 if dtype == torch.float64 else 4)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    trailing = len(kinds) - 1 - max(i for i, k in enumerate(kinds) if k == "linear_attention")
    return {"full_layers": len(kinds) - n_lin, "trailing_full": trailing, "state_bytes": n_lin * (conv + recurrent),
            "conv_bytes": n_lin * conv, "recurrent_bytes": n_lin * recurrent,
            "state_flops": n_lin * (8.0 * Hv * Dk * Dv + 2.0 * K * channels), "delta": DeltaShape(Hk, Dk, Hv, Dv, K),
            "rotary_dim": int(head_dim * factor)}


def _stored_w(dtype) -> int:
    """Bytes per element of config.json's dtype (a name or a torch.dtype); 0 when not given."""
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    t = _DTYPES.get(str(dtype).removeprefix("torch.")) if dtype else None
    return t.itemsize if t is not None else 0
