"""`fasttrain export`: the shipped checkpoint of a run as the PEFT adapter, as a merged 16-bit model
that transformers loads, and as the LoRA layout vLLM's loader reads.

A run folder is made the way a run leaves it (config.toml, shipped/adapter, shipped.json) with an
adapter whose B and DoRA magnitudes are moved off their initial values, so folding it in changes
the model. The oracle of the merged model is a float64 forward of the policy as trained: the base
as the run held it (NF4 decoded, or the 16-bit weights, from an FP8 or 16-bit checkpoint) plus the
adapter, merged in float64, in transformers' own model (the hybrid's delta rule and conv in float64,
support.hf_oracle). Two bounds, both from rounding:
  weights   each exported element w' against the float64 merged w: |w' - w| <= u16·|w| + 2e (+ 2^-25
            for fp16's subnormals), u16 = 2^-8 (bf16) or 2^-11 (fp16) the final rounding, e the fp32
            merge's error (r + K + 8)·u32·g·(|W| + s·|B||A|), u32 = 2^-24, g DoRA's scale (1 for LoRA);
  outputs   each next-token log-prob y_t of the exported model (loaded by transformers, computed in
            float64) against the oracle's: |Δy_t| <= 2·Σ_w |∂y_t/∂w|·|w' - w| over every tensor, the
            first-order change from the stored weights' rounding, doubled for the second-order
            remainder (relative size u16). The same bound is checked to be tight enough to see the
            adapter: the base alone is outside it.
"""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fasttrain.models.families import released_key
from fasttrain.nn import save_adapter
from fasttrain.nn.adapted_linear import adapted_layers
from fasttrain.train.config import config_to_toml, load_config
from fasttrain.train.export import export_run
from fasttrain.train.policy import build_policy

from support.checkpoints import HYBRID_TEXT, word_tokenizer
from support.fp8_checkpoints import write_fp8_checkpoint

pytestmark = pytest.mark.one_thread      # the one-thread default (tests/conftest.py)

U16 = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
U32 = 2.0 ** -24
RANK = 4
IDS = torch.tensor([[5, 17, 3, 42, 8, 29, 11, 60]])        # a fixed sequence inside every vocabulary here


def _llama_fp8(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
    torch.manual_seed(3)
    write_fp8_checkpoint(LlamaForCausalLM(cfg).to(torch.bfloat16), path, (128, 128), not_converted=("lm_head",))
    word_tokenizer(path)
    return path


def _hybrid_vl(path: Path) -> Path:
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    cfg = Qwen3_5Config(text_config=HYBRID_TEXT, vision_config=dict(depth=1, hidden_size=16, intermediate_size=32,
                                                            num_heads=2, out_hidden_size=32))
    torch.manual_seed(4)
    Qwen3_5ForConditionalGeneration(cfg).to(torch.bfloat16).save_pretrained(path)
    word_tokenizer(path)
    return path


def _run(tmp_path: Path, source: Path, quantize: str, adapter: str, targets: tuple[str, ...] = ()):
    """A run folder as a finished run leaves it, and the policy it trained (adapter moved off its start)."""
    sets = [f"policy.model={json.dumps(str(source))}", f"policy.quantize={quantize}", f"policy.adapter={adapter}",
            "policy.dtype=bfloat16", f"policy.rank={RANK}", "policy.alpha=8", "run.device=cpu"]
    if targets:
        sets.append(f"policy.targets={json.dumps(list(targets))}")
    cfg = load_config("demo", sets)
    run = tmp_path / "run"
    (run / "shipped").mkdir(parents=True)
    (run / "config.toml").write_text(config_to_toml(cfg))
    model, _, _ = build_policy(cfg, torch.device("cpu"))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, m in adapted_layers(model):
            if m.adapter is None:                          # a projection policy.targets leaves out
                continue
            m.lora_B.normal_(0.0, 0.1, generator=g)
            if m.lora_magnitude is not None:
                m.lora_magnitude.mul_(1 + 0.2 * torch.randn(m.lora_magnitude.shape, generator=g))
    save_adapter(model, run / "shipped" / "adapter", base_model=str(source))
    (run / "shipped" / "shipped.json").write_text(json.dumps({"step": 3}))
    return run, model


def _float64_merge(m, fold: bool = True):
    """(W merged in float64, the elementwise bound on its fp32 merge's error e)."""
    w = m.base_weight(torch.float64)
    a, b = m.lora_A.detach().double(), m.lora_B.detach().double()
    size = w.abs() + m.scale * (b.abs() @ a.abs())
    if not fold:
        return w, torch.zeros_like(w)
    w = w + m.scale * (b @ a)
    g = torch.ones(w.shape[0], 1, dtype=torch.float64)
    if m.adapter == "dora":
        g = (m.lora_magnitude.detach().double() / w.norm(dim=1)).unsqueeze(1)
        w = w * g
    return w, (RANK + w.shape[1] + 8) * U32 * g.abs() * size


def _reference(policy, fold: bool = True):
    """transformers' text model in float64 holding the policy as trained (base + adapter merged in
    float64), and {name: merge error bound} for the adapted weights."""
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_config(policy.config, dtype=torch.float64)
    state, err = {}, {}
    layers = dict(adapted_layers(policy))
    for name, t in policy.state_dict().items():
        owner = name.rpartition(".")[0]
        if owner in layers:
            continue
        state[name] = t.double() if t.is_floating_point() else t
    for name, m in layers.items():
        state[name + ".weight"], err[name + ".weight"] = _float64_merge(m, fold)
        if m.bias is not None:
            state[name + ".bias"] = m.bias.detach().double()
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    ref.tie_weights()
    return ref.eval(), err


def _logprobs(model, hybrid: bool):
    from support.hf_oracle import hf_float64_oracle
    with hf_float64_oracle() if hybrid else torch.enable_grad():
        z = model(IDS).logits[0, :-1]
    return z.log_softmax(-1).gather(1, IDS[0, 1:, None])[:, 0]


def _first_order_bound(ref, delta: dict, hybrid: bool) -> torch.Tensor:
    params = {n: p for n, p in ref.named_parameters() if n in delta}
    for p in ref.parameters():
        p.requires_grad_(p in set(params.values()))
    y = _logprobs(ref, hybrid)
    out = []
    for t in range(y.numel()):
        grads = torch.autograd.grad(y[t], list(params.values()), retain_graph=True, allow_unused=True)
        out.append(sum((g.abs() * delta[n]).sum() for n, g in zip(params, grads) if g is not None))
    return 2 * torch.stack(out).detach()


CASES = [  # source, base, adapter, export dtype
    ("llama-fp8", "nf4", "dora", "bfloat16"),
    ("llama-fp8", "none", "lora", "float16"),
    ("hybrid-vl", "nf4", "lora", "bfloat16"),
]


@pytest.mark.parametrize("source,quantize,adapter,dtype", CASES)
def test_merged_model_loads_in_transformers_with_the_policys_outputs(tmp_path, source, quantize, adapter, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    hybrid = source == "hybrid-vl"
    src = (_hybrid_vl if hybrid else _llama_fp8)(tmp_path / "source")
    run, policy = _run(tmp_path, src, quantize, adapter)
    out = export_run(run, tmp_path / "merged", "merged", dtype)
    full = AutoConfig.from_pretrained(src)
    # the released checkpoint's names: every tensor of the source (FP8 scales aside), none more
    released = {k for f in src.glob("*.safetensors") for k in load_file(str(f)) if not k.endswith("_scale_inv")}
    exported = load_file(str(out / "model.safetensors"))
    assert set(exported) == released
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["dtype"] == dtype
    assert (out / "tokenizer.json").is_file() and json.loads((out / "fasttrain_export.json").read_text())["step"] == 3

    ref, merge_err = _reference(policy)
    u16 = U16[getattr(torch, dtype)]
    eta = 2.0 ** -25 if dtype == "float16" else 0.0
    ref_state = ref.state_dict()
    for name, w in merge_err.items():                       # weights: one rounding of the float64 merge
        got = exported[released_key(name, full)].double()
        assert got.dtype == torch.float64 and exported[released_key(name, full)].dtype == getattr(torch, dtype)
        err = (got - ref_state[name]).abs()
        assert (err <= u16 * ref_state[name].abs() + 2 * w + eta).all(), (name, (err - u16 * ref_state[name].abs()).max())

    cls = AutoModelForCausalLM
    if hybrid:                                   # the released class (importing it takes seconds: only here)
        from transformers import Qwen3_5ForConditionalGeneration as cls
    loaded, info = cls.from_pretrained(out, dtype=torch.float64, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    loaded.eval()
    loaded_state = loaded.state_dict()
    delta = {n: (loaded_state[released_key(n, full)] - p).abs() for n, p in ref_state.items()
             if p.is_floating_point()}
    bound = _first_order_bound(ref, delta, hybrid)
    with torch.no_grad():
        y_ref, y_out = _logprobs(ref, hybrid), _logprobs(loaded, hybrid)
        base, _ = _reference(policy, fold=False)
        y_base = _logprobs(base, hybrid)
    gap = (y_out - y_ref).abs()
    print(f"\n{source} {quantize} {adapter} -> {dtype}: max |Δ log p| {gap.max():.3e}, bound {bound.min():.3e}.."
          f"{bound.max():.3e}; base alone {(y_base - y_ref).abs().max():.3e}")
    assert (gap <= bound).all(), (gap, bound)
    assert ((y_base - y_ref).abs() > bound).any()           # the bound sees the adapter
    if hybrid:                                              # the vision tower as released
        src_state = load_file(str(src / "model.safetensors"))
        assert all(torch.equal(exported[k], v) for k, v in src_state.items() if k.startswith("model.visual."))


# ---- vLLM ------------------------------------------------------------------------------------------
# vLLM's LoRA loader, as read in its source (vllm/lora/utils.py parse_fine_tuned_lora_name,
# lora_model.py from_local_checkpoint, peft_helper.py): strip "base_model.model.", apply the model's
# weights mapper's prefix table, restore the prefix; a key must end in lora_A.weight / lora_B.weight
# (or lora_embedding_A/B), the module is the name between; its last part must be one of the model's
# LoRA-capable modules; the config must have r, lora_alpha, target_modules, no DoRA, no modules_to_save.
VLLM_PREFIX_MAPPERS = {"LlamaForCausalLM": {},
                       "Qwen3_5ForConditionalGeneration": {"model.visual.": "visual.",
                                                           "lm_head.": "language_model.lm_head.",
                                                           "model.language_model.": "language_model.model."}}


# the module names vLLM's check accepts (its models' linear layers, packed ones expanded), per model
_LLAMA = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
VLLM_LORA_MODULES = {"LlamaForCausalLM": _LLAMA,
                     "Qwen3_5ForConditionalGeneration": _LLAMA | {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                                                                  "out_proj", "conv1d"}}


def _vllm_parse(key: str, prefixes: dict) -> tuple[str, bool]:
    head = "base_model.model."
    if key.startswith(head):
        name = key[len(head):]
        for old, new in prefixes.items():
            if name.startswith(old):
                name = new + name[len(old):]
                break
        key = head + name
    parts = key.split(".")
    start = 2 if key.startswith(head) else 0
    if parts[-1] == "weight" and parts[-2] in ("lora_A", "lora_B"):
        return ".".join(parts[start:-2]), parts[-2] == "lora_A"
    raise ValueError(f"{key} is unsupported LoRA weight")


def _unmap(name: str, prefixes: dict) -> str:
    for old, new in prefixes.items():
        if name.startswith(new):
            return old + name[len(new):]
    return name


@pytest.mark.parametrize("source", ["llama-fp8", "hybrid-vl"])
def test_vllm_layout_reads_back_the_way_vllms_loader_parses_it(tmp_path, source):
    from transformers import AutoConfig, AutoModelForCausalLM

    hybrid = source == "hybrid-vl"
    src = (_hybrid_vl if hybrid else _llama_fp8)(tmp_path / "source")
    targets = ("q_proj", "v_proj", "in_proj_z", "out_proj", "down_proj") if hybrid else ()
    run, policy = _run(tmp_path, src, "nf4", "lora", targets)
    out = export_run(run, tmp_path / "vllm", "vllm")
    arch = "Qwen3_5ForConditionalGeneration" if hybrid else "LlamaForCausalLM"
    prefixes = VLLM_PREFIX_MAPPERS[arch]
    full = AutoConfig.from_pretrained(src)
    with torch.device("meta"):
        if hybrid:
            from transformers import Qwen3_5ForConditionalGeneration
            released = Qwen3_5ForConditionalGeneration(full)
        else:
            released = AutoModelForCausalLM.from_config(full)
    linears = {n: m for n, m in released.named_modules() if isinstance(m, torch.nn.Linear)}
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == RANK and config["lora_alpha"] == 8 and not config["use_dora"]
    assert config["modules_to_save"] is None and config["bias"] == "none"
    expected = VLLM_LORA_MODULES[arch]
    layers = {released_key(n, full): m for n, m in adapted_layers(policy) if m.adapter is not None}
    tensors = load_file(str(out / "adapter_model.safetensors"))
    seen = set()
    for key, t in tensors.items():
        module, is_a = _vllm_parse(key, prefixes)
        hf_name = _unmap(module, prefixes)
        assert hf_name in linears and module.rpartition(".")[2] in expected, key
        assert module.rpartition(".")[2] in config["target_modules"]
        lin, layer = linears[hf_name], layers[hf_name]
        assert t.shape == ((RANK, lin.in_features) if is_a else (lin.out_features, RANK))
        assert torch.equal(t, layer.lora_A.detach() if is_a else layer.lora_B.detach())
        seen.add(hf_name)
        if hybrid:
            assert module.startswith("language_model.model.layers.")
    assert seen == set(layers)
    assert config["lora_alpha"] / config["r"] == next(iter(layers.values())).scale


def test_vllm_layout_refuses_dora_and_unwrapped_projections(tmp_path):
    src = _llama_fp8(tmp_path / "llama")
    run, _ = _run(tmp_path / "a", src, "nf4", "dora")
    with pytest.raises(ValueError, match="does not serve DoRA.*--format merged"):
        export_run(run, tmp_path / "out-dora", "vllm")
    run, _ = _run(tmp_path / "b", _hybrid_vl(tmp_path / "hybrid"), "nf4", "lora")
    with pytest.raises(ValueError, match="in_proj_qkv, which vLLM's LoRA layers .* leave unwrapped"):
        export_run(run, tmp_path / "out-qkv", "vllm")


def test_cli_exports_the_peft_adapter_and_says_what_is_missing(tmp_path):
    from typer.testing import CliRunner

    from fasttrain.cli import app

    src = _llama_fp8(tmp_path / "source")
    run, _ = _run(tmp_path, src, "nf4", "lora")
    res = CliRunner().invoke(app, ["export", str(run), "--to", str(tmp_path / "peft"), "--format", "peft"])
    assert res.exit_code == 0, res.output
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        assert (tmp_path / "peft" / f).read_bytes() == (run / "shipped" / "adapter" / f).read_bytes()
    res = CliRunner().invoke(app, ["export", str(run), "--to", str(tmp_path / "peft"), "--format", "peft"])
    assert res.exit_code == 2 and "not an empty folder" in res.output
    (run / "shipped" / "adapter" / "adapter_config.json").unlink()
    res = CliRunner().invoke(app, ["export", str(run), "--to", str(tmp_path / "x")])
    assert res.exit_code == 2 and "no shipped checkpoint" in res.output and "Traceback" not in res.output
