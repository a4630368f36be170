"""fasttrain.plan on paper: the meta-device build, the table's invariants, bad inputs."""
import json

import pytest
import torch

from fasttrain.plan import Device, gpu_spec, meta_policy, model_config, plan_memory
from fasttrain.plan.run_shape import RunShape

SHAPE = RunShape(prompts=4, group=12, prompt_tokens=300, new_tokens=128, micro_batch=8, passes=2)


def _qwen7b_params(c):
    H, I, L, V = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    D = H // c["num_attention_heads"]
    qd, kd = c["num_attention_heads"] * D, c["num_key_value_heads"] * D
    per_layer = H * qd + 2 * H * kd + (qd + 2 * kd) + qd * H + 3 * H * I + 2 * H   # q,k,v (+bias), o, MLP, norms
    return 2 * V * H + L * per_layer + H


def test_meta_build_reads_no_weight_file(tmp_path, monkeypatch):
    cfg = model_config("qwen2.5-7b")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(b"not a weight file")

    def refuse(*a, **k):
        raise AssertionError("a weight file was read")
    # imported before the patch: a module first imported under it would keep `refuse` as its
    # safe_open for the rest of the session (transformers' loader binds the name at import)
    import transformers.modeling_utils  # noqa: F401
    import safetensors
    import safetensors.torch
    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    monkeypatch.setattr(safetensors, "safe_open", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    m = meta_policy(model_config(str(tmp_path)), name="qwen2.5-7b")
    assert m.params == _qwen7b_params(cfg) == 7_615_616_512       # the published 7.61 B
    # NF4: half a byte per weight + one fp32 absmax per 64, plus the q/k/v biases (bf16)
    qkv_bias = m.layers * (m.heads + 2 * m.kv_heads) * m.head_dim * 2
    assert m.resident["nf4_base"] == m.linear_params // 2 + m.linear_params // 64 * 4 + qkv_bias
    # LoRA r=32 on the 7 projections: r·(in + out) fp32 each
    assert m.resident["adapter_masters"] == sum(32 * (o + i) * 4 for o, i in m.projections)


@pytest.mark.parametrize("name,expected", [("qwen2.5-32b", 32.76e9), ("llama-3.1-70b", 70.55e9),
                                           ("smollm2-135m", 134.5e6)])
def test_bundled_configs_give_the_published_sizes(name, expected):
    m = meta_policy(model_config(name), name=name)
    assert abs(m.params - expected) / expected < 0.005


@pytest.mark.parametrize("name,gpu", [("qwen2.5-32b", "h100-sxm-80gb"), ("smollm2-135m", "cpu")])
def test_every_part_is_nonnegative_and_sums_to_the_total(name, gpu):
    from fasttrain.plan.report import as_json, make_plan
    p = make_plan(model_config(name), SHAPE, gpu_spec(gpu), name=name, with_limits=False)
    j = as_json(p)
    for phase, parts in j["memory"].items():
        vals = {k: v for k, v in parts.items() if k != "total"}
        assert all(v >= 0 for v in vals.values()), (phase, vals)
        assert sum(vals.values()) == parts["total"] == p.memory.total(phase)
    assert j["peak_bytes"] == max(parts["total"] for parts in j["memory"].values())


def test_unfused_logits_cost_v_over_h_times_the_fused_head():
    m = meta_policy(model_config("qwen3-32b"), name="qwen3-32b")
    n = plan_memory(m, SHAPE, Device("cuda")).notes
    assert n["head_tokens"] == 8 * 128
    assert n["unfused_logits_bytes"] / n["fused_head_bytes"] == pytest.approx(m.vocab / m.hidden, rel=1e-12)


def test_checkpointing_keeps_fewer_activations_and_more_rows_cost_more():
    m = meta_policy(model_config("llama-3.1-8b"), name="llama-3.1-8b")
    on = plan_memory(m, SHAPE, Device("cuda"))
    off = plan_memory(m, SHAPE.with_(gradient_checkpointing=False), Device("cuda"))
    assert on.phases["update"]["activations"] < off.phases["update"]["activations"]
    assert on.notes["update_activations_other"] == off.phases["update"]["activations"] + off.phases["update"]["logprob_head"]
    bigger = plan_memory(m, SHAPE.with_(group=24), Device("cuda"))
    assert bigger.phases["rollout"]["kv_cache"] == 2 * on.phases["rollout"]["kv_cache"]


def test_unknown_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="known: h100-sxm-80gb, h200-141gb, a100-80gb, l40s-48gb, cpu"):
        gpu_spec("rtx-9090")


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 768, "n_layer": 12}))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported.*llama, qwen2, qwen3, mistral"):
        meta_policy(model_config(str(tmp_path)), name="gpt2")
    with pytest.raises(FileNotFoundError, match="bundled: llama-3.1-70b"):
        model_config(str(tmp_path / "nowhere"))


def test_the_study_run_on_one_h100_and_a_run_that_cannot_fit():
    from typer.testing import CliRunner

    from fasttrain.cli import app
    r = CliRunner().invoke(app, ["plan", "cispo_repo_r", "--model", "qwen2.5-32b", "--gpu", "h100-sxm-80gb", "--json"])
    assert r.exit_code == 0, r.output
    j = json.loads(r.output[r.output.index("{"):])
    assert j["fits"] and j["peak_bytes"] < 80e9 and j["largest"]["micro_batch"] == 48
    # the plan's computed times (not a clock): the dominant phase is the largest, the step their sum
    phases = dict(j["seconds"])
    total = phases.pop("step")
    assert j["dominant"] == max(phases, key=phases.get)
    assert abs(sum(phases.values()) - total) <= 1e-9 * total
    r = CliRunner().invoke(app, ["plan", "cispo", "--model", "llama-3.1-70b", "--gpu", "l40s-48gb",
                                 "--set", "rollout.group_size=64"])
    assert r.exit_code == 1
    assert "DOES NOT FIT: the resident parts alone" in r.output and "a larger GPU or a smaller model" in r.output


def test_plan_never_imports_the_trainer():
    import subprocess
    import sys
    code = "import sys, fasttrain.plan, fasttrain.plan.report; print(any(m.startswith('fasttrain.train') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_trainer_prints_the_plan_and_warns_when_it_will_not_fit(tmp_path, monkeypatch):
    from support.recipes import tiny_recipe
    from rich.console import Console

    import fasttrain.plan.gpus as gpus
    from fasttrain.train import Trainer, load_config

    console = Console(file=open(tmp_path / "out.txt", "w"), width=400)
    r = tiny_recipe(tmp_path, 2, 2, 4, 3)
    r["run"]["plan"] = "warn"                      # "apply" refuses instead (tests/train/test_plan_picks.py)
    tr = Trainer(load_config(r), progress=False, console=console)
    monkeypatch.setattr(gpus, "_host_memory", lambda: 1 << 20)      # a 1 MiB host: nothing fits
    tr._setup()
    console.file.close()
    text = (tmp_path / "out.txt").read_text()
    assert "plan: support.tiny_world:tiny_policy on this host's CPU: peak" in text and "DOES NOT FIT" in text
    assert any("DOES NOT FIT" in w["message"] for w in tr.warnings)


def test_rollout_weights_follow_the_trainers_rule():
    """rollout.base_weights: the plan keeps the dense copy exactly when the trainer's rule would
    (fasttrain.nn.rollout_weights.use_dense), and counts it in every phase of a step."""
    from fasttrain.nn.rollout_weights import AUTO_SHARE

    cfg = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}
    m = meta_policy(cfg, dtype="bfloat16")
    dense = m.linear_params * 2
    resident = sum(m.resident[k] for k in ("nf4_base", "dense_parts", "adapter_masters", "dora_norms"))
    s = RunShape(prompts=2, group=2, prompt_tokens=16, new_tokens=8, micro_batch=4)
    just = resident + int(dense / AUTO_SHARE)          # free memory at which the copy just fits
    for choice, free, kept in (("auto", just, True), ("auto", just - 8, False), ("nf4", 10 ** 15, False),
                               ("dequantized", 0, True)):
        plan = plan_memory(m, s.with_(rollout_weights=choice), Device("cuda", free=free))
        got = {ph: parts["rollout_weights"] for ph, parts in plan.phases.items() if ph != "load"}
        assert set(got.values()) == {dense if kept else 0}, (choice, free, got)
        assert plan.phases["load"].get("rollout_weights", 0) == 0          # made after the load
    with pytest.raises(ValueError, match="base_weights"):
        plan_memory(m, s.with_(rollout_weights="fp8"), Device("cuda"))


def test_host_memory_is_read_from_meminfo():
    """The cpu entry's memory is MemTotal (what the plan fits against); the trainer's "auto" rollout
    weights read MemAvailable; an unknown field reads as 0."""
    from fasttrain.host import meminfo_bytes

    total, avail = meminfo_bytes("MemTotal"), meminfo_bytes("MemAvailable")
    assert gpu_spec("cpu").memory_bytes == total > 0
    assert 0 < avail <= total
    assert meminfo_bytes("NoSuchField") == 0


@pytest.mark.parametrize("adapter", ["lora", "dora"])
def test_a_16bit_base_plans_the_models_own_bytes(adapter):
    """policy.quantize = "none": the resident base is the model's own projections in its dtype, so base
    + unquantised parts are the model's bytes (the parameter count x 2 for bf16, + rotary tables), equal to
    what the built policy (adaptable_model on the real modules) holds, and the phases still add up."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fasttrain.nn import adaptable_model, attach_adapters, resident_bytes
    from fasttrain.plan.report import as_json, make_plan
    cfg = model_config("smollm2-135m")
    m = meta_policy(cfg, name="smollm2-135m", quantize="none", adapter=adapter)
    assert m.resident["nf4_base"] == m.linear_params * 2                      # no bias in Llama projections
    rotary = 2 * (m.head_dim // 2) * 4                                        # inv_freq and its original, fp32
    assert m.resident["nf4_base"] + m.resident["dense_parts"] == m.params * 2 + rotary
    small = {**cfg, "num_hidden_layers": 2}                                   # a real (not meta) build, kept small
    mt = small.pop("model_type")
    torch.manual_seed(0)
    real = AutoModelForCausalLM.from_config(AutoConfig.for_model(mt, **small), dtype=torch.bfloat16)
    own = sum(t.numel() * t.element_size() for t in list(real.parameters()) + list(real.buffers()))
    adaptable_model(real)
    attach_adapters(real, adapter, r=32, alpha=64)
    rep = resident_bytes(real)["total"]
    m2 = meta_policy({**small, "model_type": mt}, quantize="none", adapter=adapter)
    assert rep["base"] + rep["other"] == own == m2.resident["nf4_base"] + m2.resident["dense_parts"]
    assert rep["adapter"] == m2.resident["adapter_masters"]
    p = make_plan(cfg, SHAPE.with_(quantize="none", adapter=adapter), gpu_spec("cpu"), name="smollm2-135m",
                  with_limits=False)
    for phase, parts in as_json(p)["memory"].items():
        assert all(v >= 0 for v in parts.values()) and sum(v for k, v in parts.items() if k != "total") == parts["total"]
    nf4 = make_plan(cfg, SHAPE.with_(adapter=adapter), gpu_spec("cpu"), name="smollm2-135m", with_limits=False)
    assert p.memory.phases["update"]["nf4_base"] > 3 * nf4.memory.phases["update"]["nf4_base"]


def test_a_bad_quantize_value_is_a_clear_error():
    from fasttrain.train.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=r"policy.quantize: 'int8' is not allowed; allowed values: 'nf4', 'none'"):
        load_config({"policy": {"quantize": "int8"}})
    with pytest.raises(ValueError, match=r"policy.quantize 'int8': allowed 'nf4', 'none'"):
        meta_policy(model_config("smollm2-135m"), quantize="int8")


def test_top_p_sort_is_counted_in_the_rollouts_memory_and_time():
    """top_p without top_k sorts each row: 25 bytes per logit beside the draw's buffer (the sorted float64
    row, its exps' running sum, one more exp temporary, the dropped-token mask; any other truncation 9: the
    mask and the largest dropped logit's float64 temporary), and each draw runs at the
    host's measured top_p rate instead of the plain one: exactly that many more seconds for the prefill's
    n·V and the decode's (T - 1)·B·V logits."""
    from dataclasses import replace

    from fasttrain.plan.host_speed import measured_step_time
    from fasttrain.plan.memory import _decode_step
    from fasttrain.plan.run_shape import run_shape
    from support.rates import fake_rates as _fake_rates

    m = meta_policy(model_config("qwen2.5-7b"), name="qwen2.5-7b")
    B, S, V = SHAPE.rows, SHAPE.seq, m.vocab
    plain, sorted_, cut = (_decode_step(m, Device(), B, S, False, sort, trunc)[0]
                           for sort, trunc in ((False, False), (True, True), (False, True)))
    assert sorted_ - plain == B * V * 25 and cut - plain == B * V * 9
    rates = _fake_rates(clock="given", sampling_sorted=1.5e7)
    t0, _ = measured_step_time(m, SHAPE, rates, "float32", True, False, measure_shapes=False)
    t1, _ = measured_step_time(m, SHAPE.with_(sort_draw=True), rates, "float32", True, False, measure_shapes=False)
    logits = SHAPE.prompts * V + (SHAPE.new_tokens - 1) * B * V
    assert t1["rollout"] - t0["rollout"] == pytest.approx(logits * (1 / 1.5e7 - 1 / 6e7), rel=1e-9)
    # the recipe's knobs set the shape: top_p alone sorts, with top_k it is a partial sort of k values
    from fasttrain.train.config import load_config
    assert run_shape(load_config("cispo", ["rollout.top_p=0.9"]), 100).sort_draw
    k = run_shape(load_config("cispo", ["rollout.top_p=0.9", "rollout.top_k=20"]), 100)
    assert not k.sort_draw and k.truncated_draw and not k.probe_truncated_draw
    assert replace(SHAPE).sort_draw is False
