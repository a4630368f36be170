"""MoEExperts and MoEBlock: a mixture-of-experts MLP whose routed experts are NF4 (or the model's
16-bit stacks) with LoRA per expert, and whose routing can be recorded or forced.

MoEBlock takes the place of transformers' sparse MoE block (Qwen3-MoE, Qwen3.5-MoE) with the same
submodule names, so parameter names stay the model's: `gate` (the router, weight [E, H], 16-bit),
`experts` (MoEExperts: the fused stacks gate_up [E, 2I, H] and down [E, H, I], as
fasttrain.ops.ExpertStack buffers, and the LoRA factors), and for Qwen3.5-MoE `shared_expert` (the
model's own dense MLP, whose projections the usual surgery adapts) and `shared_expert_gate`
(Linear [1, H], 16-bit). Forward, over any leading shape:
    logits = h·gateᵀ (float32); p = softmax(logits); e = top-k(p) (or the forced experts);
    w = p[e], renormalised to sum 1 when the family renormalises; y = experts(h, e, w)
    (+ sigmoid(shared_expert_gate(h)) · shared_expert(h)).

Routing: `routing` is None (the block routes by itself), or a RoutingSlot that the caller sets for
one forward (`routing_slot(blocks, slot)`): the experts to force per block [N, k] (the weights
still come from this block's router: softmax over all E logits gathered at the forced experts,
renormalised where the family does, so a trained router keeps its gradient), and what the block's
own router chose, kept for the record of the rollout and the update's disagreement statistics.
The router is frozen unless moe.train_router asks for it.

LoRA on the experts: rank r per expert, A [E, r, in], B [E, out, r] fp32 masters, initialised as
PEFT initialises each expert's factor (A uniform in ±1/√in, B zero), scale α/r (α/√r rsLoRA).
DoRA on the experts is refused: its per-row norm over a [E, out, in] stack is not in PEFT's
target_parameters format (PEFT has no DoRA there) and no loader of the result exists.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from fasttrain.ops.moe_experts import ExpertStack, moe_experts

__all__ = ["MoEExperts", "MoEBlock", "RoutingSlot", "routing_slot", "moe_blocks", "moe_expert_layers"]

_FIELDS = ("weight", "qweight", "absmax", "qabsmax", "absmax2", "code", "offset")


class RoutingSlot:
    """One forward's routing: `forced` {block: experts [N, k]} to use, and `chosen` {block: the
    block's own top-k [N, k]} filled in as the blocks run (detached)."""

    def __init__(self, forced: dict | None = None):
        self.forced = forced or {}
        self.chosen: dict = {}

    def forced_for(self, block) -> torch.Tensor | None:
        return self.forced.get(block)

    def seen(self, block, own: torch.Tensor) -> None:
        self.chosen[block] = own.detach()

    def logits(self, block, logits: torch.Tensor) -> None:
        """The block's router logits [N, E] of this forward: not kept here (the update's slot keeps
        them for the load-balancing loss)."""


@contextmanager
def routing_slot(blocks, slot: RoutingSlot | None):
    """Inside the block every MoEBlock of `blocks` routes by `slot` (None: by itself)."""
    before = [b.routing for b in blocks]
    for b in blocks:
        b.routing = slot
    try:
        yield slot
    finally:
        for b, r in zip(blocks, before):
            b.routing = r


class MoEExperts(nn.Module):
    """The routed experts of one layer: frozen stacks + optional LoRA per expert."""

    def __init__(self, gate_up: ExpertStack, down: ExpertStack):
        super().__init__()
        self.num_experts = gate_up.E
        self.hidden, self.intermediate = gate_up.in_features, down.in_features
        self._meta = {}
        for name, st in (("gate_up", gate_up), ("down", down)):
            self._meta[name] = (st.E, st.out_features, st.in_features, st.dtype, st.blocksize)
            for f, t in st.tensors().items():
                self.register_buffer(f"{name}_{f}", t)
        self.adapter: str | None = None
        self.r, self.alpha, self.rslora, self.scale = 0, 0.0, False, 0.0
        for n in ("gate_up_lora_A", "gate_up_lora_B", "down_lora_A", "down_lora_B"):
            self.register_parameter(n, None)
        self.adapters_enabled = True

    def stack(self, name: str) -> ExpertStack:
        """The ExpertStack "gate_up" or "down" over this module's buffers (as moved by .to())."""
        E, out_f, in_f, dtype, bs = self._meta[name]
        fields = {f: getattr(self, f"{name}_{f}") for f in _FIELDS if hasattr(self, f"{name}_{f}")}
        return ExpertStack(E, out_f, in_f, dtype, blocksize=bs, **fields)

    @property
    def nf4(self) -> bool:
        return hasattr(self, "gate_up_qweight")

    @property
    def device(self) -> torch.device:
        return next(self.buffers()).device

    def attach_adapter(self, kind: str = "lora", r: int = 32, alpha: float = 64, rslora: bool = False,
                       generator: torch.Generator | None = None) -> list[nn.Parameter]:
        if kind == "dora":
            raise ValueError("policy.adapter = 'dora': DoRA on mixture-of-experts experts is not built. PEFT's "
                             "target_parameters LoRA (the format fasttrain saves expert adapters in) has no DoRA, "
                             "so nothing could load the result; use policy.adapter = 'lora' (the attention "
                             "projections then take LoRA too), or policy.targets without the experts.")
        if kind != "lora" or not isinstance(r, int) or r <= 0:
            raise ValueError(f"attach_adapter: kind 'lora' and a positive int r expected, got {kind!r}, {r!r}")
        E, dev, params = self.num_experts, self.device, []
        for name in ("gate_up", "down"):
            _, out_f, in_f, _, _ = self._meta[name]
            bound = 1.0 / math.sqrt(in_f)
            a = torch.empty(E, r, in_f, dtype=torch.float32, device=dev).uniform_(-bound, bound, generator=generator)
            setattr(self, f"{name}_lora_A", nn.Parameter(a))
            setattr(self, f"{name}_lora_B", nn.Parameter(torch.zeros(E, out_f, r, dtype=torch.float32, device=dev)))
            params += [getattr(self, f"{name}_lora_A"), getattr(self, f"{name}_lora_B")]
        self.adapter, self.r, self.alpha, self.rslora = kind, r, float(alpha), bool(rslora)
        self.scale = float(alpha) / (math.sqrt(r) if rslora else r)
        return params

    def adapter_parameters(self) -> list[nn.Parameter]:
        return [p for p in (self.gate_up_lora_A, self.gate_up_lora_B, self.down_lora_A, self.down_lora_B)
                if p is not None]

    def lora(self, name: str):
        a = getattr(self, f"{name}_lora_A")
        return None if a is None or not self.adapters_enabled else (a, getattr(self, f"{name}_lora_B"))

    def forward(self, x: torch.Tensor, expert_index: torch.Tensor, routing_weights: torch.Tensor) -> torch.Tensor:
        return moe_experts(x, expert_index, routing_weights, self.stack("gate_up"), self.stack("down"),
                           self.lora("gate_up"), self.lora("down"), self.scale)

    def merged_expert(self, name: str, e: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Expert e's W_e + s·B_e·A_e [out, in] of stack `name` ("gate_up" or "down"): the base decoded
        from NF4 (or the 16-bit weight) in fp32, the LoRA product added in fp32, rounded once to dtype
        (float64 stays float64), as the dense layers' merged_weight does."""
        from fasttrain.ops import reference as R
        st = self.stack(name)
        ct = torch.float64 if dtype == torch.float64 else torch.float32
        w = st.weight[e].to(ct) if st.weight is not None else R.nf4_decode_weight(
            st.qweight[e], st.expert_state(e), torch.float32).to(ct)
        a = getattr(self, f"{name}_lora_A")
        if a is not None:
            w = w + self.scale * (getattr(self, f"{name}_lora_B")[e].detach().to(ct) @ a[e].detach().to(ct))
        return w.to(dtype)

    def merged_stack(self, name: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """merged_expert for every expert, stacked [E, out, in] (one expert merged at a time)."""
        return torch.stack([self.merged_expert(name, e, dtype) for e in range(self.num_experts)])

    def extra_repr(self) -> str:
        kind = "nf4" if self.nf4 else str(self._meta["gate_up"][3]).replace("torch.", "")
        ad = f", adapter=lora(r={self.r}, alpha={self.alpha:g})" if self.adapter else ""
        return f"experts={self.num_experts}, hidden={self.hidden}, intermediate={self.intermediate}, {kind}{ad}"


class MoEBlock(nn.Module):
    """Router + routed experts (+ the gated shared expert of Qwen3.5-MoE); see the module header."""

    def __init__(self, gate_weight: torch.Tensor, experts: MoEExperts, top_k: int, renormalize: bool,
                 shared_expert: nn.Module | None = None, shared_expert_gate: nn.Module | None = None):
        super().__init__()
        E, H = gate_weight.shape
        self.gate = nn.Linear(H, E, bias=False, device="meta")
        self.gate.weight = nn.Parameter(gate_weight.detach(), requires_grad=False)
        self.experts = experts
        self.shared_expert, self.shared_expert_gate = shared_expert, shared_expert_gate
        self.top_k, self.renormalize, self.num_experts = int(top_k), bool(renormalize), E
        self.routing = None          # a fasttrain.nn.moe_routing.RoutingSlot for the next forward, or None

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(experts [N, k] long, weights [N, k] float32, float64 for a float64 model) of tokens h [N, H]:
        forced or top-k."""
        w = self.gate.weight                      # a trained router's fp32 master runs in the model's dtype
        logits = F.linear(h, w if w.dtype == h.dtype else w.to(h.dtype))
        logits = logits if logits.dtype == torch.float64 else logits.float()
        probs = logits.softmax(dim=-1)
        slot = self.routing
        forced = None if slot is None else slot.forced_for(self)
        if forced is None:
            weights, idx = probs.topk(self.top_k, dim=-1)
        else:
            idx = forced.to(device=h.device, dtype=torch.long)
            weights = probs.gather(1, idx)
        if slot is not None:
            slot.seen(self, probs.topk(self.top_k, dim=-1)[1] if forced is not None else idx)
            slot.logits(self, logits)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return idx, weights

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        h = hidden.reshape(-1, shape[-1])
        idx, w = self.route(h)
        y = self.experts(h, idx, w)
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)
        return y.view(shape)


def moe_blocks(model: nn.Module) -> list[tuple[str, MoEBlock]]:
    """(qualified name, block) for every MoEBlock, in layer order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoEBlock)]


def moe_expert_layers(model: nn.Module) -> list[tuple[str, MoEExperts]]:
    """(qualified name, experts) for every MoEExperts, in layer order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoEExperts)]
