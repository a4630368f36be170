"""The largest answer (max_new_tokens) that fits each bundled model on one GPU, on paper.

For every bundled config (python/fasttrain/models/configs), NF4 and 16-bit bases, the study's
recipe (cispo_repo_r: 4 prompts x 12 answers, two passes, the KL term, 360-token prompts, a probe
of 50 prompts at the same answer length) and a single group (1 prompt x 8 answers), it asks
fasttrain.plan.limits for the largest max_new_tokens with the plan's waves, prefill chunks and
micro-batch allowed (fasttrain.plan.picks), every answer at full length (the worst case). Where the
model's context stops the search first, the memory's own limit is printed beside it. Prints the
markdown table of docs/planning.md.

  PYTHONPATH=python python tools/long_answer_table.py [--gpu h100-sxm-80gb] [--models a,b]
"""
from __future__ import annotations

import argparse

from fasttrain.plan import bundled_configs, gpu_spec, meta_policy, model_config, run_shape
from fasttrain.plan.limits import largest_settings
from fasttrain.plan.report import device_for
from fasttrain.train import load_config


def _cell(lim: dict) -> str:
    v = lim["max_new_tokens"]
    if v is None:
        return "does not fit"
    mem = lim.get("max_new_tokens_memory")
    return f"{v:,}" + (f" (context; memory {mem:,})" if mem else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", default="h100-sxm-80gb")
    ap.add_argument("--models", default="", help="comma-separated bundled names (default: all)")
    args = ap.parse_args()
    gpu = gpu_spec(args.gpu)
    dev = device_for(gpu)
    names = args.models.split(",") if args.models else bundled_configs()
    print(f"| model | base | 4 prompts x 12 answers | 1 prompt x 8 answers |\n|---|---|---:|---:|")
    for name in names:
        for quantize in ("nf4", "none"):
            cfg = load_config("cispo_repo_r", [f"policy.quantize={quantize}"])
            study = run_shape(cfg, 360)
            m = meta_policy(model_config(name), name=name, dtype=study.dtype, adapter=study.adapter,
                            rank=study.rank, alpha=study.alpha, quantize=quantize)
            cells = [_cell(largest_settings(m, s, gpu, dev)) for s in (study, study.with_(prompts=1, group=8))]
            print(f"| {name} | {'NF4' if quantize == 'nf4' else '16-bit'} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
