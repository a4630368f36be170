"""NF4 quantize / dequantize throughput: fasttrain vs bitsandbytes on the same weight.

Reports GB/s of weight traffic (read 2-4 B/elem + write 0.5 B/elem for quantize; the reverse for
dequantize) and the ratio bitsandbytes time / fasttrain time (> 1 means fasttrain is faster).
Floor on an H100 (3.35 TB/s): dequantising a 4096x4096 bf16 weight moves 42 MB -> ~13 us.
"""
from __future__ import annotations

import argparse
import sys

import torch

from harness import machine_name, row, time_it, write_csv

import fasttrain.ops as ops


def run(device: str, shapes, dtypes, reps: int) -> list[dict]:
    import bitsandbytes.functional as bnb_f

    rows = []
    for shape in shapes:
        for dtype in dtypes:
            w = (torch.randn(shape, device=device) * 0.02).to(dtype)
            n = w.numel()
            case = f"{shape[0]}x{shape[1]} {str(dtype).replace('torch.', '')}"
            q_bytes = n * w.element_size() + n // 2 + 4 * n // 64
            t_ours = time_it(lambda: ops.nf4_quantize(w), reps=reps, device=device)
            t_bnb = time_it(lambda: bnb_f.quantize_4bit(w, blocksize=64, quant_type="nf4"), reps=reps, device=device)
            packed, st = ops.nf4_quantize(w)
            bp, bst = bnb_f.quantize_4bit(w, blocksize=64, quant_type="nf4")
            d_ours = time_it(lambda: ops.nf4_dequantize(packed, st), reps=reps, device=device)
            d_bnb = time_it(lambda: bnb_f.dequantize_4bit(bp, bst, quant_type="nf4"), reps=reps, device=device)
            for op, to, tb in (("quantize", t_ours, t_bnb), ("dequantize", d_ours, d_bnb)):
                rows += [
                    row("nf4", f"{op} {case}", "fasttrain", "time", to * 1e3, "ms"),
                    row("nf4", f"{op} {case}", "bitsandbytes", "time", tb * 1e3, "ms"),
                    row("nf4", f"{op} {case}", "fasttrain", "bandwidth", q_bytes / to / 1e9, "GB/s"),
                    row("nf4", f"{op} {case}", "ratio", "peer_time/ours", tb / to, "x"),
                ]
                print(f"{op:10s} {case:22s} fasttrain {to*1e3:8.3f} ms  bitsandbytes {tb*1e3:8.3f} ms  "
                      f"-> {tb/to:5.2f}x  ({q_bytes/to/1e9:6.1f} GB/s)")
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--csv", default=None, help="append rows to this CSV")
    a = ap.parse_args(argv)
    shapes = [(4096, 1024), (4096, 4096)] if a.device == "cpu" else [(4096, 4096), (5120, 27648)]
    print(f"bench_nf4 on {machine_name()} ({a.device}); ratio = bitsandbytes time / fasttrain time")
    rows = run(a.device, shapes, [torch.float32, torch.bfloat16], a.reps)
    if a.csv:
        write_csv(rows, __import__("pathlib").Path(a.csv))


if __name__ == "__main__":
    sys.exit(main())
