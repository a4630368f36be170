"""`fasttrain export RUN --to DIR`: a run's shipped checkpoint in the forms serving stacks load.

  peft    shipped/adapter as the run wrote it: PEFT's LoRA/DoRA files (adapter_config.json +
          adapter_model.safetensors, fp32 as trained), named after the text model fasttrain trained.
  merged  a 16-bit model folder transformers' from_pretrained (and vLLM) loads with no adapter: the
          base as the run held it (decoded from NF4 where it was NF4, the 16-bit weights otherwise;
          a block-FP8 checkpoint's decode either way) with the adapter folded into each projection,
          W + s·B·A for LoRA and m/‖W + s·B·A‖ ⊙ (W + s·B·A) for DoRA (fasttrain.nn's
          merged_weight, in fp32, rounded once to 16 bits), under the module names of the released
          checkpoint: a vision-language checkpoint's text tower under its ForConditionalGeneration
          names, its vision tower (and MTP head) copied from the checkpoint, so the folder is the
          released model with the trained text tower. config.json is the checkpoint's, its dtype the
          export's, its quantization_config gone; tokenizer and processor files are copied. The
          routed experts of a mixture of experts are W_e + s·B_e·A_e per expert (NF4 experts decoded),
          in the export dtype, per expert or as fused stacks as the source checkpoint stores them.
  vllm    LoRA only: the adapter with the keys vLLM's LoRA loader parses
          (base_model.model.<released module name>.lora_A.weight / .lora_B.weight, no DoRA
          magnitude) and an adapter_config.json its PEFT helper accepts (no DoRA, no
          modules_to_save, no bias). DoRA is refused (vLLM does not serve it: export `merged`), and
          so are projections vLLM's LoRA layers leave unwrapped (below). The routed experts of a
          mixture of experts (LoRA in PEFT's target_parameters format) go in the layout vLLM's MoE
          LoRA loader reads for the model class it will build (fasttrain.nn.moe_export): per expert
          2-D keys for Qwen3-MoE (and a text-only Qwen3.5-MoE), PEFT's fused 3-D file as it is for a
          Qwen3_5MoeForConditionalGeneration checkpoint (the class vLLM marks is_3d_moe_weight).

Streamed: the merged folder is written one projection at a time into safetensors shards of at most
`max_shard_bytes` (the policy, NF4 or 16-bit, plus one shard of merged weights are in memory, never
a second whole model). What this is not: a quantizer for serving (no GPTQ/AWQ/FP8 output) or a
converter for models fasttrain did not train.
"""
from __future__ import annotations

import json
import shutil
import tomllib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from fasttrain.train.config import ConfigError, load_config
from fasttrain.train.run_files import write_json

__all__ = ["export_run", "FORMATS", "FamilyExport", "EXPORTS", "VLLM_UNWRAPPED", "MAX_SHARD_BYTES"]

FORMATS = ("peft", "merged", "vllm")
MAX_SHARD_BYTES = 2 << 30
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
_WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json", "*.bin", "*.pt", "*.pth", "*.gguf", "config.json")


@dataclass(frozen=True)
class FamilyExport:
    """A family's export facts (EXPORTS, by family name). `vllm_unwrapped`: projections vLLM's LoRA
    does not wrap, as read in vLLM's model code (Qwen3.5's in_proj_qkv is a merged column layer of
    three outputs that its packed-modules table does not list: that table holds qkv_proj and
    gate_up_proj only, and vLLM wraps such a layer with no LoRA class, without an error, so the
    adapter's in_proj_qkv would be dropped in serving). `vllm_3d_experts`: the model classes
    (config.architectures) whose experts vLLM's MoE LoRA loader reads 3-D (is_3d_moe_weight = True,
    as read in vLLM's vllm/model_executor/models/qwen3_5.py; fasttrain.nn.moe_export names the
    files and version); the merged model and PEFT's adapter are written alike for every family."""

    vllm_unwrapped: tuple[str, ...] = ()
    vllm_3d_experts: tuple[str, ...] = ()


EXPORTS: dict[str, FamilyExport] = {
    "llama": FamilyExport(),
    "qwen3_5": FamilyExport(vllm_unwrapped=("in_proj_qkv",)),
    "qwen3_moe": FamilyExport(),
    "qwen3_5_moe": FamilyExport(vllm_unwrapped=("in_proj_qkv",),
                                vllm_3d_experts=("Qwen3_5MoeForConditionalGeneration",)),
}
# the projections vLLM leaves unwrapped, by family (the families with some)
VLLM_UNWRAPPED = {name: e.vllm_unwrapped for name, e in EXPORTS.items() if e.vllm_unwrapped}


def export_run(run_dir: str | Path, to: str | Path, fmt: str = "merged", dtype: str | None = None,
               max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write the shipped checkpoint of the run in `run_dir` into the new folder `to` as `fmt`
    (FORMATS); `dtype` ("bfloat16" | "float16") for `merged`, default the run's policy.dtype when it
    is 16-bit, else bfloat16. Returns `to`. FileNotFoundError / ConfigError / ValueError with one
    paragraph for a folder that is not a finished run, a format that cannot hold the adapter, or a
    `to` that is not empty."""
    run_dir, to = Path(run_dir), Path(to)
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: allowed {', '.join(FORMATS)}")
    shipped = run_dir / "shipped" / "adapter"
    if not (run_dir / "config.toml").is_file():
        raise FileNotFoundError(f"{run_dir}: no config.toml there (not a fasttrain run folder)")
    if not (shipped / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{run_dir}: no shipped/adapter (the run has no shipped checkpoint yet: it ships at "
                                "the end of a run with at least one probe)")
    if to.exists() and (not to.is_dir() or any(to.iterdir())):
        raise ValueError(f"--to {to}: exists and is not an empty folder; export writes a new folder")
    cfg = load_config(tomllib.loads((run_dir / "config.toml").read_text()))
    adapter = json.loads((shipped / "adapter_config.json").read_text())
    if fmt == "peft":
        shutil.copytree(shipped, to, dirs_exist_ok=True)
    elif fmt == "vllm":
        _vllm(cfg, shipped, adapter, to)
    else:
        _merged(cfg, shipped, to, _export_dtype(cfg, dtype), max_shard_bytes)
    ship = run_dir / "shipped" / "shipped.json"
    step = json.loads(ship.read_text()).get("step") if ship.is_file() else None
    write_json(to / "fasttrain_export.json", {"run": str(run_dir.resolve()), "step": step, "format": fmt})
    return to


def _export_dtype(cfg, dtype: str | None) -> torch.dtype:
    name = dtype or (cfg.policy.dtype if cfg.policy.dtype in _DTYPES else "bfloat16")
    if name not in _DTYPES:
        raise ValueError(f"--dtype {name!r}: the merged model is 16-bit; allowed {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _source(cfg) -> tuple[Path | None, object | None]:
    """(the checkpoint folder the run's policy.model resolves to, its full config), or (None, None)
    for a `module:factory` model."""
    from transformers import AutoConfig

    from fasttrain.models.loading import resolve_model_path
    from fasttrain.train.policy import is_factory

    if is_factory(cfg.policy.model):
        return None, None
    spec = cfg.policy.model
    path = resolve_model_path(None if spec in ("", "default") else spec)
    return path, AutoConfig.from_pretrained(path, local_files_only=True)


# ---- vLLM ----------------------------------------------------------------------------------------
def _vllm(cfg, shipped: Path, adapter: dict, to: Path) -> None:
    from safetensors.torch import load_file, save_file

    from fasttrain.models.families import family_of_type, released_key

    if adapter.get("use_dora"):
        raise ValueError("--format vllm: the run trained a DoRA adapter, and vLLM's LoRA loader does not serve DoRA "
                         "(it refuses use_dora). Export the merged model instead (`--format merged`: the adapter, "
                         "DoRA's magnitude included, folded into a 16-bit model that vLLM serves as it is).")
    _, full = _source(cfg)
    tensors = load_file(str(shipped / "adapter_model.safetensors"))
    family = EXPORTS[family_of_type(full.model_type).name] if full is not None else FamilyExport()
    if full is not None:
        unwrapped = family.vllm_unwrapped
        hit = sorted({k.split(".lora_")[0].rpartition(".")[2] for k in tensors} & set(unwrapped))
        if hit:
            raise ValueError(f"--format vllm: the adapter trains {', '.join(hit)}, which vLLM's LoRA layers for this "
                             f"model family leave unwrapped (vLLM would serve the model without that part of the "
                             f"adapter, silently). Export the merged model instead (`--format merged`), or train "
                             f"with policy.targets leaving {', '.join(hit)} out.")
    from fasttrain.nn.moe_export import is_expert_lora_key, vllm_expert_lora

    prefix = "base_model.model."
    for k in tensors:
        if not (k.startswith(prefix) and k.endswith((".lora_A.weight", ".lora_B.weight"))):
            raise ValueError(f"{shipped}: adapter tensor {k!r} is not a LoRA A/B weight; vLLM reads only those")
    fused = full is not None and any(a in family.vllm_3d_experts for a in (getattr(full, "architectures", None) or ()))
    dense = {k: v for k, v in tensors.items() if not is_expert_lora_key(k)}
    experts = vllm_expert_lora(tensors, int(adapter["r"]), fused=fused)
    out = {}
    for k, v in {**dense, **experts}.items():
        name = k[len(prefix):]
        out[prefix + (released_key(name, full) if full is not None else name)] = v.contiguous()
    to.mkdir(parents=True, exist_ok=True)
    save_file(out, str(to / "adapter_model.safetensors"), metadata={"format": "pt"})
    modules = {k.split(".lora_")[0].rpartition(".")[2] for k in dense}
    if not fused:
        modules |= {k.split(".lora_")[0].rpartition(".")[2] for k in experts}
    config = {**adapter, "use_dora": False, "modules_to_save": None, "bias": "none",
              "target_modules": sorted(modules)}
    if experts and not fused:
        config.pop("target_parameters", None)          # the experts are per-expert modules now
    (to / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


# ---- merged --------------------------------------------------------------------------------------
class _ShardWriter:
    """Tensors added one at a time, written as safetensors shards of at most `limit` bytes
    (model.safetensors when one is enough, else model-0000k-of-0000n.safetensors + the index)."""

    def __init__(self, folder: Path, limit: int):
        self.folder, self.limit = folder, limit
        self.shards: list[dict[str, torch.Tensor]] = []
        self.pending: dict[str, torch.Tensor] = {}
        self.bytes = self.total = 0
        self.names: list[str] = []
        self.weight_map: dict[str, str] = {}

    def add(self, key: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if self.pending and self.bytes + n > self.limit:
            self._flush()
        self.pending[key] = t.contiguous()
        self.bytes += n
        self.total += n

    def _flush(self) -> None:
        from safetensors.torch import save_file
        name = f"part-{len(self.names):05d}.safetensors"
        save_file(self.pending, str(self.folder / name), metadata={"format": "pt"})
        self.weight_map.update(dict.fromkeys(self.pending, name))
        self.names.append(name)
        self.pending, self.bytes = {}, 0

    def close(self) -> None:
        if self.pending or not self.names:
            self._flush()
        if len(self.names) == 1:
            (self.folder / self.names[0]).rename(self.folder / "model.safetensors")
            return
        final = {n: f"model-{i + 1:05d}-of-{len(self.names):05d}.safetensors" for i, n in enumerate(self.names)}
        for n, f in final.items():
            (self.folder / n).rename(self.folder / f)
        index = {"metadata": {"total_size": self.total}, "weight_map": {k: final[v] for k, v in self.weight_map.items()}}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1, sort_keys=True))


def merged_tensors(model: nn.Module, dtype: torch.dtype, fused_experts: bool = False):
    """(name, tensor) of the merged 16-bit model, in module order, one at a time: each adapted
    layer's merged weight (and bias), each mixture-of-experts layer's merged experts (fused stacks
    or per expert, fasttrain.nn.moe_export), every other parameter and persistent buffer as it is,
    cast to `dtype` when floating; a tensor shared by several modules (tied embeddings) once, under
    its first name."""
    from fasttrain.nn.adapted_linear import AdaptedLinear
    from fasttrain.nn.moe_experts import MoEExperts
    from fasttrain.nn.moe_export import merged_expert_tensors

    seen: set[int] = set()

    def cast(t):
        return t.detach().to("cpu", dtype) if t.is_floating_point() else t.detach().cpu()

    def walk(prefix: str, mod: nn.Module):
        if isinstance(mod, AdaptedLinear):
            yield prefix + "weight", mod.merged_weight(dtype).cpu()
            if mod.bias is not None:
                yield prefix + "bias", cast(mod.bias)
            return
        if isinstance(mod, MoEExperts):
            yield from ((n, t.cpu()) for n, t in merged_expert_tensors(mod, prefix, dtype, fused_experts))
            return
        for n, p in mod._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                yield prefix + n, cast(p)
        for n, b in mod._buffers.items():
            if b is not None and n not in mod._non_persistent_buffers_set:
                yield prefix + n, cast(b)
        for n, child in mod._modules.items():
            if child is not None:
                yield from walk(f"{prefix}{n}.", child)
    yield from walk("", model)


def _merged(cfg, shipped: Path, to: Path, dtype: torch.dtype, max_shard_bytes: int) -> None:
    from fasttrain.models.families import is_composite, released_key, text_tower_key
    from fasttrain.models.stream_load import checkpoint_tensors
    from fasttrain.nn import load_adapter
    from fasttrain.train.policy import build_policy

    src, full = _source(cfg)
    model, tokenizer, _ = build_policy(cfg, torch.device("cpu"))
    try:
        load_adapter(model, shipped)
    except ValueError as e:
        raise ConfigError(f"{shipped}: the shipped adapter does not fit the policy the run's config.toml builds: {e}") \
            from None
    to.mkdir(parents=True, exist_ok=True)
    writer = _ShardWriter(to, max_shard_bytes)
    with torch.no_grad():
        for name, t in merged_tensors(model, dtype, fused_experts=_fused_experts(src)):
            writer.add(released_key(name, full) if full is not None else name, t)
        if full is not None and is_composite(full):
            for key, info, read in checkpoint_tensors(src):     # the towers fasttrain did not train, as released
                if text_tower_key(key, full) is None:
                    writer.add(key, read(dtype))
    writer.close()
    _write_config(model, full, dtype, to)
    if src is not None:
        for f in sorted(src.iterdir()):
            if f.is_file() and not any(f.match(p) for p in _WEIGHT_FILES) and not (to / f.name).exists():
                shutil.copy2(f, to / f.name)
    else:                                  # a module:factory model: its own config and tokenizer
        if hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(to)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(to)


def _fused_experts(src: Path | None) -> bool:
    """Whether the source checkpoint stores its routed experts as fused stacks (`.experts.gate_up_proj`),
    read from the safetensors headers; a module:factory model is written per expert, as transformers
    saves it."""
    if src is None:
        return False
    from safetensors import safe_open

    from fasttrain.models.stream_load import checkpoint_files
    for f in checkpoint_files(src):
        with safe_open(str(f), framework="pt") as h:
            if any(k.endswith(".experts.gate_up_proj") for k in h.keys()):
                return True
    return False


def _write_config(model, full, dtype: torch.dtype, to: Path) -> None:
    import copy
    config = copy.deepcopy(full if full is not None else model.config)
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    for c in (config, getattr(config, "text_config", None)):
        if c is not None:
            c.dtype = dtype
            if hasattr(c, "use_cache"):
                c.use_cache = True             # the trainer turns it off for its training forwards
    config.save_pretrained(to)
