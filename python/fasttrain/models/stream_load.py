"""load_streamed: a causal LM from a safetensors directory, one tensor at a time, its projections
quantized to NF4 as they arrive, so the model is never whole in 16 bits in memory.

How: the model is built from config.json with its parameters on the meta device (buffers, such
as the rotary frequencies, are computed as a normal build computes them); then each shard is read
tensor by tensor (the safetensors header gives each tensor's dtype, shape and byte range; the bytes
are read into a tensor torch allocates: nothing is memory-mapped), cast to the model's dtype as
from_pretrained casts floating tensors (a few MiB at a time), and either put in its place or, for a target projection (an nn.Linear
named q_proj ... down_proj), held until its weight (and bias) are read and turned into an
NF4Linear at once. Parameters shared in the built model (tied embeddings) stay shared, unless the
checkpoint stores them twice with different values (then, as from_pretrained, each keeps its own). Peak: the loaded model (NF4
projections + unquantised parts) plus one projection in the model dtype and its NF4 codes (or a
read buffer of READ_CHUNK_BYTES, while a tensor is cast).

A block-FP8 checkpoint (models/block_fp8.py) is read the same way: each float8_e4m3fn weight is
decoded with its weight_scale_inv a block row at a time into the model's dtype (the decode's buffer
is block_fp8.dequantize_buffer_bytes), then kept or quantized like any other; a vision-language
checkpoint (qwen3_5) loads its text tower, its keys renamed as transformers renames them
(models/families.py: `text_tower_key`).

The result has the same bytes as from_pretrained followed by fasttrain.nn.quantize_model
(tests/models/test_stream_load.py); for FP8, as transformers' own dequantization on load, and
where it refuses (partial edge blocks: it derives the block from the scale grid) as its FP8
layer's decode of the weight (tests/models/test_fp8_load.py). What it is not: a general from_pretrained. No key renaming for old
checkpoint layouts, no pickled .bin files, no remote code, no sharding across devices.
"""
from __future__ import annotations

import json
import os
import struct
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from .block_fp8 import SCALE_SUFFIX

__all__ = ["load_streamed", "wants_nf4", "checkpoint_files", "checkpoint_tensors", "READ_CHUNK_BYTES"]

READ_CHUNK_BYTES = 8 << 20        # a tensor stored in another dtype is read and cast this much at a time

# safetensors dtype names (the format's header) -> torch dtypes
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


def wants_nf4(quantize: bool | str | None) -> bool:
    """policy.quantize as the loader reads it: True or "nf4" quantize; False, None or "none" do not."""
    if quantize in (True, "nf4"):
        return True
    if quantize in (False, None, "none"):
        return False
    raise ValueError(f"quantize={quantize!r}: allowed values are 'nf4', 'none' (or True, False)")


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors shards of a model directory, in the index's order (model.safetensors.index.json)
    or the one model.safetensors, or every *.safetensors file sorted by name."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = dict.fromkeys(json.loads(index.read_text())["weight_map"].values())
        return [path / n for n in names]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights")
    return files


def _read_header(f, name: Path) -> tuple[dict, int]:
    raw = f.read(8)
    if len(raw) != 8:
        raise ValueError(f"{name}: not a safetensors file (shorter than its 8-byte header length)")
    (n,) = struct.unpack("<Q", raw)
    try:
        header = json.loads(f.read(n))
    except ValueError as e:
        raise ValueError(f"{name}: not a safetensors file (header is not JSON: {e})") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def _headers(files: list[Path]) -> dict[str, tuple[Path, int, dict]]:
    """Every tensor of the checkpoint: key -> (shard, start of its data section, header entry)."""
    where: dict[str, tuple[Path, int, dict]] = {}
    for shard in files:
        with open(shard, "rb") as f:
            header, base = _read_header(f, shard)
        for key, info in header.items():
            where[key] = (shard, base, info)
    return where


def _numel(info: dict) -> int:
    n = 1
    for d in info["shape"]:
        n *= d
    return n


def _read_exact(f, dst: torch.Tensor, shard: Path, key: str) -> None:
    if f.readinto(dst.view(torch.uint8).reshape(-1).numpy()) != dst.numel() * dst.element_size():
        raise ValueError(f"{shard}: tensor {key!r} is cut short (truncated file)")


def _read_plain(f, shard: Path, base: int, key: str, info: dict, stored: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """The tensor in `dtype` (floating tensors; others as stored), read in place, or READ_CHUNK_BYTES
    at a time into one buffer and cast when the dtypes differ."""
    start, end = info["data_offsets"]
    n = _numel(info)
    if n * stored.itemsize != end - start:
        raise ValueError(f"{shard}: tensor {key!r} holds {end - start} bytes for shape {info['shape']} {info['dtype']}")
    out_dtype = dtype if stored.is_floating_point else stored
    out = torch.empty(info["shape"], dtype=out_dtype)
    flat = out.reshape(-1)
    f.seek(base + start)
    if out_dtype == stored:
        _read_exact(f, flat, shard, key)
        return out
    step = max(1, READ_CHUNK_BYTES // stored.itemsize)
    buf = torch.empty(min(step, n), dtype=stored)
    for i in range(0, n, step):
        k = min(step, n - i)
        _read_exact(f, buf[:k], shard, key)
        flat[i:i + k].copy_(buf[:k])
    return out


def _read_fp8(f, shard: Path, base: int, key: str, info: dict, fp8, scale_at, dtype: torch.dtype) -> torch.Tensor:
    """A block-FP8 weight decoded into `dtype`: its weight_scale_inv read whole (one float32 per
    block), then block rows of FP8 read and decoded in turn (block_fp8.dequantize_rows)."""
    from .block_fp8 import dequantize_rows, rows_per_read, scale_shape

    if len(info["shape"]) != 2:
        raise ValueError(f"{shard}: FP8 tensor {key!r} has shape {info['shape']}; block-FP8 weights are matrices")
    n, k = info["shape"]
    if scale_at is None:
        raise ValueError(f"{shard}: FP8 tensor {key!r} has no {key}{SCALE_SUFFIX} in the checkpoint (a block-FP8 "
                         "weight needs its float32 scales)")
    s_shard, s_base, s_info = scale_at
    want = scale_shape((n, k), fp8.block)
    if s_info["dtype"] != "F32" or tuple(s_info["shape"]) != want:
        raise ValueError(f"{s_shard}: {key}{SCALE_SUFFIX} is {s_info['dtype']} {tuple(s_info['shape'])}; a "
                         f"{fp8.block[0]}x{fp8.block[1]}-block FP8 weight of shape {(n, k)} needs F32 {want}")
    start, end = info["data_offsets"]
    if n * k != end - start:
        raise ValueError(f"{shard}: tensor {key!r} holds {end - start} bytes for shape {info['shape']} F8_E4M3")
    with open(s_shard, "rb") as sf:
        scale = _read_plain(sf, s_shard, s_base, key + SCALE_SUFFIX, s_info, torch.float32, torch.float32)
    out = torch.empty(n, k, dtype=dtype)
    rows = rows_per_read(n, k, fp8.block)
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn)
    f.seek(base + start)
    for i in range(0, n, rows):
        r = min(rows, n - i)
        _read_exact(f, q[:r], shard, key)
        dequantize_rows(q[:r], scale, fp8.block, i, out[i:i + r])
    return out


def _tensors(shard: Path, fp8=None, where: dict | None = None):
    """(key, info, read) for every tensor of one safetensors shard, in file order; read(dtype)
    returns the tensor in `dtype` (floating tensors; others as stored) in a fresh allocation
    (torch's allocator), so the caller holds its only reference. A tensor stored in another
    dtype is read READ_CHUNK_BYTES at a time into one buffer and cast into place: the whole tensor
    as stored is never in memory beside its cast. With `fp8` (the checkpoint's BlockFP8 layout,
    `where` the checkpoint's tensors) an FP8 weight is decoded with its scales, which are not
    yielded themselves."""
    with open(shard, "rb") as f:
        header, base = _read_header(f, shard)
        for key, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            if info["dtype"] == "F8_E4M3":
                if fp8 is None:
                    raise ValueError(f"{shard}: tensor {key!r} is float8_e4m3fn, but config.json declares no FP8 "
                                     "quantization_config (quant_method \"fp8\" with weight_block_size)")

                def read(dtype: torch.dtype, info=info, key=key) -> torch.Tensor:
                    return _read_fp8(f, shard, base, key, info, fp8, where.get(key + SCALE_SUFFIX), dtype)
                yield key, info, read
                continue
            if fp8 is not None and key.endswith(SCALE_SUFFIX) and key[:-len(SCALE_SUFFIX)] in where:
                continue                  # read with its weight
            stored = DTYPES.get(info["dtype"])
            if stored is None:
                raise ValueError(f"{shard}: tensor {key!r} has dtype {info['dtype']}; fasttrain reads "
                                 f"{', '.join(DTYPES)} and block-FP8 F8_E4M3 weights")

            def read(dtype: torch.dtype, info=info, stored=stored, key=key) -> torch.Tensor:
                return _read_plain(f, shard, base, key, info, stored, dtype)
            yield key, info, read


@contextmanager
def _parameters_on_meta():
    """Every parameter registered inside the block is made on the meta device (its initialiser
    then runs on no data); buffers are computed normally."""
    original = nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
        original(module, name, param)
    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def _check_shape(info: dict, like: torch.Tensor, shard: Path, key: str) -> None:
    if tuple(info["shape"]) != tuple(like.shape):
        raise ValueError(f"{shard}: tensor {key!r} has shape {tuple(info['shape'])}, the model built from "
                         f"config.json expects {tuple(like.shape)}")


def load_streamed(path: str | os.PathLike, dtype: torch.dtype = torch.float32, quantize: bool | str = False,
                  targets: tuple[str, ...] | None = None, blocksize: int = 64, claim=None):
    """The causal LM of the Hugging Face directory `path` (config.json + safetensors) in `dtype`,
    with its `targets` projections (default fasttrain.nn.surgery.PROJECTIONS) as NF4Linear when
    `quantize` asks for NF4. Frozen (requires_grad False), eval mode, on the CPU. `claim`: a family's
    piece offered every tensor first (`take(key, info, read, dtype)`; True: it took it) and called
    as `finish(model, dtype)` after the last shard (fasttrain.models.moe_stream: the routed experts)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from fasttrain.nn.nf4_linear import NF4Linear
    from fasttrain.nn.surgery import PROJECTIONS, set_module

    from .block_fp8 import block_fp8_format
    from .families import text_config, text_tower_key

    path = Path(path)
    nf4 = wants_nf4(quantize)
    full = AutoConfig.from_pretrained(path, local_files_only=True)
    fp8 = block_fp8_format(_config_json(path), where=str(path))
    config = text_config(full)
    for c in (full, config):            # the loaded model is 16-bit (or NF4): it carries no FP8 config
        if getattr(c, "quantization_config", None) is not None:
            del c.quantization_config
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    names = tuple(targets or PROJECTIONS)
    projections = {n: m for n, m in model.named_modules()
                   if nf4 and isinstance(m, nn.Linear) and n.rpartition(".")[2] in names}
    if nf4 and not projections:
        raise ValueError(f"{path}: no nn.Linear named any of {names} to quantize in {type(model).__name__}")
    # every place (module, name) a parameter object sits, in module order: tied parameters sit in
    # several. As from_pretrained does, a tied group takes the first tensor read for any of its
    # places; a later one with equal values stays tied, one with other values gets its own.
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    group_of: dict[tuple[int, str], int] = {}
    for _, mod in model.named_modules(remove_duplicate=False):
        for pname, p in mod._parameters.items():
            if p is not None and (id(mod), pname) not in group_of:
                group_of[(id(mod), pname)] = id(p)
                places.setdefault(id(p), []).append((mod, pname))
    loaded: dict[int, nn.Parameter] = {}        # group -> the parameter its places share
    pending: dict[str, dict[str, torch.Tensor]] = {}
    unexpected: list[str] = []
    files = checkpoint_files(path)
    where = _headers(files) if fp8 is not None else None
    for shard in files:
        for stored_key, info, read in _tensors(shard, fp8, where):
            key = text_tower_key(stored_key, full)
            if key is None:               # another tower of a vision-language checkpoint, an MTP head
                continue
            if claim is not None and claim.take(key, info, read, dtype):
                continue
            owner, _, leaf = key.rpartition(".")
            if owner in projections:
                lin = projections[owner]
                like = getattr(lin, leaf) if leaf in ("weight", "bias") else None
                if like is None:
                    unexpected.append(key)
                    continue
                got = pending.setdefault(owner, {})
                _check_shape(info, like, shard, key)
                got[leaf] = read(dtype)
                if "weight" in got and (lin.bias is None or "bias" in got):
                    set_module(model, owner, _nf4(NF4Linear, lin, pending.pop(owner), blocksize))
                continue
            try:
                mod = model.get_submodule(owner)
            except AttributeError:
                unexpected.append(key)
                continue
            old = mod._parameters.get(leaf) if leaf in mod._parameters else mod._buffers.get(leaf)
            if old is None:
                unexpected.append(key)
                continue
            if leaf in mod._buffers:
                _check_shape(info, old, shard, key)
                mod._buffers[leaf] = read(old.dtype)
                continue
            group = group_of[(id(mod), leaf)]
            _check_shape(info, old, shard, key)
            new = nn.Parameter(read(dtype), requires_grad=False)
            if group not in loaded:
                for m, n in places[group]:
                    m._parameters[n] = new
                loaded[group] = new
            elif not torch.equal(new, loaded[group]):
                mod._parameters[leaf] = new        # stored twice with other values: not tied
    if claim is not None:
        claim.finish(model, dtype)
    if pending:
        raise ValueError(f"{path}: the checkpoint has part of projection(s) {sorted(pending)[:4]} "
                         f"(got {sorted(next(iter(pending.values())))} of weight and bias)")
    missing = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if missing:
        raise ValueError(f"{path}: the checkpoint lacks {len(missing)} tensor(s) the model built from config.json "
                         f"needs, e.g. {missing[:4]}" + (f"; it has unexpected keys, e.g. {unexpected[:4]}"
                                                         if unexpected else ""))
    if unexpected:
        import warnings
        warnings.warn(f"{path}: {len(unexpected)} checkpoint tensor(s) the model does not use were skipped, "
                      f"e.g. {unexpected[:4]}", stacklevel=2)
    for p in model.parameters():
        p.requires_grad_(False)
    config._name_or_path = str(path)
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    return model.eval()


def _config_json(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def checkpoint_tensors(path: str | os.PathLike):
    """(key, info, read) for every tensor of the safetensors checkpoint in `path`, shard by shard in
    file order, as the loader reads them: read(dtype) returns a fresh tensor, a block-FP8 weight
    decoded (its scales are not yielded). For copying a checkpoint's tensors through one at a time."""
    from .block_fp8 import block_fp8_format

    path = Path(path)
    files = checkpoint_files(path)
    fp8 = block_fp8_format(_config_json(path), where=str(path))
    where = _headers(files) if fp8 is not None else None
    for shard in files:
        yield from _tensors(shard, fp8, where)


def _nf4(cls, lin: nn.Linear, got: dict, blocksize: int):
    """An NF4Linear from a projection's weight (and bias) in the model dtype."""
    dense = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta")
    dense.weight = nn.Parameter(got["weight"], requires_grad=False)
    if lin.bias is not None:
        dense.bias = nn.Parameter(got["bias"], requires_grad=False)
    layer = cls.from_linear(dense, blocksize=blocksize)
    for p in layer.parameters():
        p.requires_grad_(False)
    return layer


