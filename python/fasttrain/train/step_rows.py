"""The two rows a training step writes (docs/design.md, "The run folder"): its row of
metrics.jsonl, with the update's statistics it reads, and its record of samples.jsonl. The values
that span the batch are taken over every rank (through fasttrain.train.distributed, the identity in
one process): each rank calls these in the same order.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from fasttrain.train import distributed

__all__ = ["metrics_row", "samples_row", "update_stats", "logprob_gap", "tool_metrics", "env_counters"]


def env_counters(env) -> dict[str, int]:
    """The environment's run totals (a plug-in's `counters()`), or nothing."""
    f = getattr(env, "counters", None)
    return {k: int(v) for k, v in f().items()} if callable(f) else {}


def logprob_gap(roll, result, mask) -> dict[str, float]:
    """rollout_logprob_gap (mean) and rollout_logprob_gap_max: |Δ log p| of the sampled tokens
    between the rollout's decode and the update's forward on the pre-update policy, every rank's tokens."""
    from fasttrain.rl.logprob_gap import logprob_gap_parts
    have = result is not None and result.old_logp is not None
    total, top, n = logprob_gap_parts(roll.logprobs, result.old_logp, mask) if have else (0.0, 0.0, 0)
    total, n = distributed.sum_values([total, float(n)])        # every rank joins the collectives
    top = max(distributed.gather_list([top]))
    if n == 0:
        return {"rollout_logprob_gap": math.nan, "rollout_logprob_gap_max": math.nan}
    return {"rollout_logprob_gap": total / n, "rollout_logprob_gap_max": top}


def update_stats(roll, batch, result, mask, loss_mask) -> tuple[dict[str, float], int, int, float, float]:
    """(the log-prob gap, answer tokens, loss tokens, mean entropy, KL to the base) of an update,
    over every rank's tokens. The entropy is the pre-update policy's (scored before the update, or
    by its first pass); the KL is the loss op's own k3 estimate in pass 1 (the pre-update policy;
    r = 1 there up to two forwards' rounding, so "k3_ratio"'s r * k3 is k3), the value the loss
    used, and 0 without a reference (beta = 0)."""
    from fasttrain.rl.masks import token_stats
    gap = logprob_gap(roll, result, mask)
    n_tok, n_loss, ent_sum = distributed.sum_values(token_stats(result.entropy, mask, loss_mask))
    n_tok, n_loss = int(n_tok), int(n_loss)
    passes = result.passes
    kl = passes[0].get("kl_mean", math.nan) if passes else math.nan
    if batch.ref_logp is None:
        kl = 0.0
    return gap, n_tok, n_loss, ent_sum / max(1, n_tok), kl


def tool_metrics(roll, answers: int) -> dict[str, float]:
    """Per step, over every rank: tool calls, the calls that ended in an error message (or
    could not be read), and model turns per answer; nothing for single-turn answers."""
    if roll.tool_stats is None:
        return {}
    st = roll.tool_stats
    calls, errors, turns, dropped = distributed.sum_values(
        [float(st["tool_calls"]), float(st["tool_errors"]), float(st["turns"]), float(st["tool_results_dropped"])])
    return {"tool_calls": int(calls), "tool_errors": int(errors), "turns": turns / max(1, answers),
            "tool_results_dropped": int(dropped)}


def metrics_row(step: int, env, channel_names, scores, roll, *, passes: list[dict[str, float]], kl: float,
                entropy: float, adv_info: dict[str, float], zeta: float, zeta_next: float, gap: dict[str, float],
                tokens: int, loss_tokens: int, answers: int, skipped: bool, lr: float, oom_retries: int,
                sizes: dict[str, int | None], prompts: int, times: dict[str, float]) -> dict[str, Any]:
    """The row of step `step`: the rewards of `scores` (every answer of the step, every rank's),
    the update's last pass (`passes`, one dict per pass), the KL and entropy of the pre-update
    policy, the advantages' shares (`adv_info`), REPO-R's ζ used and next, token counts
    (`answers`: the answers trained on, for the mean length), the phases' sizes after any
    out-of-memory halving, and each phase's seconds (`times`) with their sum."""
    ch_mean = {f"reward_{c}": float(np.mean([s.channels[c] for s in scores])) for c in channel_names}
    last = passes[-1] if passes else {}
    row: dict[str, Any] = {
        "step": step,
        "reward": float(np.mean([s.total(env.channels) for s in scores])),
        **ch_mean,
        "core": float(np.mean([s.core for s in scores])),
        "success": float(np.mean([s.success for s in scores])),
        "valid": float(np.mean([s.valid for s in scores])),
        "cost": ch_mean.get("reward_action_cost", math.nan),
        "kl": kl, "entropy": entropy, **adv_info,
        "zeta": zeta, "zeta_next": zeta_next,
        "loss": last.get("loss", math.nan), "grad_norm": last.get("grad_norm", math.nan),
        "pass_losses": [p["loss"] for p in passes],
        "ratio_mean": last.get("ratio_mean", math.nan),
        "clip_low_frac": last.get("clip_low_frac", math.nan),
        "clip_high_frac": last.get("clip_high_frac", math.nan),
        "cap_frac": last.get("cap_frac", math.nan),
        "repo_r_factor_mean": last.get("repo_r_factor_mean", math.nan),
        **gap,
        **{k: v for k, v in (passes[0] if passes else {}).items() if k.startswith("moe_")},   # MoE routing
        "tokens": tokens, "loss_tokens": loss_tokens,
        "mean_length": tokens / answers, "skipped": skipped,
        "lr": lr,
        # out-of-memory retries of this step, and the sizes the phases now run with
        "oom_retries": oom_retries, "rollout_chunk_prompts": sizes["rollout"] or prompts,
        "scores_micro_batch": sizes["scores"], "update_micro_batch": sizes["update"],
        # a plug-in's batch verifier that raised or returned the wrong length (run total)
        "verifier_batch_failures": 0,
        **env_counters(env),                        # the environment's run totals
        **tool_metrics(roll, len(scores)),
        **{f"seconds_{k}": v for k, v in times.items()},
    }
    row["seconds_step"] = sum(times.values())
    row["seconds_collectives"] = distributed.collective_seconds()   # part of the above; 0 in one process
    return row


def samples_row(step: int, prompts, texts: list[str], scores, channel_names, turns: list | None,
                kept: list | None) -> dict[str, Any]:
    """The step's record of samples.jsonl: its prompts, every answer with its core, validity,
    channel rewards and reason; each answer's turns (multi-turn answers) and, under dynamic
    sampling, which groups were trained on."""
    samples = {"step": step, "prompt_ids": [p.id for p in prompts], "answers": texts,
               "core": [s.core for s in scores], "valid": [s.valid for s in scores],
               "rewards": {c: [s.channels[c] for s in scores] for c in channel_names},
               "reasons": [s.reason for s in scores]}
    if turns is not None:
        samples["conversations"] = turns               # each answer's turns (assistant, tool, ...)
    if kept is not None:
        samples["kept"] = kept                         # per group: trained on (dynamic sampling)
    return samples
