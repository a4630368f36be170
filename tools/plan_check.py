"""The plan against a real step's peak allocated bytes on the device at hand (used by gpu_check.sh).

Builds a model of a bundled architecture (python/fasttrain/models/configs) with random weights, so
nothing is downloaded, runs two training steps of the real Trainer (the tiny letters environment
with prompts padded to --prompt-tokens, answers to max_new_tokens), and records per phase of
step 2: on CUDA, torch.cuda.max_memory_allocated between the phase's start and end (peak stats
reset at each start); on the CPU, the profiler's allocator events (tests/support/measured_step.py).
Writes plan_check.json and prints planned / measured per phase.

  PYTHONPATH=python python tools/plan_check.py --model smollm2-135m --device cuda --out DIR
  (--layers N keeps the first N layers of the same widths, for long answers on a CPU: the plan is
  built from the same config, so it is told the same shape)
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]          # the tests' support package: the tiny and padded worlds

ARGS: dict = {}


def _byte_tokenizer():
    from support.tiny_world import ByteTokenizer

    class Wide(ByteTokenizer):
        """Bytes in, any id of the model's vocabulary out (id - 3 mod 256): random weights sample
        the whole vocabulary."""
        def decode(self, ids, skip_special_tokens: bool = True) -> str:
            ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
            return bytes((i - 3) % 256 for i in ids if i >= 3).decode("utf-8", errors="replace")

    return Wide()


def policy(dtype: str = "bfloat16"):
    """(model, tokenizer): random weights of ARGS["model"]'s architecture over a byte tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from fasttrain.plan import model_config

    data = model_config(ARGS["model"])
    data.pop("torch_dtype", None)
    if ARGS.get("layers"):                    # fewer layers of the same widths (the plan reads this config)
        data["num_hidden_layers"] = ARGS["layers"]
        if "layer_types" in data:
            data["layer_types"] = data["layer_types"][:ARGS["layers"]]
    # room for the prompt and the answers (SmolLM2's published context is 2,048 positions)
    data["max_position_embeddings"] = max(data.get("max_position_embeddings", 0), ARGS.get("context", 0))
    cfg = AutoConfig.for_model(data.pop("model_type"), **data)
    cfg.eos_token_id = cfg.bos_token_id = 2
    cfg.pad_token_id = 0
    torch.manual_seed(0)
    with torch.device(ARGS["device"]):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    return model, _byte_tokenizer()


class _Patch:
    def __init__(self):
        self.undo = []

    def setattr(self, obj, name, value):
        self.undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def close(self):
        for obj, name, value in reversed(self.undo):
            setattr(obj, name, value)


def _measure_cuda(trainer) -> dict:
    import fasttrain.train.answers as answers
    import fasttrain.train.trainer as tr
    from support.measured_step import PHASES

    patch = _Patch()
    patch.setattr(answers, "eos_ids", lambda model, tok: [])
    peaks: dict = {}
    step = [0]

    def wrap(name, fn):
        def inner(*a, **k):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            out = fn(*a, **k)
            torch.cuda.synchronize()
            if step[0] == 2:
                peaks[name] = torch.cuda.max_memory_allocated()
            return out
        return inner

    for phase, attr in PHASES.items():
        patch.setattr(tr, attr, wrap(phase, getattr(tr, attr)))
    trainer._setup()
    free0, total = torch.cuda.mem_get_info()
    try:
        for s in (1, 2):
            step[0] = s
            trainer._train_step(s)
    finally:
        patch.close()
    from fasttrain.train.answers import prompt_token_ids
    ids = prompt_token_ids(trainer.tokenizer, trainer.env, trainer._prompts_for_step(2), "")
    peaks["prompt_tokens"] = max(len(i) for i in ids)
    peaks["driver_used_minus_allocated"] = (total - free0) - torch.cuda.memory_allocated()
    return peaks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=12)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=0, help="keep the first N layers (0: all)")
    ap.add_argument("--probe-prompts", type=int, default=50)
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    ARGS.update(model=a.model, device=a.device, layers=a.layers, context=a.prompt_tokens + a.new + 64)
    from support import padded_world

    from fasttrain.plan import Device, meta_policy, plan_memory, run_shape
    from fasttrain.train import Trainer, load_config

    pad = max(0, a.prompt_tokens - 140)
    padded_world.PADDING = " x" * (pad // 2)
    with tempfile.TemporaryDirectory() as tmp:
        recipe = {
            "run": {"name": "plan-check", "seed": 7, "steps": 2, "out": tmp, "device": a.device},
            "policy": {"model": "plan_check:policy", "dtype": a.dtype, "rank": 32, "alpha": 64.0},
            "env": {"name": "support.padded_world:make_env"},
            "rollout": {"prompts_per_step": a.prompts, "group_size": a.group, "max_new_tokens": a.new},
            "advantages": {"priorities": {"core": 3.0}, "floor": -1e9},
            "loss": {"kind": "cispo", "repo_r": True, "passes": 2, "token_mask": "all"},
            "optim": {"micro_batch": a.micro_batch},
            "probe": {"prompts": a.probe_prompts},
        }
        sys.modules.setdefault("plan_check", sys.modules[__name__])
        cfg = load_config(recipe)
        t0 = time.perf_counter()
        trainer = Trainer(cfg, progress=False)
        if a.device == "cuda":
            measured = _measure_cuda(trainer)
        else:
            from support.measured_step import measure_steps
            patch = _Patch()
            try:
                measured = measure_steps(trainer, patch)
            finally:
                patch.close()
        seconds = time.perf_counter() - t0
    m = meta_policy(trainer.model.config, dtype=a.dtype, rank=32, alpha=64.0)
    from fasttrain.plan.gpus import gpu_for_device
    from fasttrain.plan.report import device_for
    dev = device_for(gpu_for_device(a.device))      # with the free memory the "auto" rollout weights rule reads
    plan = plan_memory(m, run_shape(cfg, measured["prompt_tokens"]), dev)
    rows = {ph: {"planned": plan.total(ph), "measured": measured[ph]} for ph in ("rollout", "scores", "update")
            if ph in measured and ph in plan.phases}
    out = {"model": a.model, "device": a.device,
           "device_name": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
           "shape": vars(a), "prompt_tokens": measured["prompt_tokens"], "phases": rows, "seconds": seconds,
           "driver_used_minus_allocated": measured.get("driver_used_minus_allocated")}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    tag = f"{a.model}" + (f"-{a.layers}layers-{a.new}new" if a.layers else "")
    (Path(a.out) / f"plan_check_{tag}.json").write_text(json.dumps(out, indent=2))
    print(f"plan vs measured peak allocated, {a.model} {a.dtype} on {out['device_name']} "
          f"({a.prompts}x{a.group} rows, prompt {measured['prompt_tokens']} + {a.new}, micro-batch {a.micro_batch})")
    for ph, r in rows.items():
        print(f"  {ph:8s} planned {r['planned'] / 2**30:8.3f} GiB  measured {r['measured'] / 2**30:8.3f} GiB  "
              f"ratio {r['planned'] / r['measured']:.3f}")
    if out["driver_used_minus_allocated"] is not None:
        print(f"  CUDA context + reserved-but-unallocated after set-up: {out['driver_used_minus_allocated'] / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
