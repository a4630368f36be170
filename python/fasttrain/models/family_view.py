"""The family view: what the rollout's decoders and the update's shared-prefix forward both read
off a model of one of fasttrain's families, and the layer pieces both run.

    view = family_view(model)            # LlamaView or HybridView, by the family (VIEWS)

A view holds the model's modules (embedding, layers, final norm, rotary embedding) and its shape
(heads, KV heads, head dim, grouped-query factor, scaling, q/k norms, sliding window; for a Gated
DeltaNet hybrid also the layer kinds and the linear-attention heads), and runs the pieces that do
not depend on how the sequence is cut: the rotary table, the projections (`project`: one GEMM over
the rollout's stacked dense weights when it has them, else the modules as they are), the MLP, the
full-attention inputs of a hybrid and the Gated DeltaNet layer's inputs and output. The rollout's
decoders (fasttrain.rollout) add the cache and the decode steps; the update
(fasttrain.train.prefix_forward) adds the shared prompt. So the two are one implementation of the
model apart from how the sequence is cut.

What it is not: a forward of its own (no cache, no masks), or a loader (models/loading.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fasttrain.nn.dense_linear import fp32_base, linear_bf16_as_fp32
from fasttrain.nn.rollout_weights import rollout_linear

from .families import family_of

__all__ = ["LlamaView", "HybridView", "VIEWS", "family_view", "rotate_half", "rotate_partial", "gemm",
           "plain_fp32", "plain_linear"]


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_partial(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The rotary embedding on the first cos.shape[-1] dims of x (the rest pass through)."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    xr, xp = x[..., :r], x[..., r:]
    return torch.cat([xr * cos + rotate_half(xr) * sin, xp], dim=-1)


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class LlamaView:
    """The view of `model` (a *ForCausalLM of a Llama-family architecture, or a PEFT wrapper of one).
    `weights`: the rollout's dense weights by module (fasttrain.nn.RolloutWeights: merged NF4 +
    adapter copies), or None to run every projection module as it is."""

    def __init__(self, model, weights=None):
        if hasattr(model, "get_base_model"):  # a PEFT wrapper: its adapters live in the modules
            model = model.get_base_model()
        base = getattr(model, "model", None)
        if base is None or not hasattr(base, "layers") or not hasattr(model, "lm_head"):
            raise ValueError(f"sample: model {type(model).__name__} is not a Llama-family causal LM "
                             "(expected .model.layers and .lm_head)")
        cfg = model.config
        self.model = model
        self.embed, self.layers, self.norm = base.embed_tokens, base.layers, base.norm
        self.rotary = base.rotary_emb
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.group = self.n_heads // self.n_kv
        attn0 = self.layers[0].self_attn
        self.scaling = getattr(attn0, "scaling", self.head_dim ** -0.5)
        self.qk_norm = hasattr(attn0, "q_norm")
        self.sliding_window = getattr(cfg, "sliding_window", None) if getattr(
            cfg, "use_sliding_window", True) else None
        self.dtype = self.embed.weight.dtype
        self.device = self.embed.weight.device
        self.weights = weights

    def rotary_table(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [B, S, rotary dims] for integer `positions` [B, S]."""
        probe = torch.empty(0, dtype=self.dtype, device=self.device)
        return self.rotary(probe, positions)

    def project(self, h: Tensor, mods: tuple) -> tuple[Tensor, ...]:
        """Each module of `mods` applied to h: one GEMM over their stacked dense weights when the
        rollout weights hold them, else the modules themselves."""
        if self.weights is None:
            return tuple(plain_linear(m, h) for m in mods)
        w = self.weights.fused(mods) if len(mods) > 1 else self.weights.linear(mods[0])
        if w is None:
            return tuple(plain_linear(m, h) if len(mods) == 1 else self.project(h, (m,))[0] for m in mods)
        y = gemm(h, w)
        outs = y.split([m.out_features for m in mods], dim=-1) if len(mods) > 1 else (y,)
        return tuple(o if m.bias is None else o + m.bias for o, m in zip(outs, mods))

    def mlp(self, mlp, h: Tensor) -> Tensor:
        """A layer's MLP module on h (gate, up and down through `project` where they are plain
        projections the rollout weights or the fp32-sum path take)."""
        act = getattr(mlp, "act_fn", None)
        if act is None or not hasattr(mlp, "gate_proj") or (self.weights is None and not plain_fp32(mlp.gate_proj, h)):
            return mlp(h)
        gate, up = self.project(h, (mlp.gate_proj, mlp.up_proj))
        return self.project(act(gate) * up, (mlp.down_proj,))[0]


class HybridView(LlamaView):
    """The view of a Qwen3_5ForCausalLM (or a PEFT wrapper of one): Gated DeltaNet layers
    (linear_attn) and gated full-attention layers (self_attn), fasttrain.rollout.hybrid_decoder
    says what each computes."""

    def __init__(self, model, weights=None):
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        base = getattr(model, "model", None)
        cfg = model.config
        if base is None or not hasattr(cfg, "layer_types") or not hasattr(model, "lm_head"):
            raise ValueError(f"sample: model {type(model).__name__} is not a Qwen3.5 hybrid causal LM")
        self.model = model
        self.embed, self.layers, self.norm = base.embed_tokens, base.layers, base.norm
        self.rotary = base.rotary_emb
        self.kinds = list(cfg.layer_types)
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.group = self.n_heads // self.n_kv
        self.scaling = self.head_dim ** -0.5
        self.sliding_window = None
        self.qk_norm = True
        self.Hk, self.Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.Dk, self.Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.conv_k = cfg.linear_conv_kernel_dim
        self.conv_dim = 2 * self.Hk * self.Dk + self.Hv * self.Dv
        self.dtype = self.embed.weight.dtype
        self.device = self.embed.weight.device
        self.state_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        self.weights = weights

    def attention_inputs(self, attn, h: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """h [B, S, H] -> q [B, nh, S, D], k, v [B, kv, S, D] (normed, rotated) and the output gate
        [B, S, nh·D] (q_proj's output holds query and gate interleaved per head)."""
        qg, k, v = self.project(h, (attn.q_proj, attn.k_proj, attn.v_proj))
        return self.heads(attn, qg, k, v, cos, sin)

    def heads(self, attn, qg: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor):
        """A full-attention layer's projections [n, s, ·] -> q [n, nh, s, D], k, v [n, kv, s, D]
        normed and rotated, the output gate [n, s, nh·D]."""
        n, s_ = qg.shape[:2]
        D = self.head_dim
        q, gate = qg.view(n, s_, self.n_heads, 2 * D).chunk(2, dim=-1)
        q = attn.q_norm(q).transpose(1, 2)
        k = attn.k_norm(k.view(n, s_, self.n_kv, D)).transpose(1, 2)
        v = v.view(n, s_, self.n_kv, D).transpose(1, 2)
        return rotate_partial(q, cos, sin), rotate_partial(k, cos, sin), v, gate.reshape(n, s_, self.n_heads * D)

    def delta_inputs(self, la, h: Tensor, valid: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """h [B, S, H] (valid bool [B, S] zeroes padded positions first, as transformers does) ->
        qkv [B, S, C] before the conv, z [B, S, Hv·Dv], beta and g [B, S, Hv] (g float32)."""
        if valid is not None:
            h = h * valid[..., None].to(h.dtype)
        qkv, z, b, a = self.project(h, (la.in_proj_qkv, la.in_proj_z, la.in_proj_b, la.in_proj_a))
        g = -la.A_log.float().exp() * F.softplus(a.float() + la.dt_bias)
        return qkv, z, b.sigmoid(), g

    def delta_output(self, la, o: Tensor, z: Tensor) -> Tensor:
        """The gated RMSNorm of the delta rule's output o [B, S, Hv, Dv] with silu(z), then out_proj."""
        B, S = o.shape[:2]
        o = la.norm(o.reshape(-1, self.Dv), z.reshape(-1, self.Dv)).reshape(B, S, -1)
        return self.project(o, (la.out_proj,))[0]

    def split_qkv(self, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Conv output [B, S, C] -> q, k [B, S, Hk, Dk] L2-normalised in float32 (float64 for a
        float64 model), v [B, S, Hv, Dv] in the model's dtype."""
        B, S, _ = y.shape
        kd = self.Hk * self.Dk
        q, k, v = y.split([kd, kd, self.Hv * self.Dv], dim=-1)
        q = _l2norm(q.to(self.state_dtype).view(B, S, self.Hk, self.Dk))
        k = _l2norm(k.to(self.state_dtype).view(B, S, self.Hk, self.Dk))
        return q, k, v.reshape(B, S, self.Hv, self.Dv)


# The family's view, by family name; a mixture of experts is its base family's view (its MoE
# layers' MLP is a module, fasttrain.nn.MoEBlock, called as the dense MLP is).
VIEWS = {"llama": LlamaView, "qwen3_5": HybridView, "qwen3_moe": LlamaView, "qwen3_5_moe": HybridView}


def family_view(model, weights=None) -> LlamaView:
    """The view of `model`'s family; a model outside the families (a user factory's Llama-like
    model) gets the Llama view, which checks its shape (a ValueError otherwise)."""
    try:
        name = family_of(model).name
    except ValueError:
        name = "llama"
    return VIEWS[name](model, weights)


def gemm(h: Tensor, w: Tensor) -> Tensor:
    """h·wᵀ for a rollout weight, in fp32 sums where the host lacks fast bf16 GEMMs."""
    return linear_bf16_as_fp32(h, w) if fp32_base(h, w) else rollout_linear(h, w)


def plain_fp32(m, h: Tensor) -> bool:
    """Whether `m` is a plain nn.Linear whose bf16 product on this CPU is taken with fp32 sums
    (fasttrain.nn.dense_linear.fp32_base: ATen's bf16 GEMM is many times slower than fp32 on a CPU
    without native bf16 GEMMs). fasttrain's own layers make that choice themselves."""
    return type(m) is torch.nn.Linear and fp32_base(h, m.weight)


def plain_linear(m, h: Tensor) -> Tensor:
    """m(h), in fp32 sums from the bf16 values (rounded once to bf16) where `plain_fp32` says so."""
    if not plain_fp32(m, h):
        return m(h)
    y = linear_bf16_as_fp32(h, m.weight)
    return y if m.bias is None else y + m.bias
