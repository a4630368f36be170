"""fused_logprob against the full-logits ways of computing per-token log-probs + entropy.

Compares, side by side in one run (forward + backward to hidden, lm_head frozen, temperature 0.9):
  ours   fasttrain.ops.fused_logprob
  (a)    eager: log_softmax(hidden @ weight.T / T).gather(...) + entropy from the same logits
  (b)    TRL: trl.trainer.utils.selective_log_softmax (row-chunked) + entropy_from_logits
  floor  the two matrix products the op must do: torch.matmul(hidden, weight.T) [N, V] and
         torch.matmul(P [N, V], weight), timed in the same run
Time: median of --repeats, methods interleaved so all see the same load. Peak extra memory: each
method once in a fresh subprocess, peak RSS (VmHWM) minus RSS after the inputs exist (CPU);
torch.cuda.max_memory_allocated minus the inputs (GPU).
Run: PYTHONPATH=python python bench/bench_logprob.py [--repeats 3] [--dtype float32] [--csv out.csv]
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

CPU_SHAPES = [(2048, 576, 49152), (1024, 1024, 151936)]  # SmolLM2-135M; Qwen-size vocabulary
GPU_SHAPES = [(15360, 5120, 151936)]
TEMP = 0.9
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_inputs(N, H, V, dtype, device):
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(N, H, generator=g) * 2).to(device=device, dtype=dtype)
    w = (torch.randn(V, H, generator=g) / H**0.5).to(device=device, dtype=dtype)
    t = torch.randint(0, V, (N,), generator=g).to(device)
    return h, w, t


def run_ours(h, w, t):
    import fasttrain.ops as fo

    hh = h.detach().requires_grad_()
    logp, ent = fo.fused_logprob(hh, w, t, temperature=TEMP)
    logp.sum().backward()
    return logp.detach(), ent, hh.grad


def run_eager(h, w, t):
    hh = h.detach().requires_grad_()
    logits = (hh @ w.T).float() / TEMP
    ls = torch.log_softmax(logits, dim=-1)
    logp = ls.gather(-1, t[:, None]).squeeze(-1)
    with torch.no_grad():
        ent = -(ls.exp() * ls).sum(-1)
    logp.sum().backward()
    return logp.detach(), ent, hh.grad


def run_trl(h, w, t):
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    hh = h.detach().requires_grad_()
    N = hh.shape[0]
    rows = 128 if N % 128 == 0 else 1  # GRPO's logits are [B, T, V]; TRL loops over B
    logits = (hh @ w.T).view(rows, N // rows, -1)
    logp = selective_log_softmax(logits, t.view(rows, -1), temperature=TEMP).view(-1)
    with torch.no_grad():
        ent = entropy_from_logits(logits / TEMP).view(-1)
    logp.sum().backward()
    return logp.detach(), ent, hh.grad


def run_matmuls(h, w, t):
    logits = torch.matmul(h, w.T)
    return torch.matmul(logits, w)


def run_liger(h, w, t):  # GPU only, when installed: fused linear cross entropy (loss only, no entropy)
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    hh = h.detach().requires_grad_()
    loss = LigerFusedLinearCrossEntropyLoss(reduction="sum")(w, hh / TEMP, t)
    loss.backward()
    return loss.detach(), None, hh.grad


METHODS = {"ours": run_ours, "eager": run_eager, "trl": run_trl, "matmuls": run_matmuls, "liger": run_liger}


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def proc_status_bytes(key: str) -> int:
    """VmRSS / VmHWM of this process. (ru_maxrss is not used: Linux carries it over fork+exec from
    the parent, so a child would report the parent's peak.)"""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def peak_child(method, N, H, V, dtype, device):
    """Run one method once in this (fresh) process and print its peak extra memory in bytes."""
    h, w, t = make_inputs(N, H, V, DTYPES[dtype], device)
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        METHODS[method](h, w, t)
        torch.cuda.synchronize()
        print(json.dumps({"peak": torch.cuda.max_memory_allocated() - base}))
    else:
        # temporaries of make_inputs already raised the high-water mark: reset it (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = proc_status_bytes("VmRSS")
        METHODS[method](h, w, t)
        print(json.dumps({"peak": proc_status_bytes("VmHWM") - base}))


def peak_extra(method, N, H, V, dtype, device):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "python"),
                                                        os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, __file__, "--peak-child", method, str(N), str(H), str(V), dtype, device],
                         capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return float("nan")
    return json.loads(out.stdout.strip().splitlines()[-1])["peak"]


def bench_shape(N, H, V, dtype, device, repeats, methods):
    h, w, t = make_inputs(N, H, V, DTYPES[dtype], device)
    # agreement first: ours vs eager on the same inputs
    lo, eo, go = run_ours(h, w, t)
    le, ee, ge = run_eager(h, w, t)
    agree = {"logp_maxdiff": (lo - le).abs().max().item(), "ent_maxdiff": (eo - ee).abs().max().item(),
             "grad_rel": ((go.float() - ge.float()).norm() / ge.float().norm()).item()}
    del lo, eo, go, le, ee, ge
    times = {m: [] for m in methods}
    for _ in range(repeats):
        for m in methods:
            sync(device)
            t0 = time.perf_counter()
            METHODS[m](h, w, t)
            sync(device)
            times[m].append(time.perf_counter() - t0)
    med = {m: statistics.median(v) for m, v in times.items()}
    del h, w, t
    peaks = {m: peak_extra(m, N, H, V, dtype, device) for m in methods if m != "matmuls"}
    return med, peaks, agree


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default="", help="N,H,V;N,H,V (default: the issue's shapes)")
    ap.add_argument("--csv", default="")
    ap.add_argument("--peak-child", nargs=6, metavar=("METHOD", "N", "H", "V", "DTYPE", "DEVICE"))
    args = ap.parse_args()
    if args.peak_child:
        m, N, H, V, dt, dev = args.peak_child
        return peak_child(m, int(N), int(H), int(V), dt, dev)

    device = args.device
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]
    else:
        shapes = GPU_SHAPES if device == "cuda" else CPU_SHAPES
    dtype = "bfloat16" if device == "cuda" and args.dtype == "float32" and not args.shapes else args.dtype
    methods = ["ours", "eager", "trl", "matmuls"]
    if device == "cuda":
        try:
            import liger_kernel  # noqa: F401

            methods.append("liger")
        except ImportError:
            print("liger-kernel not installed: skipping that comparison")
    machine = (torch.cuda.get_device_name() if device == "cuda"
               else f"{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads")
    print(f"fused_logprob benchmark on {machine}, torch {torch.__version__}, {dtype}, T={TEMP}, "
          f"forward+backward to hidden (frozen lm_head); median of {args.repeats}; machine may be shared")
    rows = []
    for (N, H, V) in shapes:
        med, peaks, agree = bench_shape(N, H, V, dtype, device, args.repeats, methods)
        r = dict(device=device, machine=machine, dtype=dtype, N=N, H=H, V=V,
                 **{f"t_{m}_s": med[m] for m in methods}, **{f"peak_{m}_MB": peaks[m] / 2**20 for m in peaks},
                 ours_over_matmuls=med["ours"] / med["matmuls"], ours_over_eager=med["ours"] / med["eager"],
                 ours_over_trl=med["ours"] / med["trl"], mem_ours_over_eager=peaks["ours"] / peaks["eager"], **agree)
        rows.append(r)
        print(f"\nN={N} H={H} V={V}:")
        for m in methods:
            pk = f"{peaks[m] / 2**20:9.1f} MB" if m in peaks else "        -   "
            print(f"  {m:8s} {med[m]*1e3:9.1f} ms   peak extra {pk}")
        print(f"  time: ours / two matmuls = {r['ours_over_matmuls']:.2f} (target <= 1.2), ours / eager = "
              f"{r['ours_over_eager']:.2f} (target <= 0.9), ours / TRL = {r['ours_over_trl']:.2f} (target < 1)")
        print(f"  memory: ours / eager peak extra = {r['mem_ours_over_eager']:.3f} (target <= 0.1)")
        print(f"  agreement with eager: logp {agree['logp_maxdiff']:.2e}, entropy {agree['ent_maxdiff']:.2e}, "
              f"grad rel {agree['grad_rel']:.2e}")
        if device == "cuda" and (N, H, V) == GPU_SHAPES[0]:
            print("  H100 floor (docs/design.md): 24 ms forward, 72 ms forward+backward")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]))
            wr.writeheader()
            wr.writerows(rows)


if __name__ == "__main__":
    main()
