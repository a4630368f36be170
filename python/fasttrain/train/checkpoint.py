"""Training checkpoints: everything needed to continue a run bit for bit.

checkpoints/step_NNNNNN/
    adapter/                 PEFT format (fasttrain.nn.save_adapter): loadable without fasttrain
    trainer_state.safetensors  adapter masters (fp32, by parameter name) + AdamW moments, flattened
    trainer_state.json       step, optimizer step counts and hyper-parameters, thermostat state,
                             RNG states (base64), counters
checkpoints/latest.json      points at the newest complete checkpoint (replaced atomically last)

A checkpoint folder is written as step_NNNNNN.tmp and renamed when complete, so a crash leaves
either the old checkpoint or the new one, never half of one. No pickle anywhere.
"""
from __future__ import annotations

import base64
import json
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fasttrain.train.run_files import write_json

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "rng_state", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    st = {"torch_cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
          "python": json.loads(json.dumps(random.getstate(), default=list))}
    if torch.cuda.is_available():
        st["torch_cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    import numpy as np
    torch.set_rng_state(torch.from_numpy(np.frombuffer(base64.b64decode(st["torch_cpu"]), dtype=np.uint8).copy()))
    v, internal, gauss = st["python"]
    random.setstate((v, tuple(internal), gauss))
    if "torch_cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.from_numpy(np.frombuffer(base64.b64decode(s), dtype=np.uint8).copy())
                                      for s in st["torch_cuda"]])


def save_checkpoint(ckpt_root: Path, step: int, model: torch.nn.Module, params: dict[str, torch.nn.Parameter],
                    optimizer: torch.optim.Optimizer, state: dict[str, Any], base_model: str,
                    keep: int = 2, keep_steps: set[int] | None = None) -> Path:
    from fasttrain.nn import save_adapter

    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f"step_{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_adapter(model, tmp / "adapter", base_model=base_model)
    tensors: dict[str, torch.Tensor] = {}
    index = {id(p): n for n, p in params.items()}
    opt_meta = {"param_groups": [], "step": {}}
    for n, p in params.items():
        tensors[f"param/{n}"] = p.detach().to("cpu").contiguous()
    for group in optimizer.param_groups:
        opt_meta["param_groups"].append({k: v for k, v in group.items() if k != "params"})
        for p in group["params"]:
            s = optimizer.state.get(p, {})
            n = index[id(p)]
            for k, v in s.items():
                if k == "step":
                    opt_meta["step"][n] = float(v)
                else:
                    tensors[f"optim/{k}/{n}"] = v.detach().to("cpu").contiguous()
    save_file(tensors, str(tmp / "trainer_state.safetensors"))
    write_json(tmp / "trainer_state.json", {"step": step, "optimizer": opt_meta, **state})
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    write_json(ckpt_root / "latest.json", {"step": step, "dir": final.name})
    # Prune: keep the newest `keep` plus the probe checkpoints a run may ship.
    keep_steps = keep_steps or set()
    olds = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
    for p in olds[:-keep]:
        if int(p.name.split("_")[1]) not in keep_steps:
            shutil.rmtree(p, ignore_errors=True)
    return final


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    f = ckpt_root / "latest.json"
    if not f.exists():
        return None
    d = ckpt_root / json.loads(f.read_text())["dir"]
    return d if d.exists() else None


def check_family(ckpt: Path, now: dict[str, str], run_dir: Path) -> None:
    """Refuse to resume a checkpoint written for another model family (checkpoints before the
    family was recorded pass)."""
    meta = json.loads((ckpt / "trainer_state.json").read_text())
    then = meta.get("family")
    if then is not None and then != now["family"]:
        from fasttrain.train.config import ConfigError
        raise ConfigError(
            f"--resume {run_dir}: its checkpoint {ckpt.name} holds adapters for a {then!r} model "
            f"(model_type {meta.get('model_type')!r}), but policy.model now loads a {now['family']!r} model "
            f"(model_type {now['model_type']!r}); adapters do not carry across families. Resume with the "
            "run's own policy.model, or start a new run.")


def load_checkpoint(ckpt: Path, params: dict[str, torch.nn.Parameter],
                    optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore adapter masters and AdamW state in place; return the JSON state."""
    meta = json.loads((ckpt / "trainer_state.json").read_text())
    tensors = load_file(str(ckpt / "trainer_state.safetensors"))
    missing = [n for n in params if f"param/{n}" not in tensors]
    if missing:
        raise ValueError(f"checkpoint {ckpt} lacks adapter parameters {missing[:3]}...: "
                         "was it written by a run with another policy.adapter / policy.rank?")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(tensors[f"param/{n}"].to(p.device, p.dtype))
    index = {id(p): n for n, p in params.items()}
    for group, saved in zip(optimizer.param_groups, meta["optimizer"]["param_groups"]):
        group.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
        for p in group["params"]:
            n = index[id(p)]
            if n not in meta["optimizer"]["step"]:
                continue
            st = {"step": torch.tensor(meta["optimizer"]["step"][n], dtype=torch.float32)}
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                t = tensors.get(f"optim/{key}/{n}")
                if t is not None:
                    st[key] = t.to(p.device)
            optimizer.state[p] = st
    return meta
