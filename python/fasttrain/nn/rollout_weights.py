"""Dense rollout weights: every adapted layer's merged weight W + s·B·A (DoRA: m/‖W + s·B·A‖ ⊙ it)
kept in the model's dtype for sampling only, refreshed when the adapters change. The layers are
NF4Linear (W decoded from 4 bits) or DenseLinear (W the model's 16-bit weight).

Why: a decode step multiplies a few rows (one token per answer) by every weight of the model, so
its time is the time to read the weights. From NF4 each read also decodes 4-bit codes and adds the
adapter's two small products per projection (a 16-bit base still pays those, and DoRA's scale); from a dense merged copy it is one plain GEMM per
projection, the same work as decoding a plain bf16 model. The adapters only change at optimizer
steps, so the merge (one pass over the weights) is paid once per step against the dozens of decode
steps that read them. q/k/v and gate/up are stored side by side (one GEMM each per layer).

Packed for the CPU's GEMM (bf16 where the CPU multiplies bf16 natively): the merged weights are kept
in oneDNN's blocked layout (torch.ops.mkldnn._reorder_linear_weight, the form inductor's CPU freezing
uses) instead of as plain matrices, and `rollout_linear` multiplies by them with
torch.ops.mkldnn._linear_pointwise. F.linear on a plain bf16 weight reorders the weight into that
layout on every call: a decode step's GEMM of 48 rows then reads and writes each weight once more
than it needs to. Measured on a 2-core AMX Xeon, SmolLM2's projections at 48 rows: 0.94 ms a layer
plain, 0.46 ms packed; the same bits out (oneDNN runs the same kernel either way). The packed copy
replaces the plain one (the same bytes); a refresh merges one group into a scratch matrix and packs
it. The compiled decode step (rollout.compile) takes plain weights: RolloutWeights(model, pack=False).

The output head is packed the same way (`head`): it is frozen, so it is packed once, when a decoder
first asks for it, and kept with these weights; at SmolLM2's 48 rows its [576 -> 49152] GEMM took
5.58 ms a decode step plain and 2.47 ms packed on the AMX Xeon.

What it costs: 2 bytes per base weight in bf16 (the model's dtype), on top of the copy that training
uses (NF4, or the 16-bit weight itself): `dense_bytes(model)` says how much, `rollout_weights_for`
keeps it when the setting asks for it (for "auto": when it is under a share of the memory free now). What it is not: a training
path (the update always runs on the adapted layers).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from fasttrain.nn.adapted_linear import AdaptedLinear

__all__ = ["RolloutWeights", "PackedHead", "dense_bytes", "rollout_weights_for", "use_dense", "rollout_linear", "AUTO_SHARE"]

# `rollout.base_weights = "auto"` keeps the dense copy when it takes at most this share of the memory
# free when the trainer starts; the rest is left to the update's activations and the KV cache.
# fasttrain.plan makes the same choice from the same rule.
AUTO_SHARE = 0.25

_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# oneDNN picks the blocked layout for this many rows; 16 to 256 measured the same for a decode step's
# 12 to 48 rows and a prefill's 1,188 on the AMX Xeon (1 was 1.5x slower)
PACK_ROWS = 64


def packable(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether rollout weights of `dtype` on `device` are kept packed (see the module header): bf16
    on a CPU whose bf16 GEMMs are native, where this torch has oneDNN's packed linear."""
    from fasttrain.nn.dense_linear import cpu_bf16_native
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and cpu_bf16_native())


def rollout_linear(x: Tensor, w: Tensor) -> Tensor:
    """x·wᵀ for a rollout weight `w` from RolloutWeights, packed or plain."""
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    return torch.nn.functional.linear(x, w)


class PackedHead:
    """An output head x·Wᵀ with W in oneDNN's packed layout (RolloutWeights.head); x [..., H]."""

    def __init__(self, packed: Tensor):
        self.packed = packed

    def __call__(self, x: Tensor) -> Tensor:
        if x.dim() == 1:
            return rollout_linear(x[None], self.packed)[0]
        return rollout_linear(x, self.packed)


def _adapted(model: nn.Module) -> list[AdaptedLinear]:
    return [m for m in model.modules() if isinstance(m, AdaptedLinear)]


def dense_bytes(model: nn.Module) -> int:
    """Bytes of the dense copy of every adapted layer's weight in its layer's dtype."""
    return sum(m.in_features * m.out_features * torch.empty((), dtype=m.weight_dtype).element_size()
               for m in _adapted(model))


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    from fasttrain.host import meminfo_bytes
    return meminfo_bytes("MemAvailable")


def use_dense(choice: str, dense: int, free: int) -> bool:
    """Whether the rollout decodes from a dense copy: `choice` is rollout.base_weights, `dense` the
    copy's bytes, `free` the bytes free on the device once the model is built."""
    if choice not in ("auto", "nf4", "dequantized"):
        raise ValueError(f"rollout.base_weights must be auto, nf4 or dequantized, got {choice!r}")
    return choice == "dequantized" or (choice == "auto" and dense <= AUTO_SHARE * free)


def rollout_weights_for(choice: str, model: nn.Module, pack: bool | None = None) -> "RolloutWeights | None":
    """The dense copy `rollout.base_weights = choice` asks for, or None: "nf4", "auto" when the copy
    would take more than AUTO_SHARE of the memory free now on the model's device, or a model with
    no adapted layers (nothing to merge). pack: RolloutWeights' (False for a compiled decode step)."""
    layers = _adapted(model)
    if not layers or not use_dense(choice, dense_bytes(model), _free_bytes(layers[0].device)):
        return None
    return RolloutWeights(model, pack=pack)


def _merged(m: AdaptedLinear, ct: torch.dtype) -> Tensor:
    """W + s·B·A (DoRA: times m / ‖W + s·B·A‖ per row) in the compute dtype `ct`."""
    w = m.base_weight(ct)
    w = w.addmm_(m.lora_B.detach().to(ct), m.lora_A.detach().to(ct), alpha=m.scale)
    if m.adapter == "dora":
        w = w.mul_((m.lora_magnitude.detach().to(ct) / w.norm(dim=1)).unsqueeze(1))
    return w


def _storage_id(p: Tensor) -> int:
    """Where a parameter's values live (a `.data =` swap keeps `_version`); a fake tensor (the
    fake-CUDA trace) has no storage address, so its identity stands in."""
    if is_fake(p):
        return id(p)
    return p.data_ptr()


class RolloutWeights:
    """Merged dense weights of a model's adapted layers, by module, for the rollout decoder.

    `refresh()` re-merges the layers whose adapter changed since the last call (version counters
    of A, B and m) and is cheap when nothing changed; call it before each rollout. `linear(mod)`
    is the merged weight of `mod` or None; `fused(mods)` the weight of several projections of one
    input stacked by rows (q/k/v, gate/up), or None. Multiply by either with `rollout_linear`.
    pack: keep them in oneDNN's layout (see the module header); None packs where `packable` says.
    Packed, a projection of a group has no weight of its own (linear gives None: the decoder then
    runs the module itself).
    """

    def __init__(self, model: nn.Module, pack: bool | None = None):
        self.model = model
        self._weight: dict[int, Tensor] = {}       # id(module) -> view into its group's buffer
        self._fused: dict[tuple[int, ...], Tensor] = {}
        self._seen: dict[int, tuple] = {}
        layers = _adapted(model)
        if not layers:
            raise ValueError("RolloutWeights: the model has no adapted layers "
                             "(call quantize_model or adaptable_model first)")
        if pack is None:
            pack = all(packable(m.weight_dtype, m.device) for m in layers)
        elif pack and not all(packable(m.weight_dtype, m.device) for m in layers):
            raise ValueError("RolloutWeights: pack=True needs bf16 layers on a CPU with native bf16 GEMMs "
                             "and oneDNN (fasttrain.nn.rollout_weights.packable)")
        self.packed = bool(pack)
        # (modules, shape): each buffer the weights live in, one per group or ungrouped layer
        self._units: list[tuple[tuple[AdaptedLinear, ...], tuple[int, ...]]] = []
        grouped: set[int] = set()
        for parent in model.modules():
            for names in _GROUPS:
                mods = [getattr(parent, n, None) for n in names]
                if all(isinstance(m, AdaptedLinear) for m in mods) and \
                        len({(m.in_features, m.weight_dtype, m.device) for m in mods}) == 1:
                    self._units.append((tuple(mods), tuple(id(m) for m in mods)))
                    grouped.update(id(m) for m in mods)
        for m in layers:
            if id(m) not in grouped:
                self._units.append(((m,), (id(m),)))
        if not self.packed:
            for mods, key in self._units:
                buf = self._plain_buffer(mods)
                if len(mods) > 1:
                    self._fused[key] = buf
                for m, part in zip(mods, buf.split([m.out_features for m in mods])):
                    self._weight[id(m)] = part
        self._layers = layers
        self._head: tuple[tuple, PackedHead] | None = None
        self.refresh()

    @staticmethod
    def _plain_buffer(mods: tuple[AdaptedLinear, ...]) -> Tensor:
        return torch.empty(sum(m.out_features for m in mods), mods[0].in_features, dtype=mods[0].weight_dtype,
                           device=mods[0].device)

    @staticmethod
    def _key(m: AdaptedLinear) -> tuple:
        ps = m.adapter_parameters() if m.adapter is not None else []
        return (m.adapter, m.adapters_enabled, m.scale) + tuple((p._version, _storage_id(p)) for p in ps)

    @staticmethod
    def _merge_into(m: AdaptedLinear, w: Tensor) -> None:
        if m.adapter is None or not m.adapters_enabled:
            w.copy_(m.base_weight(w.dtype))
        else:
            w.copy_(_merged(m, torch.float64 if w.dtype == torch.float64 else torch.float32))

    @torch.no_grad()
    def refresh(self) -> int:
        """Re-merge the layers whose adapter changed; returns how many were merged (packed, the other
        layers of a changed layer's group are merged again with it, and not counted)."""
        n = 0
        for mods, key in self._units:
            keys = [self._key(m) for m in mods]
            changed = [m for m, k in zip(mods, keys) if self._seen.get(id(m)) != k]
            if not changed:
                continue
            if self.packed:
                buf = self._plain_buffer(mods)
                for m, part in zip(mods, buf.split([m.out_features for m in mods])):
                    self._merge_into(m, part)
                packed = torch.ops.mkldnn._reorder_linear_weight(buf, PACK_ROWS)
                del buf
                if len(mods) > 1:
                    self._fused[key] = packed
                else:
                    self._weight[key[0]] = packed
            else:
                for m in changed:
                    self._merge_into(m, self._weight[id(m)])
            for m, k in zip(mods, keys):
                self._seen[id(m)] = k
            n += len(changed)
        return n

    def forget(self) -> None:
        """Drop every merge: the next refresh merges (and packs) all layers again. Packed, the
        weights' memory (and the packed head's) is freed until then."""
        self._seen.clear()
        self._head = None
        if self.packed:
            self._fused.clear()
            self._weight.clear()

    def head(self, head: nn.Module):
        """The output head a rollout decoder calls: packed (PackedHead, made once and kept) where these
        weights are packed and `head` is a bias-free nn.Linear of a packable dtype, else
        fasttrain.nn.dense_linear.rollout_head(head)."""
        from fasttrain.nn.dense_linear import rollout_head
        if not self._packs_head(head):
            return rollout_head(head)
        w = head.weight
        key = (_storage_id(w), w._version, tuple(w.shape), w.dtype)
        if self._head is None or self._head[0] != key:
            self._head = None                       # the old packed copy goes before the new one is made
            with torch.no_grad():
                self._head = (key, PackedHead(torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(),
                                                                                       PACK_ROWS)))
        return self._head[1]

    def linear(self, mod: nn.Module) -> Tensor | None:
        return self._weight.get(id(mod))

    def fused(self, mods: tuple[nn.Module, ...]) -> Tensor | None:
        return self._fused.get(tuple(id(m) for m in mods))

    def nbytes(self, head: bool = True) -> int:
        """The weights' bytes as plain matrices in their dtype (a packed copy holds the same values);
        packed, with the output head's packed copy (made at the first rollout, kept) unless head=False."""
        total = sum(sum(m.out_features for m in mods) * mods[0].in_features
                    * torch.empty((), dtype=mods[0].weight_dtype).element_size() for mods, _ in self._units)
        lm_head = getattr(self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model,
                          "lm_head", None)
        if self._packs_head(lm_head) and head:
            total += lm_head.weight.numel() * lm_head.weight.element_size()
        return total

    def _packs_head(self, head) -> bool:
        w = getattr(head, "weight", None)
        return (self.packed and isinstance(head, nn.Linear) and head.bias is None and isinstance(w, Tensor)
                and w.dim() == 2 and packable(w.dtype, w.device) and not is_fake(w))
