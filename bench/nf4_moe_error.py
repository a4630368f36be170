"""Which parts of a mixture-of-experts layer can take NF4: the logit error of each choice against the
16-bit model, for both MoE families, on random Gaussian weights (NF4's best case) and heavy-tailed
Student-t weights (df = 3, scaled to the same std: closer to trained layers, whose outliers set each
64-block's absmax).

    PYTHONPATH=python python bench/nf4_moe_error.py [--out bench/results/nf4_moe_error.md]

The 16-bit model: every weight rounded to bf16, computed in float64 (fasttrain's MoEBlock in place of
transformers' sparse blocks, routing in float64; the Qwen3.5-MoE delta rule by the float64 oracle),
so the numbers are the quantisation's alone. Each choice rounds the named parts to NF4 (blocksize 64,
each expert on its own, decoded exactly) and runs the same tokens. Reported: the share of the MoE
layers' weights the choice puts in NF4, the mean and max |Δ logit|, the mean KL(16-bit ‖ NF4) per
token, and the share of (token, MoE layer) pairs whose top-k expert set changes. The attention and
dense projections stay 16-bit here (their NF4 error is measured in bench/nf4_hybrid_error.py).
"""
from __future__ import annotations

import argparse
import math
import sys
from contextlib import ExitStack
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
# the float64 oracle is a measuring instrument, not product code: it lives with the tests' helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support.hf_oracle import hf_float64_oracle  # noqa: E402
from fasttrain.models.moe import moe_surgery  # noqa: E402
from fasttrain.models.moe_tiny import tiny_qwen3_5_moe, tiny_qwen3_moe  # noqa: E402
from fasttrain.nn.moe_experts import RoutingSlot, moe_blocks, routing_slot  # noqa: E402
from fasttrain.ops import nf4_dequantize, nf4_quantize  # noqa: E402

PARTS = ("experts", "router", "shared_expert_gate")
CHOICES = {
    "experts NF4; router, shared-expert gate 16-bit": ("experts",),
    "experts + router NF4": ("experts", "router"),
    "experts + shared-expert gate NF4": ("experts", "shared_expert_gate"),
    "router only NF4": ("router",),
    "shared-expert gate only NF4": ("shared_expert_gate",),
}


def build(family: str, weights: str, seed: int):
    kw = dict(vocab_size=2048, hidden=256, layers=4, experts=16, top_k=4, moe_intermediate=128, seed=seed)
    m = (tiny_qwen3_moe(mlp_only_layers=(), **kw) if family == "qwen3_moe" else
         tiny_qwen3_5_moe(interval=2, heads=4, kv_heads=2, head_dim=64, linear_k_heads=2, value_heads_per_key=2,
                          linear_head_dim=64, shared_intermediate=256, **kw))
    g = torch.Generator().manual_seed(seed + 7)
    std = 0.02
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() < 2 or "embed" in name or "lm_head" in name:
                continue
            if weights == "student-t":
                p.copy_(torch.distributions.StudentT(3.0).sample(p.shape) / math.sqrt(3.0) * std)
            else:
                p.normal_(0.0, std, generator=g)
    m = m.to(torch.bfloat16).double().eval()
    return moe_surgery(m, nf4=False)


def _nf4(w: torch.Tensor) -> torch.Tensor:
    """w rounded to NF4 (each leading slice on its own for a 3-D stack), back in float64."""
    if w.dim() == 3:
        return torch.stack([_nf4(x) for x in w])
    packed, state = nf4_quantize(w.float().contiguous())
    return nf4_dequantize(packed, state, torch.float32).double()


def quantized(model, parts: tuple[str, ...]):
    import copy
    q = copy.deepcopy(model)
    n = tot = 0
    with torch.no_grad():
        for _, b in moe_blocks(q):
            ex = b.experts
            sizes = {"experts": ex.gate_up_weight.numel() + ex.down_weight.numel(), "router": b.gate.weight.numel(),
                     "shared_expert_gate": b.shared_expert_gate.weight.numel() if b.shared_expert_gate else 0}
            tot += sum(sizes.values())
            for p in parts:
                n += sizes[p]
                if p == "experts":
                    ex.gate_up_weight.copy_(_nf4(ex.gate_up_weight))
                    ex.down_weight.copy_(_nf4(ex.down_weight))
                elif p == "router":
                    b.gate.weight.copy_(_nf4(b.gate.weight))
                elif b.shared_expert_gate is not None:
                    b.shared_expert_gate.weight.copy_(_nf4(b.shared_expert_gate.weight))
    return q, n / tot


def run(model, ids):
    blocks = [b for _, b in moe_blocks(model)]
    slot = RoutingSlot()
    with ExitStack() as st, torch.no_grad():
        if model.config.model_type.startswith("qwen3_5"):
            st.enter_context(hf_float64_oracle("qwen3_5_moe"))
        st.enter_context(routing_slot(blocks, slot))
        z = model(ids).logits
    return z, [slot.chosen[b] for b in blocks]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rows", type=int, default=4)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    lines = ["| family | weights | choice | MoE-layer weights in NF4 | mean abs dlogit | max abs dlogit | "
             "mean KL (nats) | top-k sets changed |", "|---|---|---|---|---|---|---|---|"]
    for family in ("qwen3_moe", "qwen3_5_moe"):
        for weights in ("gaussian", "student-t"):
            model = build(family, weights, seed=0)
            ids = torch.randint(3, 2048, (a.rows, a.tokens), generator=torch.Generator().manual_seed(1))
            ref, ref_routes = run(model, ids)
            lp_ref = torch.log_softmax(ref, -1)
            for choice, parts in CHOICES.items():
                if "shared_expert_gate" in parts and family == "qwen3_moe":
                    continue
                q, share = quantized(model, parts)
                z, routes = run(q, ids)
                d = (z - ref).abs()
                kl = (lp_ref.exp() * (lp_ref - torch.log_softmax(z, -1))).sum(-1).mean()
                flips = sum(int((x.sort(-1)[0] != y.sort(-1)[0]).any(-1).sum()) for x, y in zip(routes, ref_routes))
                pairs = sum(x.shape[0] for x in routes)
                line = (f"| {family} | {weights} | {choice} | {100 * share:.2f}% | {d.mean():.4f} | {d.max():.4f} | "
                        f"{float(kl):.2e} | {100 * flips / pairs:.1f}% |")
                print(line, flush=True)
                lines.append(line)
    text = ("# NF4 in mixture-of-experts layers: logit error against the 16-bit model\n\n"
            "hidden 256, 4 layers, 16 experts (top-4) of width 128 (Qwen3.5-MoE: 2 Gated DeltaNet + 2 gated "
            f"attention layers, a shared expert of width 256), vocab 2048; {a.rows} x {a.tokens} random tokens; "
            "float64 compute (bench/nf4_moe_error.py).\n\n" + "\n".join(lines) + "\n")
    if a.out:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
