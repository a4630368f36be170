"""fasttrain.integrations.trl against TRL's own head, both measured against a float64 head.

For each head ("trl" = unpatched TRL 1.16, "fasttrain" = patched, "float64" = unpatched TRL whose chunked
head is replaced by an exact float64 one, so the reference shares no code with the patch) we compute, on the same generated batch: the old-policy and reference log-probs (no grad), the policy's
entropies, TRL's loss and the trainable gradients. Tolerance, derived: fasttrain's error against float64 is at
most twice TRL's own error against float64, plus a floor of 8 fp32 ulps at the quantity's scale (two fp32
computations that only reassociate sums already differ by a few ulps; the floor matters only where TRL is exact
to the last bit).
"""
import math

import pytest
import torch

pytest.importorskip("trl")
import fasttrain.integrations.trl as fasttrain_trl  # noqa: E402
from support.logprob_reference import reference_logprob_float64  # noqa: E402
from peft import LoraConfig  # noqa: E402
from support.tiny_grpo import prompts_dataset, reward_even_words, tiny_llama, tiny_tokenizer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.trainer.utils import use_adapter  # noqa: E402

EPS32 = torch.finfo(torch.float32).eps


def make_trainer(tmp_path, *, loss_type="dapo", peft=True, **overrides) -> GRPOTrainer:
    settings = dict(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                    max_completion_length=8, max_steps=1, learning_rate=1e-3, logging_steps=1, report_to=[],
                    seed=0, save_strategy="no", disable_tqdm=True, loss_type=loss_type, beta=0.04,
                    num_iterations=2, top_entropy_quantile=0.2, temperature=0.7)
    settings.update(overrides)
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if peft else None
    model = tiny_llama()
    if not peft:  # TRL builds the separate reference model from a path
        model.save_pretrained(tmp_path / "tiny-llama")
        model = str(tmp_path / "tiny-llama")
    return GRPOTrainer(model=model, reward_funcs=reward_even_words, args=GRPOConfig(**settings),
                       train_dataset=prompts_dataset(), processing_class=tiny_tokenizer(), peft_config=peft_config)


def trainable(trainer) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}


def perturbed(params, scale, seed) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + scale * (p.detach().abs().mean() + 0.02) * torch.randn(p.shape, generator=g)
            for n, p in params.items()}


def load(params, values):
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(values[n])


def generated_batch(trainer) -> dict:
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps  # set by train()
    return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def logps_and_entropies(trainer, inputs, *, reference: bool):
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    keep = inputs["completion_ids"].size(1)
    with torch.no_grad():
        if reference and trainer.ref_model is not None:
            return trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, mask, keep)[:2]
        if reference:
            with use_adapter(trainer.accelerator.unwrap_model(trainer.model), adapter_name=None):
                return trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep)[:2]
        return trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep, compute_entropy=True)[:2]


def run_head(trainer, inputs, w_old, w_new) -> dict:
    """One num_iterations=2 update as TRL does it: old/ref log-probs at w_old, the loss and grads at w_new."""
    params = trainable(trainer)
    load(params, w_old)
    old, old_entropy = logps_and_entropies(trainer, inputs, reference=False)
    ref, _ = logps_and_entropies(trainer, inputs, reference=True)
    load(params, w_new)
    trainer.model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    loss = trainer.compute_loss(trainer.model, {**inputs, "old_per_token_logps": old, "ref_per_token_logps": ref})
    loss.backward()
    out = {"old": old, "ref": ref, "entropy": old_entropy, "loss": loss.detach(),
           "grads": torch.cat([p.grad.flatten() for p in params.values()])}
    out.update({f"metric/{k}": torch.tensor(v[-1]) for k, v in trainer._metrics["train"].items()})
    return out


class Float64Head:
    """Stands in for TRL's chunked head inside TRL's own (unpatched) plumbing: the reference shares nothing with
    the integration under test (shift, temperature, masking all stay TRL's), only the arithmetic is exact."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs):
        assert softcap is None and logit_scale == 1.0
        with torch.autocast(hidden.device.type, enabled=False):
            logp, entropy = reference_logprob_float64(hidden, weight, targets, temperature, bias=bias)
        return logp, entropy if "entropy" in outputs else None, None, None, None


def float64_head(monkeypatch):
    import trl.trainer.utils

    monkeypatch.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", Float64Head)


def three_heads(trainer, monkeypatch, w_old, w_new, inputs) -> dict[str, dict]:
    results = {}
    fasttrain_trl.unpatch(trainer)
    results["trl"] = run_head(trainer, inputs, w_old, w_new)
    with monkeypatch.context() as m:
        float64_head(m)
        results["float64"] = run_head(trainer, inputs, w_old, w_new)
    fasttrain_trl.patch(trainer)
    results["fasttrain"] = run_head(trainer, inputs, w_old, w_new)
    return results


def assert_no_worse_than_trl(results, key, mask=None):
    ref, trl_value, ft = (results[h][key].double() for h in ("float64", "trl", "fasttrain"))
    if mask is not None:
        ref, trl_value, ft = ref[mask], trl_value[mask], ft[mask]
    err_trl = (trl_value - ref).abs().max().item()
    err_ft = (ft - ref).abs().max().item()
    floor = 8 * EPS32 * max(ref.abs().max().item(), 1.0)
    assert err_ft <= 2 * err_trl + floor, f"{key}: fasttrain err {err_ft:.3g} vs TRL err {err_trl:.3g}"
    return err_ft, err_trl


@pytest.mark.parametrize("loss_type,bf16", [("dapo", True), ("cispo", True), ("grpo", True), ("dapo", False)])
def test_patched_step_matches_trl_with_peft_and_entropy_mask(tmp_path, monkeypatch, loss_type, bf16):
    # bf16=True is TRL's default (autocast on CPU too); bf16=False runs every head in fp32.
    trainer = make_trainer(tmp_path, loss_type=loss_type, bf16=bf16)
    inputs = generated_batch(trainer)
    params = trainable(trainer)
    w_old = perturbed(params, 0.5, seed=1)  # adapters away from zero: reference != policy, KL > 0
    w_new = {n: v + 0.3 * (v.abs().mean() + 0.02) * torch.randn(v.shape, generator=torch.Generator().manual_seed(2))
             for n, v in w_old.items()}  # one optimizer step's worth of change: ratios != 1
    results = three_heads(trainer, monkeypatch, w_old, w_new, inputs)
    scored = inputs["completion_mask"].bool()
    for key in ("old", "ref", "entropy"):
        assert_no_worse_than_trl(results, key, scored)
        for head in results.values():  # unscored (padding) positions are exactly zero in every head
            assert torch.all(head[key][~scored] == 0)
    # The update is not trivial: the reference differs, ratios moved, and only the top-20% entropy tokens count.
    assert results["float64"]["metric/kl"] > 1e-3
    assert not torch.allclose(results["float64"]["old"], results["float64"]["ref"], atol=1e-2)
    assert_no_worse_than_trl(results, "loss")
    assert results["float64"]["loss"].abs() > 1e-4
    assert_no_worse_than_trl(results, "grads")
    assert results["float64"]["grads"].abs().max() > 1e-3
    for key in ("entropy", "kl"):  # TRL's logged metrics (from the patched entropies and log-probs)
        assert_no_worse_than_trl(results, f"metric/{key}")


def test_one_trainer_train_step_with_and_without_patch(tmp_path, monkeypatch):
    # The literal A/B: trainer.train() for one optimizer step (generation, old-policy and reference passes,
    # loss, backward, AdamW), same seed, fresh trainer each time; TRL's logged numbers are compared.
    logs, completions = {}, {}
    for head in ("trl", "fasttrain", "float64"):
        trainer = make_trainer(tmp_path / head, loss_type="dapo")
        params = trainable(trainer)
        load(params, perturbed(params, 0.5, seed=1))  # adapters away from zero: KL > 0
        if head == "fasttrain":
            fasttrain_trl.patch(trainer)
        with monkeypatch.context() as m:
            if head == "float64":
                float64_head(m)
            trainer.train()
        logs[head] = {k: torch.tensor(v) for k, v in trainer.state.log_history[0].items()
                      if k in ("loss", "entropy", "kl", "reward", "num_tokens")}
        completions[head] = trainer._buffered_inputs[0]["completion_ids"]
    assert torch.equal(completions["trl"], completions["fasttrain"])  # generation is untouched
    assert logs["trl"]["reward"] == logs["fasttrain"]["reward"]
    assert logs["float64"]["kl"] > 1e-3
    for key in ("loss", "entropy", "kl"):
        assert_no_worse_than_trl(logs, key)


def test_full_finetune_patches_reference_model_and_lm_head_grad(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, loss_type="dapo", peft=False, top_entropy_quantile=1.0)
    assert trainer.ref_model is not None
    inputs = generated_batch(trainer)
    params = trainable(trainer)
    assert any("lm_head" in n for n in params)  # the op's weight gradient is exercised
    w_old = {n: p.detach().clone() for n, p in params.items()}
    w_new = perturbed(params, 0.05, seed=3)
    results = three_heads(trainer, monkeypatch, w_old, w_new, inputs)
    scored = inputs["completion_mask"].bool()
    for key in ("old", "ref", "entropy"):
        assert_no_worse_than_trl(results, key, scored)
    assert_no_worse_than_trl(results, "loss")
    assert_no_worse_than_trl(results, "grads")
    assert fasttrain_trl.is_patched(trainer)


def test_patched_head_never_builds_token_by_vocab_tensors(tmp_path):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.shapes.append(tuple(t.shape))
            return out

    trainer = make_trainer(tmp_path)
    inputs = generated_batch(trainer)
    vocab, hidden = trainer.model.get_output_embeddings().weight.shape
    weight_shapes = {(vocab, hidden), (hidden, vocab)}  # the lm_head weight itself (and dtype casts of it)

    def widest_vocab_tensor():
        with Shapes() as mode:
            logps_and_entropies(trainer, inputs, reference=False)
        return max((math.prod(s) for s in mode.shapes if vocab in s and s not in weight_shapes), default=0)

    assert widest_vocab_tensor() >= inputs["completion_ids"].numel() * vocab  # TRL's head: logits tiles
    fasttrain_trl.patch(trainer)
    assert widest_vocab_tensor() == 0


def test_entropy_bonus_keeps_trl_head_for_the_grad_pass(tmp_path):
    trainer = make_trainer(tmp_path, entropy_coef=0.01, top_entropy_quantile=1.0)
    inputs = generated_batch(trainer)
    losses = []
    for patched in (False, True):
        (fasttrain_trl.patch if patched else fasttrain_trl.unpatch)(trainer)
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()  # the entropy bonus reaches the graph
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])  # the grad pass ran TRL's own head, bit for bit


def test_patch_unpatch_roundtrip_and_bad_input(tmp_path):
    trainer = make_trainer(tmp_path, beta=0.0, num_iterations=1)
    base = trainer.model.get_base_model()
    trl_forward = base.forward
    assert fasttrain_trl.patch(trainer) is trainer and fasttrain_trl.is_patched(trainer)
    fasttrain_trl.patch(trainer)  # idempotent
    fasttrain_trl.unpatch(trainer)
    assert base.forward == trl_forward and not fasttrain_trl.is_patched(trainer)
    with pytest.raises(TypeError, match="trainer"):
        fasttrain_trl.patch(object())


def test_refuses_models_whose_logits_trl_rescales(tmp_path):
    trainer = make_trainer(tmp_path, beta=0.0, num_iterations=1)
    trainer.model.get_base_model().config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        fasttrain_trl.patch(trainer)


@pytest.mark.parametrize("version", ["1.15.2", "1.17.0", "1.17.0.dev0", "0.24.0", "2.0.0", "unknown"])
def test_unsupported_trl_versions_are_an_import_error(version):
    with pytest.raises(ImportError, match=r"trl>=1\.16\.0,<1\.17"):
        fasttrain_trl.check_trl_version(version)


@pytest.mark.parametrize("version", ["1.16.0", "1.16.3", "1.16.1.dev0"])
def test_supported_trl_versions_pass(version):
    fasttrain_trl.check_trl_version(version)


@pytest.mark.parametrize("knobs,warns", [({}, False), ({"top_p": 0.8}, True), ({"top_k": 20}, True)])
def test_patch_warns_when_trl_truncates_but_scores_the_whole_vocabulary(tmp_path, knobs, warns):
    import warnings
    trainer = make_trainer(tmp_path, beta=0.0, num_iterations=1, **knobs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fasttrain_trl.patch(trainer)
    hit = [w for w in caught if "whole vocabulary" in str(w.message)]
    assert bool(hit) == warns, [str(w.message) for w in caught]
