"""Which projections of a Qwen3.5 hybrid can take NF4: the logit error of each choice against the
16-bit model, on random weights (NF4's best case: Gaussian, as the format assumes) and on
heavy-tailed Student-t weights (df = 3, scaled to the same std: closer to trained layers, whose
outliers set each 64-block's absmax and push the other 63 values towards zero).

    PYTHONPATH=python python bench/nf4_hybrid_error.py [--out bench/results/nf4_hybrid_error.md]

The 16-bit model: every weight rounded to bf16, computed in float64 (transformers' Qwen3_5ForCausalLM
with the float64 oracle's delta rule), so the numbers are the quantisation's alone. Each choice
swaps the named projections for NF4Linear (blocksize 64, the NF4 decoded exactly) and runs the same
tokens. Reported per choice: the bytes it saves (share of all projection weights quantised), the
mean and max |Δ logit|, and the mean KL(16-bit ‖ NF4) per token. What this cannot tell: a real
checkpoint's weight statistics per projection (in_proj_a/b, A_log, dt_bias trained), which decide
the error of the decay path; run it on the checkpoint (--model DIR) when one is at hand.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
# the float64 oracle is a measuring instrument, not product code: it lives with the tests' helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support.hf_oracle import hf_float64_oracle  # noqa: E402
from fasttrain.models.tiny import tiny_qwen3_5  # noqa: E402
from fasttrain.nn.nf4_linear import NF4Linear  # noqa: E402
from fasttrain.nn.surgery import set_module  # noqa: E402

LINEAR_ATTN = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
CHOICES = {
    "all projections NF4": ATTN + MLP + LINEAR_ATTN,
    "all but in_proj_a/b (kept 16-bit)": ATTN + MLP + ("in_proj_qkv", "in_proj_z", "out_proj"),
    "attention + MLP only (linear_attn 16-bit)": ATTN + MLP,
    "MLP only": MLP,
    "in_proj_a/b only": ("in_proj_b", "in_proj_a"),
    "in_proj_qkv/z + out_proj only": ("in_proj_qkv", "in_proj_z", "out_proj"),
}


def build(weights: str, seed: int):
    m = tiny_qwen3_5(vocab_size=2048, hidden=512, layers=8, interval=4, heads=8, kv_heads=2, head_dim=64,
                     linear_k_heads=4, value_heads_per_key=3, linear_head_dim=64, intermediate=1536, seed=seed)
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, mod in m.named_modules():
            if isinstance(mod, torch.nn.Linear) and name != "lm_head":
                std = 0.02
                if weights == "student-t":
                    t = torch.distributions.StudentT(3.0).sample(mod.weight.shape)
                    mod.weight.copy_(t / math.sqrt(3.0) * std)
                else:
                    mod.weight.normal_(0.0, std, generator=g)
    return m.to(torch.bfloat16).double().eval()


def quantized(model, targets: tuple[str, ...]):
    import copy
    q = copy.deepcopy(model)
    n = tot = 0
    for name, mod in list(q.named_modules()):
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            tot += mod.weight.numel()
            if name.rpartition(".")[2] in targets:
                set_module(q, name, NF4Linear.from_linear(mod))
                n += mod.weight.numel()
    return q, n / tot


def logits(model, ids):
    with torch.no_grad(), hf_float64_oracle():
        return model(ids).logits


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rows", type=int, default=4)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    lines = ["| weights | choice | projection weights in NF4 | mean abs dlogit | max abs dlogit | mean KL (nats) |",
             "|---|---|---|---|---|---|"]
    for weights in ("gaussian", "student-t"):
        model = build(weights, seed=0)
        ids = torch.randint(3, 2048, (a.rows, a.tokens), generator=torch.Generator().manual_seed(1))
        ref = logits(model, ids)
        lp_ref = torch.log_softmax(ref, -1)
        for choice, targets in CHOICES.items():
            q, share = quantized(model, targets)
            z = logits(q, ids)
            d = (z - ref).abs()
            kl = (lp_ref.exp() * (lp_ref - torch.log_softmax(z, -1))).sum(-1).mean()
            line = (f"| {weights} | {choice} | {100 * share:.1f}% | {d.mean():.4f} | {d.max():.4f} | "
                    f"{float(kl):.2e} |")
            print(line, flush=True)
            lines.append(line)
    text = ("# NF4 on a Qwen3.5-shaped hybrid: logit error against the 16-bit model\n\n"
            "hidden 512, 8 layers (6 Gated DeltaNet, 2 gated attention), 4 q/k heads x 3 value heads of 64, "
            f"vocab 2048; {a.rows} x {a.tokens} random tokens; float64 compute (bench/nf4_hybrid_error.py).\n\n"
            + "\n".join(lines) + "\n")
    if a.out:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
