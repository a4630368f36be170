"""fasttrain's fused log-prob head inside TRL's GRPOTrainer: one line, the same numbers, fewer bytes.

    from trl import GRPOConfig, GRPOTrainer
    import fasttrain.integrations.trl as fasttrain_trl

    trainer = fasttrain_trl.patch(GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), ...))
    trainer.train()

(or `fasttrain_trl.FusedGRPOTrainer(...)`, a GRPOTrainer that patches itself.) Supported: TRL 1.16.x,
checked when this module is imported; any other version raises ImportError instead of risking a silently
wrong result, because the patch hooks into TRL internals that change between minor releases.

What it does. TRL 1.16 scores completions through `model(..., labels=labels, fused_lm_head=True)`, a
forward that `trl.trainer.utils.add_fused_lm_head` installs on the policy (the base model under PEFT) and
on the reference model. `patch` replaces that fused forward, on the same models, by one that runs the
backbone, keeps only the positions whose next-token label is scored (the completion tokens, never the
prompt), and computes each token's log-prob and entropy with `fasttrain.ops.fused_logprob` from the last
hidden states and the lm_head weight, at the trainer's temperature, without a `[tokens, vocab]` logits
tensor. Every caller goes through it: the policy (with gradient), the old policy (`num_iterations > 1`),
and the reference (`beta > 0`: a separate model, or the policy with its PEFT adapters disabled). TRL's
loss code is untouched, so every loss type, `top_entropy_quantile`, the entropy and KL metrics, gradient
accumulation and PEFT keep working exactly as before.

What it is not. fasttrain's entropy carries no gradient, so when TRL's entropy bonus is on
(`entropy_coef != 0` or adaptive entropy), the policy forward *with gradient* keeps TRL's own head (the
old-policy and reference passes still use fasttrain's); MoE models asking for the router loss and FSDP2
(DTensor) lm_heads also keep TRL's head. Models whose logits TRL rescales or softcaps
(`final_logit_softcapping`, `logit_scale`, `logits_scaling`, ...) and LoRA on the lm_head itself are
refused by `patch`, with the reason. Generation (`fused_lm_head=False`) is never touched. With
TRL's own `top_p < 1` or `top_k > 0`, `patch` warns: TRL samples from the truncated distribution but
scores (and trains on) the whole vocabulary, and this patch keeps TRL's scoring as it is (fasttrain's
own trainer records each token's kept set and scores on it: `rollout.top_p`, docs/design.md).
"""
from __future__ import annotations

import functools
import types
import warnings

import torch
from torch.distributed.tensor import DTensor

try:
    import trl
except ImportError as exc:  # trl is an optional extra, not a core dependency
    raise ImportError(
        "fasttrain.integrations.trl needs TRL 1.16.x: pip install 'fasttrain[trl]'"
    ) from exc

from fasttrain.ops import fused_logprob

SUPPORTED_TRL = ">=1.16.0,<1.17"

__all__ = ["SUPPORTED_TRL", "check_trl_version", "patch", "unpatch", "is_patched", "FusedGRPOTrainer"]


def check_trl_version(version: str) -> None:
    """Raise ImportError unless `version` is a TRL release this integration was written and tested for."""
    from packaging.version import InvalidVersion, Version

    try:
        parsed = Version(version)
    except InvalidVersion:
        raise ImportError(
            f"fasttrain.integrations.trl supports trl{SUPPORTED_TRL}; cannot read the installed version {version!r}"
        ) from None
    if parsed.release[:2] != (1, 16):
        raise ImportError(
            f"fasttrain.integrations.trl supports trl{SUPPORTED_TRL}, found trl {version}: it patches TRL's fused "
            "LM head (add_fused_lm_head), whose internals differ in other versions. Install a supported TRL "
            "or train without the patch."
        )


check_trl_version(trl.__version__)

from trl import GRPOTrainer  # noqa: E402
from trl.trainer.utils import FusedCausalLMOutput  # noqa: E402

# Config fields with which TRL rescales or softcaps the logits before the softmax; the fused op does neither.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                     "logits_scaling")


def patch(trainer: GRPOTrainer) -> GRPOTrainer:
    """Make `trainer` score tokens with `fasttrain.ops.fused_logprob`; returns the same trainer.

    Patches the policy (its base model when it is a PEFT model) and `trainer.ref_model` when there is one.
    Calling it twice is harmless; `unpatch` restores TRL's head.
    """
    if not isinstance(trainer, GRPOTrainer):
        raise TypeError(f"patch(trainer): expected a trl.GRPOTrainer, got {type(trainer).__name__}")
    for model, entropy_needs_grad in _scored_models(trainer):
        _install(model, temperature=float(trainer.temperature), entropy_needs_grad=entropy_needs_grad)
    _warn_truncation(trainer)
    return trainer


def _warn_truncation(trainer) -> None:
    args = getattr(trainer, "args", None)
    top_p = getattr(trainer, "top_p", getattr(args, "top_p", 1.0))
    top_k = getattr(trainer, "top_k", getattr(args, "top_k", 0))
    if (top_p is not None and top_p < 1.0) or (top_k is not None and top_k > 0):
        warnings.warn(f"TRL samples with top_p={top_p}, top_k={top_k} but scores every token on the whole "
                      "vocabulary: the importance ratio then measures the kept probability mass, not the policy's "
                      "change, and the gradient, entropy and KL are those of another distribution than the one "
                      "sampled from. fasttrain's own trainer (rollout.top_p / top_k / min_p) records each token's "
                      "kept set and trains on it.", UserWarning, stacklevel=3)


def unpatch(trainer: GRPOTrainer) -> GRPOTrainer:
    """Give `trainer` back TRL's own fused LM head."""
    for model, _ in _scored_models(trainer):
        original = model.__dict__.pop("_fasttrain_trl_forward", None)
        if original is not None:
            model.forward = original
    return trainer


def is_patched(trainer: GRPOTrainer) -> bool:
    return all("_fasttrain_trl_forward" in m.__dict__ for m, _ in _scored_models(trainer))


class FusedGRPOTrainer(GRPOTrainer):
    """A `trl.GRPOTrainer` that scores tokens with `fasttrain.ops.fused_logprob` (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        patch(self)


def _scored_models(trainer: GRPOTrainer) -> list[tuple[torch.nn.Module, bool]]:
    # The models TRL gave a fused head to, as it did in GRPOTrainer.__init__: the policy's base model under PEFT
    # (PeftModel.forward reaches it), and the separate reference model. Only the policy's entropy can need grad.
    policy = trainer.accelerator.unwrap_model(trainer.model)
    if hasattr(policy, "get_base_model"):
        policy = policy.get_base_model()
    models = [(policy, bool(trainer._entropy_bonus_enabled))]
    if trainer.ref_model is not None:
        models.append((trainer.accelerator.unwrap_model(trainer.ref_model), False))
    return models


def _install(model: torch.nn.Module, *, temperature: float, entropy_needs_grad: bool) -> None:
    if "_fasttrain_trl_forward" in model.__dict__:
        return
    trl_forward = model.__dict__.get("forward")
    if not _reaches_trl_fused_forward(trl_forward):
        raise RuntimeError(
            f"patch: {type(model).__name__} carries no TRL fused LM head (trl.trainer.utils.add_fused_lm_head); "
            "this integration expects GRPOTrainer from trl 1.16 to have installed one"
        )
    text_config = model.config.get_text_config()
    for name in _LOGIT_TRANSFORMS:
        if getattr(text_config, name, None) not in (None, 1, 1.0):
            raise ValueError(
                f"patch: {type(model).__name__} has {name}={getattr(text_config, name)!r}; fasttrain's fused "
                "log-prob scores plain `hidden @ lm_head.T / temperature` logits, so this model must stay on "
                "TRL's head (don't patch this trainer)"
            )
    lm_head = model.get_output_embeddings()
    if not isinstance(lm_head, torch.nn.Linear) or hasattr(lm_head, "base_layer"):
        raise ValueError(
            f"patch: the output embedding of {type(model).__name__} is {type(lm_head).__name__}, not a plain "
            "nn.Linear (an adapter on lm_head?); fasttrain's fused log-prob reads lm_head.weight directly"
        )
    if temperature <= 0:
        raise ValueError(f"patch: trainer.temperature must be > 0, got {temperature}")
    wants_router_loss = bool(getattr(text_config, "output_router_logits", False))

    @functools.wraps(type(model).forward)  # `generate` checks its kwargs against forward's signature
    def fasttrain_fused_forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None,
                                num_items_in_batch=None, **kwargs):
        keep_trl_head = (
            not fused_lm_head
            or (entropy_needs_grad and torch.is_grad_enabled())  # entropy bonus needs d(entropy)
            or wants_router_loss or kwargs.get("output_router_logits")
            or isinstance(self.get_output_embeddings().weight, DTensor)
        )
        if keep_trl_head:
            return trl_forward(*args, fused_lm_head=fused_lm_head, labels=labels, shift_labels=shift_labels,
                               num_items_in_batch=num_items_in_batch, **kwargs)
        # Replacing `model.forward` also sets aside accelerate's mixed-precision wrapper (when it wrapped TRL's
        # head) for these calls only; TRL makes every fused call inside `accelerator.autocast()`, the same autocast.
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state  # [B, L, H]
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]  # position t predicts token t + 1
        else:
            labels = shift_labels  # already shifted (context parallelism)
        log_probs, entropy, scored = score_tokens(
            hidden, labels, self.get_output_embeddings(), temperature=temperature)
        denominator = scored.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedCausalLMOutput(loss=-log_probs.sum() / denominator, log_probs=log_probs, entropy=entropy,
                                   label_mask=scored)

    model.forward = types.MethodType(fasttrain_fused_forward, model)
    model.__dict__["_fasttrain_trl_forward"] = trl_forward


def _reaches_trl_fused_forward(forward) -> bool:
    # TRL installs `_fused_forward` as the instance's forward; accelerate may wrap it (mixed precision:
    # autocast + fp32 outputs). Walk the wrappers; functools.wraps hides the name but not the code object.
    for _ in range(8):
        if forward is None:
            return False
        code = getattr(forward, "__code__", None)
        if code is not None and code.co_name == "_fused_forward" and code.co_filename.endswith(
                ("trl/trainer/utils.py", "trl\\trainer\\utils.py")):
            return True
        forward = (getattr(forward, "__func__", None) or getattr(forward, "__wrapped__", None)
                   or getattr(forward, "model_forward", None))
    return False


def score_tokens(hidden: torch.Tensor, labels: torch.Tensor, lm_head: torch.nn.Linear, *,
                 temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-prob and entropy of each labelled position; zero where the label is -100.

    hidden: [B, T, H] (already aligned with labels), labels: [B, T] int64 -> (log_probs [B, T] fp32,
    entropy [B, T] fp32 detached, scored [B, T] bool). Only the scored positions reach the op.
    """
    weight, bias = lm_head.weight, lm_head.bias
    hidden, labels = hidden.to(weight.device), labels.to(weight.device)
    scored = labels != -100  # [B, T]
    # The op takes one dtype and is not an autocast op. It runs in the lm_head weight's own dtype: under
    # autocast with fp32 weights (TRL's CPU default, bf16=True) the hidden states are widened ([N, H], small)
    # rather than the weight narrowed (a [V, H] copy per call: 175 MB at V=151,936, H=576), and a bf16 model
    # runs in bf16. cast_lm_head_to_fp32 has already made the weight fp32, so it needs nothing more here.
    with torch.autocast(hidden.device.type, enabled=False):
        rows = hidden[scored].to(weight.dtype)  # [N, H], N = scored tokens
        targets = labels[scored]
        if rows.shape[0] == 0:  # nothing to score: a zero that stays connected to the graph
            logp = rows.sum(-1).float()
            ent = logp.detach()
        else:
            logp, ent = fused_logprob(rows, weight, targets, temperature=temperature, bias=bias)
    log_probs = logp.new_zeros(scored.shape).masked_scatter(scored, logp)
    entropy = ent.new_zeros(scored.shape).masked_scatter(scored, ent)
    return log_probs, entropy, scored
