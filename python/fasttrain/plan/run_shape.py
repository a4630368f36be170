"""The settings of a run that decide its memory and time, read from a resolved recipe.

The plan reads a recipe by attribute (cfg.rollout.group_size, ...), so it never imports the
trainer's config module; any object with the same sections works.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["RunShape", "run_shape"]


@dataclass(frozen=True)
class RunShape:
    prompts: int                 # distinct prompts per step (n)
    group: int                   # answers per prompt (G)
    prompt_tokens: int           # P: the longest prompt, chat template included
    new_tokens: int              # T: max_new_tokens (the plan assumes every answer runs to it)
    micro_batch: int
    passes: int = 1
    gradient_checkpointing: bool = True
    # policy.gradient_checkpointing = "auto": the shape starts off and the plan turns it on unless
    # the update fits without it at the recipe's own micro-batch (fasttrain.plan.picks)
    checkpointing_auto: bool = False
    need_ref: bool = True        # beta > 0: a no-grad forward with adapters off
    need_old: bool = False       # top-entropy mask: a no-grad forward before the update
    dtype: str = "bfloat16"
    quantize: str = "nf4"        # policy.quantize: "nf4" | "none" (the model's 16-bit weights)
    adapter: str = "lora"
    rank: int = 32
    alpha: float = 64.0
    targets: tuple = ()
    steps: int = 600
    probe_prompts: int = 50
    probe_samples: int = 1
    probe_new_tokens: int = 128
    probe_every: int = 100
    rollout_weights: str = "auto"   # rollout.base_weights: "auto" | "nf4" | "dequantized"
    # Rollout waves: prompts whose G answers decode at once (the others wait for the next wave),
    # and prompts per prefill chunk within a wave; the same for the probe. 0: the plan picks
    # (fasttrain.plan.picks); a positive value is the recipe's own and is kept.
    wave: int = 0
    prefill_chunk: int = 0
    probe_wave: int = 0
    probe_prefill_chunk: int = 0
    # rollout.top_p < 1 with no top_k: the draw sorts each row's logits (fasttrain.rollout.sampling
    # kept_cut), in time and memory; any truncation: the dropped-token mask and the largest dropped
    # logit's float64 temporary (top_k's partial sort of k values is small)
    sort_draw: bool = False
    probe_sort_draw: bool = False
    truncated_draw: bool = False
    probe_truncated_draw: bool = False

    @property
    def rows(self) -> int:
        return self.prompts * self.group

    @property
    def seq(self) -> int:
        return self.prompt_tokens + self.new_tokens

    @property
    def wave_prompts(self) -> int:
        """Prompts decoded at once in the rollout (all of them when no wave size is set)."""
        return min(self.wave or self.prompts, self.prompts)

    @property
    def prefill_prompts(self) -> int:
        """Prompts per prefill chunk of the rollout (a whole wave when not set)."""
        return min(self.prefill_chunk or self.wave_prompts, self.wave_prompts)

    @property
    def probe_wave_prompts(self) -> int:
        return min(self.probe_wave or self.probe_prompts, self.probe_prompts)

    @property
    def probe_prefill_prompts(self) -> int:
        return min(self.probe_prefill_chunk or self.probe_wave_prompts, self.probe_wave_prompts)

    def with_(self, **kw) -> "RunShape":
        return replace(self, **kw)


def run_shape(cfg, prompt_tokens: int) -> RunShape:
    """The RunShape of a resolved recipe `cfg` with prompts of `prompt_tokens` tokens."""
    if not isinstance(prompt_tokens, int) or prompt_tokens < 1:
        raise ValueError(f"prompt tokens must be a positive integer, got {prompt_tokens!r}")
    r, lo, p = cfg.rollout, cfg.loss, cfg.policy
    return RunShape(
        prompts=r.prompts_per_step, group=r.group_size, prompt_tokens=prompt_tokens,
        new_tokens=r.max_new_tokens, micro_batch=cfg.optim.micro_batch, passes=lo.passes,
        # "auto" starts off: the plan's picks turn it on when the update does not fit without it
        gradient_checkpointing=p.gradient_checkpointing is True,
        checkpointing_auto=p.gradient_checkpointing == "auto", need_ref=lo.beta > 0,
        need_old=lo.token_mask == "top_entropy", dtype=p.dtype, quantize=getattr(p, "quantize", "nf4"),
        adapter=p.adapter, rank=p.rank,
        alpha=p.alpha, targets=tuple(p.targets), steps=cfg.run.steps, probe_prompts=cfg.probe.prompts,
        probe_samples=cfg.probe.samples, probe_new_tokens=cfg.probe.max_new_tokens or r.max_new_tokens,
        probe_every=cfg.probe.every, rollout_weights=getattr(r, "base_weights", "auto"),
        wave=getattr(r, "wave_prompts", 0), prefill_chunk=getattr(r, "prefill_prompts", 0),
        probe_wave=getattr(cfg.probe, "wave_prompts", 0), probe_prefill_chunk=getattr(cfg.probe, "prefill_prompts", 0),
        sort_draw=_sorts(r), probe_sort_draw=_sorts(cfg.probe), truncated_draw=_truncates(r),
        probe_truncated_draw=_truncates(cfg.probe))


def _sorts(section) -> bool:
    return getattr(section, "top_p", 1.0) < 1.0 and getattr(section, "top_k", 0) == 0


def _truncates(section) -> bool:
    return getattr(section, "top_p", 1.0) < 1.0 or getattr(section, "top_k", 0) > 0 or getattr(section, "min_p", 0.0) > 0
