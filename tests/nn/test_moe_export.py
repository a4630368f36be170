"""The routed experts exported for serving (fasttrain.nn.moe_export, `fasttrain export`).

Merged: the experts as W_e + s·B_e·A_e per expert, under the layout the source stores (per expert
for Qwen3-MoE as transformers saves it, fused stacks for Qwen3.5-MoE as released), written in
float64 and loaded by transformers' own model, give fasttrain's adapted logits (NF4 experts
decoded); tolerance as tests/models/test_moe_models.py (float64, rounding order only). Through
`fasttrain export --format merged` of an NF4 run, each exported expert is one 16-bit rounding of the
float64 merge of the decoded NF4 weight: |w' - w| <= u16·|w| + 2e, e = (r + K + 8)·u32·(|W| + s|B||A|)
the fp32 merge's error (tests/train/test_export.py derives it), and the folder loads in
transformers with every key.

vLLM: the adapter in the layout vLLM's MoE LoRA loader reads for the class it builds: per-expert 2-D
keys for Qwen3-MoE, whose factors merged into transformers' model give fasttrain's logits; PEFT's
fused 3-D file for a Qwen3_5MoeForConditionalGeneration checkpoint, whose factors decoded as vLLM
decodes them (lora_A reshaped to (E, r, in), lora_B to (out, r, E) and permuted) are fasttrain's."""
import copy
import json
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fasttrain.models.moe import moe_surgery
from fasttrain.models.moe_tiny import tiny_qwen3_5_moe, tiny_qwen3_moe
from fasttrain.nn import attach_adapters, save_adapter
from fasttrain.nn.moe_experts import moe_expert_layers
from fasttrain.nn.moe_export import vllm_expert_lora
from fasttrain.train.export import export_run, merged_tensors

from support.checkpoints import word_tokenizer
from support.hf_oracle import hf_float64_oracle
from support.moe_oracle import hf_routing
from support.tolerances import forward_tol

pytestmark = pytest.mark.one_thread      # the one-thread default (tests/conftest.py)

FAMILIES = {"qwen3_moe": tiny_qwen3_moe, "qwen3_5_moe": tiny_qwen3_5_moe}
IDS = torch.tensor([[5, 9, 11, 40, 3, 7, 8, 60, 2, 33]])
U32, RANK = 2.0 ** -24, 3


def _tol(c, S=IDS.shape[1]):
    return forward_tol(c, S, head_dim=16)


def _adapted(family, nf4):
    hf = FAMILIES[family](vocab_size=97, dtype=torch.float64)
    model = moe_surgery(copy.deepcopy(hf), nf4=nf4)
    torch.manual_seed(2)
    for p in attach_adapters(model, r=RANK, alpha=6.0, targets=["experts"]):
        torch.nn.init.normal_(p, std=0.2)                               # B factors off zero, so they act
    return hf, model


def _logits(model, oracle=False):
    with ExitStack() as st, torch.no_grad():
        if model.config.model_type.startswith("qwen3_5"):
            st.enter_context(hf_float64_oracle("qwen3_5_moe"))
        if oracle:
            st.enter_context(hf_routing(model))
        return model(IDS).logits


@pytest.mark.parametrize("family,fused", [("qwen3_moe", False), ("qwen3_5_moe", True)])
def test_merged_experts_load_in_transformers_with_fasttrains_logits(family, fused, tmp_path):
    from transformers import AutoModelForCausalLM
    hf, model = _adapted(family, nf4=False)
    tensors = dict(merged_tensors(model, torch.float64, fused_experts=fused))
    experts = [k for k in tensors if ".experts." in k]
    assert all((k.endswith(("gate_up_proj", "down_proj")) if fused else ".0." in k or "proj.weight" in k)
               for k in experts) and experts
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    hf.config.save_pretrained(tmp_path)
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    want, got = _logits(loaded.eval(), oracle=True), _logits(model)
    assert (want - got).abs().max() <= _tol(hf.config)
    assert (_logits(hf, oracle=True) - got).abs().max() > 1e3 * _tol(hf.config)      # the adapter acts


def test_vllm_per_expert_keys_merged_into_transformers_give_fasttrains_logits(tmp_path):
    hf, model = _adapted("qwen3_moe", nf4=False)
    save_adapter(model, tmp_path / "a")
    t = vllm_expert_lora(load_file(str(tmp_path / "a" / "adapter_model.safetensors")), RANK)
    s = moe_expert_layers(model)[0][1].scale
    with torch.no_grad():
        for name, m in moe_expert_layers(model):
            ex = hf.get_submodule(name)
            for e in range(m.num_experts):
                key = f"base_model.model.{name}.{e}"
                d = {p: s * t[f"{key}.{p}.lora_B.weight"].double() @ t[f"{key}.{p}.lora_A.weight"].double()
                     for p in ("gate_proj", "up_proj", "down_proj")}
                ex.gate_up_proj[e] += torch.cat([d["gate_proj"], d["up_proj"]])
                ex.down_proj[e] += d["down_proj"]
    assert (_logits(hf, oracle=True) - _logits(model)).abs().max() <= _tol(hf.config)
    assert len(t) == 6 * sum(m.num_experts for _, m in moe_expert_layers(model))


# ---- through `fasttrain export` ----------------------------------------------------------------------
def _source(family: str, path: Path) -> Path:
    """A checkpoint folder as released: Qwen3-MoE saved by transformers (per-expert keys); Qwen3.5-MoE
    as its ForConditionalGeneration with a tiny vision tower and fused expert stacks."""
    text = FAMILIES[family](vocab_size=64, dtype=torch.bfloat16)
    if family == "qwen3_moe":
        text.save_pretrained(path)
    else:
        from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
        cfg = Qwen3_5MoeConfig(text_config=text.config.to_dict(), vision_config=dict(
            depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=text.config.hidden_size))
        cfg.architectures = ["Qwen3_5MoeForConditionalGeneration"]
        torch.manual_seed(4)
        vl = Qwen3_5MoeForConditionalGeneration(cfg).to(torch.bfloat16)
        state = {"model.language_model." + k[len("model."):] if k.startswith("model.") else k: v
                 for k, v in text.state_dict().items()}
        state.update({k: v for k, v in vl.state_dict().items() if k.startswith("model.visual.")})
        path.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"),
                  metadata={"format": "pt"})
        cfg.save_pretrained(path)
    word_tokenizer(path)
    return path


def _run(tmp_path: Path, family: str):
    from fasttrain.train.config import config_to_toml, load_config
    from fasttrain.train.policy import build_policy
    src = _source(family, tmp_path / "source")
    cfg = load_config("demo", [f"policy.model={json.dumps(str(src))}", "policy.quantize=nf4", "policy.adapter=lora",
                               "policy.dtype=bfloat16", f"policy.rank={RANK}", "policy.alpha=6", "run.device=cpu",
                               # in_proj_qkv left out: vLLM leaves it unwrapped (fasttrain.train.export)
                               'policy.targets=["q_proj", "o_proj", "experts"]'])
    run = tmp_path / "run"
    (run / "shipped").mkdir(parents=True)
    (run / "config.toml").write_text(config_to_toml(cfg))
    model, _, _ = build_policy(cfg, torch.device("cpu"))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, m in moe_expert_layers(model):
            m.gate_up_lora_B.normal_(0.0, 0.1, generator=g)
            m.down_lora_B.normal_(0.0, 0.1, generator=g)
    save_adapter(model, run / "shipped" / "adapter", base_model=str(src))
    (run / "shipped" / "shipped.json").write_text(json.dumps({"step": 3}))
    return src, run, model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_of_an_nf4_moe_run_merged_and_for_vllm(family, tmp_path):
    from fasttrain.ops import reference as R
    src, run, model = _run(tmp_path, family)
    released = set(load_file(str(src / "model.safetensors")))
    pre = "model.language_model." if family == "qwen3_5_moe" else "model."

    out = export_run(run, tmp_path / "merged", "merged", "bfloat16")
    exported = load_file(str(out / "model.safetensors"))
    assert set(exported) == released
    for name, m in moe_expert_layers(model):                          # one rounding of the float64 merge
        key = pre + name[len("model."):]
        for stack in ("gate_up", "down"):
            st, a, b = m.stack(stack), getattr(m, f"{stack}_lora_A").double(), getattr(m, f"{stack}_lora_B").double()
            for e in range(m.num_experts):
                w0 = R.nf4_decode_weight(st.qweight[e], st.expert_state(e), torch.float32).double()
                w = w0 + m.scale * (b[e] @ a[e])
                err = (RANK + w.shape[1] + 8) * U32 * (w0.abs() + m.scale * (b[e].abs() @ a[e].abs()))
                if family == "qwen3_5_moe":
                    got = exported[f"{key}.{stack}_proj"][e]
                elif stack == "gate_up":
                    got = torch.cat([exported[f"{key}.{e}.gate_proj.weight"], exported[f"{key}.{e}.up_proj.weight"]])
                else:
                    got = exported[f"{key}.{e}.down_proj.weight"]
                assert got.dtype == torch.bfloat16
                assert ((got.double() - w).abs() <= 2.0 ** -8 * w.abs() + 2 * err).all(), (name, stack, e)
    if family == "qwen3_moe":                                          # the released class loads it whole
        from transformers import AutoModelForCausalLM
        _, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64, output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info

    vl = export_run(run, tmp_path / "vllm", "vllm")
    t = load_file(str(vl / "adapter_model.safetensors"))
    config = json.loads((vl / "adapter_config.json").read_text())
    name, m = moe_expert_layers(model)[0]
    key = "base_model.model." + pre + name[len("model."):]
    E, inter = m.num_experts, m.intermediate
    if family == "qwen3_moe":                                          # 2-D per expert
        assert not any(".experts.lora_" in k or "base_layer" in k for k in t)
        assert {"gate_proj", "up_proj", "down_proj"} <= set(config["target_modules"])
        for e in range(E):
            assert torch.equal(t[f"{key}.{e}.gate_proj.lora_A.weight"], m.gate_up_lora_A[e].float())
            assert torch.equal(t[f"{key}.{e}.up_proj.lora_B.weight"], m.gate_up_lora_B[e, inter:].float())
            assert torch.equal(t[f"{key}.{e}.down_proj.lora_B.weight"], m.down_lora_B[e].float())
    else:                                                              # 3-D, decoded as vLLM decodes it
        assert not any(f"{key}.0." in k for k in t) and config["target_parameters"]
        for stack, part in (("gate_up", ".base_layer"), ("down", "")):
            a, b = t[f"{key}{part}.lora_A.weight"], t[f"{key}{part}.lora_B.weight"]
            a3, b3 = a.reshape(E, -1, a.shape[-1]), b.reshape(b.shape[0], -1, E).permute(2, 0, 1)
            assert torch.equal(a3, getattr(m, f"{stack}_lora_A").float())
            assert torch.equal(b3, getattr(m, f"{stack}_lora_B").float())
