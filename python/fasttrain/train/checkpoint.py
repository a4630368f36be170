"""Training checkpoints: everything needed to continue a run bit for bit.

checkpoints/step_NNNNNN/
    adapter/                 PEFT format (fasttrain.nn.save_adapter): loadable without fasttrain
    trainer_state.safetensors  adapter masters (fp32, by parameter name) + AdamW moments, flattened
    trainer_state.json       step, optimizer step counts and hyper-parameters, thermostat state,
                             RNG states (base64), counters
    manifest.json            size and SHA-256 of every other file, written last
checkpoints/latest.json      points at the newest complete checkpoint (replaced atomically last)

A checkpoint folder is written as step_NNNNNN.tmp and renamed when complete, so a crash leaves
either the old checkpoint or the new one, never half of one. What the rename cannot promise (a
file truncated or edited later, a disk that lost a block) the manifest finds: `--resume` checks
each checkpoint against it, newest first, and continues from the newest whole one, saying which
it passed over and why (`pick_checkpoint`). No pickle anywhere.
"""
from __future__ import annotations

import base64
import errno
import hashlib
import json
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fasttrain.train.run_files import write_json

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "rng_state", "set_rng_state",
           "CheckpointError", "newest_checkpoint_name", "verify_checkpoint", "pick_checkpoint", "write_manifest",
           "model_family", "nonfinite_state"]

MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """No checkpoint of a run can be resumed from, or one could not be written; the message names
    the checkpoint, the file and what is wrong."""


def newest_checkpoint_name(ckpt_root: Path) -> str:
    """The newest complete checkpoint's folder name (for messages)."""
    steps = sorted((p for p in ckpt_root.glob("step_*") if p.is_dir() and _step_of(p) is not None
                    and not p.name.endswith(".tmp")), key=_step_of)
    return steps[-1].name if steps else "none (the run must start again)"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(folder: Path) -> None:
    """manifest.json: {"files": {relative path: {"size", "sha256"}}} of every file under `folder`."""
    files = {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST}
    write_json(folder / MANIFEST, {"files": files})


def verify_checkpoint(ckpt: Path) -> str | None:
    """None when every file of the checkpoint matches its manifest; otherwise what is wrong."""
    try:
        files = json.loads((ckpt / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return "it has no manifest.json"
    except (ValueError, KeyError, TypeError) as e:
        return f"its manifest.json is not readable ({type(e).__name__})"
    for rel, want in files.items():
        p = ckpt / rel
        if not p.is_file():
            return f"{rel} is missing"
        size = p.stat().st_size
        if size != want["size"]:
            return f"{rel} has {size} bytes, the manifest says {want['size']}"
        if _sha256(p) != want["sha256"]:
            return f"{rel} does not match its SHA-256 in the manifest (edited or damaged)"
    for need in ("trainer_state.json", "trainer_state.safetensors"):
        if need not in files:
            return f"the manifest does not list {need}"
    return None


def _step_of(p: Path) -> int | None:
    try:
        return int(p.name.split("_", 1)[1])
    except (IndexError, ValueError):
        return None


def pick_checkpoint(ckpt_root: Path, step: int | None = None) -> tuple[Path | None, list[str]]:
    """(the checkpoint to resume from, a note for each newer one passed over); None when the run
    has no checkpoint at all (it starts again). `step`: that checkpoint and no other. Raises
    CheckpointError naming each checkpoint and its fault when none is whole."""
    found = sorted((p for p in ckpt_root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")
                    and _step_of(p) is not None), key=_step_of, reverse=True)
    if step is not None:
        found = [p for p in found if _step_of(p) == step]
        if not found:
            kept = ", ".join(p.name for p in sorted(ckpt_root.glob("step_*")) if not p.name.endswith(".tmp"))
            raise CheckpointError(f"--from step_{step}: there is no such checkpoint in {ckpt_root} "
                                  f"(kept: {kept or 'none'})")
    notes = []
    for p in found:
        if not (p / MANIFEST).exists() and (p / "trainer_state.json").exists():
            notes.append(f"checkpoint {p.name} has no manifest (an older fasttrain wrote it): not verified")
            return p, notes
        why = verify_checkpoint(p)
        if why is None:
            return p, notes
        notes.append(f"checkpoint {p.name} is damaged: {why}")
    if not found:                  # stopped before its first checkpoint: nothing to resume from
        return None, [f"no checkpoint under {ckpt_root} (the run stopped before its first one): starting "
                      "the run again from step 0 in the same folder"]
    raise CheckpointError("no checkpoint can be resumed from: " + "; ".join(notes)
                          + ". Start the run again (or restore the checkpoints folder from a copy)")


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
    """Write checkpoint `step` (the module docstring's layout). A write that fails (a full or
    read-only disk, no permission) removes the half-written folder, leaves the previous
    checkpoints as they were and raises CheckpointError naming the file and the error."""
    try:
        return _save_checkpoint(ckpt_root, step, model, params, optimizer, state, base_model, keep, keep_steps)
    except OSError as e:
        shutil.rmtree(ckpt_root / f"step_{step:06d}.tmp", ignore_errors=True)
        where = e.filename or ckpt_root
        raise CheckpointError(f"could not write the checkpoint of step {step}: {where}: {e.strerror or e} "
                              f"(errno {errno.errorcode.get(e.errno, e.errno)}). The previous checkpoint, "
                              f"{newest_checkpoint_name(ckpt_root)}, is intact, and metrics.jsonl and "
                              f"samples.jsonl hold every step so far. Free space or fix the folder's "
                              f"permissions, then resume: `fasttrain run --resume {ckpt_root.parent}`") from None


def _save_checkpoint(ckpt_root: Path, step: int, model: torch.nn.Module, params: dict[str, torch.nn.Parameter],
                     optimizer: torch.optim.Optimizer, state: dict[str, Any], base_model: str,
                     keep: int, keep_steps: set[int] | None) -> Path:
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
    write_manifest(tmp)
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


def model_family(model) -> dict[str, str]:
    """The policy's model family and model_type, kept in checkpoints so a resume on another
    family's model is refused by name (its adapters would not fit)."""
    from fasttrain.models.families import family_of
    model_type = str(getattr(getattr(model, "config", None), "model_type", "unknown"))
    try:
        return {"family": family_of(model).name, "model_type": model_type}
    except ValueError:
        return {"family": model_type, "model_type": model_type}


def nonfinite_state(params: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> str | None:
    """The first adapter tensor or optimizer moment that holds a NaN or an infinity, or None."""
    for n, p in params.items():
        if not bool(torch.isfinite(p).all()):
            return f"adapter {n}"
        for k, v in optimizer.state.get(p, {}).items():
            if torch.is_tensor(v) and v.is_floating_point() and not bool(torch.isfinite(v).all()):
                return f"AdamW {k} of {n}"
    return None


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
