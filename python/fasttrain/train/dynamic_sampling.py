"""DAPO's dynamic sampling (Yu et al. 2025, "DAPO", §3.2; verl's `filter_groups`): a step trains only
on prompt groups with signal, sampling more prompts until it has `rollout.prompts_per_step` of them.

A group has no signal ("dead") when every answer's group-normalised advantage (GDPO's per-group,
per-channel z-scores weighted by the priorities, without the batch standardisation) is zero after
the floor guard's projection (|a| <= 1e-9: z-scores are O(1), their rounding is ~1e-15). That is
decided per group, before any batch statistic; GDPO's batch standardisation then runs over the
kept live groups alone, so neither the scale nor the mean depends on which dead groups were seen.

One step:

    round 0      the step's P prompts (as without dynamic sampling), each rank its block of P/W
    round r >= 1 while some rank has fewer than P/W live groups and r <= rollout.dynamic_max_rounds:
                 m = the largest deficit of any rank; W*m new prompts, rank k's block its m
    keep         each rank its first K live groups in the order drawn, K = the largest
                 min(live groups, P/W) of any rank; a rank with fewer live groups fills up with
                 its earliest dead groups (zero advantage: they add nothing to the policy gradient
                 but keep every rank's batch the same number of groups, so the gradient stays one
                 batch's). When no rank has a live group, the step keeps round 0's groups (all of
                 zero advantage) and says so (dynamic_cap_reached).

Prompts come from one stream (the run seed's permutation of the train rows, epoch after epoch),
read from a cursor kept in checkpoints: a prompt already drawn in this step is passed over
(never two groups of one prompt in a step; past the end of the list the next epoch's order
follows), and a step draws at most as many prompts as the list has. Round r's answers are seeded
by (run.seed, step, r, place in the round), so a resumed run samples what the uninterrupted one
did. Each round is scored before the next is sampled (a tool environment's slots are reused).

Logged per step: dynamic_rounds (extra rounds run), dynamic_groups (groups generated),
dynamic_groups_kept, dynamic_groups_dropped, dynamic_dead_groups, dynamic_extra_answers (answers
beyond the P x G of round 0), seconds_share_dropped (rollout seconds of every rank spent on groups
not kept, over all rollout seconds, each round's seconds split evenly over its groups; a timing,
so named like the other seconds_ keys),
dynamic_cap_reached, and nonzero_adv_share_before (over every answer generated, from the
per-group advantages; the low-signal alarm reads it) beside nonzero_adv_share (the batch trained on).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Sequence

import numpy as np
import torch

from fasttrain.rl import floor_guard, gdpo_advantages, guarded_answers

__all__ = ["LIVE_TOL", "draw_prompts", "dynamic_advantages", "dynamic_step", "group_advantages", "kept_advantages",
           "live_groups", "select_groups"]

LIVE_TOL = 1e-9


def group_advantages(scores, channel_names: Sequence[str], weights: torch.Tensor, group_size: int,
                     a_cfg) -> torch.Tensor:
    """Per answer, float64: GDPO's group-standardised, weighted advantage without the batch
    standardisation, after the floor guard as configured ("legacy_clamp" as the trainer applies it)."""
    G = group_size
    rewards = torch.tensor([[s.channels[c] for c in channel_names] for s in scores], dtype=torch.float64)
    core = torch.tensor([s.core for s in scores], dtype=torch.float64)
    valid = torch.tensor([s.valid for s in scores])
    adv = gdpo_advantages(rewards, G, weights, batch_normalize=False).double()
    if a_cfg.guard == "projection":
        adv = floor_guard(adv, guarded_answers(core, valid, a_cfg.floor, a_cfg.guard_invalid), G)
    elif a_cfg.guard == "legacy_clamp":
        adv = torch.where((adv > 0) & (core <= 0), torch.zeros_like(adv), adv)
    return adv


def live_groups(scores, channel_names: Sequence[str], weights: torch.Tensor, group_size: int, a_cfg) -> list[bool]:
    """Per group: whether some answer keeps a non-zero advantage (|a| > LIVE_TOL) after the group
    standardisation and the floor guard."""
    adv = group_advantages(scores, channel_names, weights, group_size, a_cfg)
    return (adv.reshape(-1, group_size).abs() > LIVE_TOL).any(dim=1).tolist()


def kept_advantages(tr, kept_scores, live: Sequence[bool]) -> tuple[torch.Tensor, dict[str, float]]:
    """The trainer's advantages (GDPO with its batch standardisation, then the guard) over the
    kept live groups alone; the dead groups kept to even the ranks get exactly zero."""
    G = tr.cfg.rollout.group_size
    rows = [b for g, ok in enumerate(live) if ok for b in range(g * G, (g + 1) * G)]
    adv = torch.zeros(len(kept_scores), dtype=torch.float32)
    if rows:
        a, info = tr.batch_advantages([kept_scores[b] for b in rows])
        adv[torch.tensor(rows)] = a
    else:
        _, info = tr.batch_advantages(kept_scores)
    info = {**info, "nonzero_adv_share": float((adv.abs() > 1e-6).double().mean()),
            "adv_abs_mean": float(adv.abs().double().mean())}
    return adv, info


def dynamic_advantages(tr, dyn: dict[str, Any], step: int) -> tuple[torch.Tensor, dict[str, float]]:
    """This rank's advantages of the step `dyn` (dynamic_step's result) on Trainer `tr`'s device,
    and the step's advantage metrics with the dynamic-sampling ones; a warning when the extra
    rounds ran out before every rank had its live groups."""
    from fasttrain.train import distributed
    R = tr.cfg.rollout
    adv, info = kept_advantages(tr, dyn["kept_scores"], dyn["live"])
    k = dyn["groups_per_rank"] * R.group_size
    adv = adv[distributed.rank() * k:(distributed.rank() + 1) * k].to(tr.device)
    info.update(dyn["info"])
    if info["dynamic_cap_reached"]:
        tr.warn(step, f"dynamic sampling: {info['dynamic_rounds']} extra round(s) (rollout.dynamic_max_rounds = "
                       f"{R.dynamic_max_rounds}) left step {step} with {sum(dyn['live'])} live group(s) of "
                       f"{R.prompts_per_step}; it trains on those")
    return adv, info


def draw_prompts(train_prompts, seed: int, cursor: int, n: int, used: set[str]) -> tuple[list, int]:
    """Up to n prompts from the stream at `cursor` that are not in `used` (ids), and the new cursor.
    Stops early when every prompt of the list is in `used`."""
    N = len(train_prompts)
    out = []
    orders: dict[int, np.ndarray] = {}
    while len(out) < n and len(used) < N:
        epoch, j = divmod(cursor, N)
        if epoch not in orders:
            orders[epoch] = np.random.default_rng([seed, epoch]).permutation(N)
        p = train_prompts[orders[epoch][j]]
        cursor += 1
        if p.id in used:
            continue
        used.add(p.id)
        out.append(p)
    return out, cursor


def select_groups(roll, groups: Sequence[int]):
    """The rollout's rows of these groups (in this order), prompt_index renumbered."""
    from fasttrain.rollout import Rollout
    G = roll.group_size
    rows = torch.tensor([g * G + j for g in groups for j in range(G)], dtype=torch.long)
    take = lambda t: t.index_select(0, rows.to(t.device))          # noqa: E731
    return Rollout(input_ids=take(roll.input_ids), attention_mask=take(roll.attention_mask),
                   position_ids=take(roll.position_ids), prompt_len=roll.prompt_len,
                   completion_ids=take(roll.completion_ids), completion_mask=take(roll.completion_mask),
                   action_mask=take(roll.action_mask), lengths=take(roll.lengths),
                   prompt_index=torch.arange(len(groups), device=roll.prompt_index.device).repeat_interleave(G),
                   logprobs=take(roll.logprobs), finished=take(roll.finished), group_size=G,
                   conversations=None if roll.conversations is None else [roll.conversations[i] for i in rows.tolist()],
                   tool_stats=roll.tool_stats,
                   routing=None if roll.routing is None else take(roll.routing),
                   keep_delta=None if roll.keep_delta is None else take(roll.keep_delta))


def dynamic_step(tr, step: int) -> dict[str, Any]:
    """Sample, score and select one step's groups for Trainer `tr` (see the module doc). Returns
    roll (this rank's kept groups), kept_scores (every rank's kept answers, rank order),
    live (per kept group), and for the log: prompts, texts, scores, turns (every answer generated,
    round after round, one-process order), kept (per generated group), info (the metrics)."""
    from fasttrain.train import distributed
    from fasttrain.train.answers import answer_token_ids, join_rollouts
    cfg, R = tr.cfg, tr.cfg.rollout
    G, W, rank = R.group_size, distributed.world_size(), distributed.rank()
    per_rank = R.prompts_per_step // W
    used: set[str] = set()
    rounds = []          # per round: prompts, roll (this rank's), texts, scores, turns, live, m, seconds
    cursor = tr.prompt_cursor
    m = per_rank
    live_count = [0] * W
    for r in range(R.dynamic_max_rounds + 1):
        prompts, cursor = draw_prompts(tr.train_prompts, cfg.run.seed, cursor, m * W, used)
        m = len(prompts) // W
        if m == 0:
            break
        prompts = prompts[:m * W]
        lo, hi = rank * m, (rank + 1) * m
        key = [cfg.run.seed, step] if r == 0 else [cfg.run.seed, step, r]
        t = time.perf_counter()
        # a stop signal in round 0's rollout drops the step (nothing of it is recorded yet; one
        # process); later rounds come after scoring, which may change state: the step finishes
        stop = tr.stop_signals.abortable(W == 1) if (tr.stop_signals is not None and r == 0) else contextlib.nullcontext()
        with stop:
            roll, texts = tr.with_oom_retry(step, "rollout", lambda n: tr.sample_step(step, prompts, lo, hi, n, key=key))
        seconds = time.perf_counter() - t
        tr.mid_step = True
        scores, texts, turns = tr.score_answers(prompts, lo, hi, texts, answer_token_ids(roll), roll.conversations)
        live = live_groups(scores, tr.channel_names, tr.weights, G, cfg.advantages)
        rounds.append({"prompts": prompts, "roll": roll, "texts": texts, "scores": scores, "turns": turns,
                       "live": live, "m": m, "seconds": seconds})
        for k in range(W):
            live_count[k] += sum(live[k * m:(k + 1) * m])
        deficit = max(per_rank - c for c in live_count)
        if deficit <= 0:
            break
        m = deficit
    extra_rounds = len(rounds) - 1
    rollout_seconds = sum(rd["seconds"] for rd in rounds)
    K = max(min(c, per_rank) for c in live_count)
    # every rank's choice, computed alike on each: (round, group within the round) per kept group
    chosen: list[list[tuple[int, int]]] = []
    for k in range(W):
        mine_live = [(i, k * rd["m"] + g) for i, rd in enumerate(rounds) for g in range(rd["m"])
                     if rd["live"][k * rd["m"] + g]]
        mine_dead = [(i, k * rd["m"] + g) for i, rd in enumerate(rounds) for g in range(rd["m"])
                     if not rd["live"][k * rd["m"] + g]]
        chosen.append((mine_live[:K] + mine_dead)[:K] if K > 0 else
                      [(0, k * rounds[0]["m"] + g) for g in range(rounds[0]["m"])])
    kept_set = {x for c in chosen for x in c}
    # this rank's kept rows: from each round's local rollout (group index local to the rank)
    parts = []
    for i, rd in enumerate(rounds):
        local = sorted(g - rank * rd["m"] for (j, g) in chosen[rank] if j == i)
        if local:
            parts.append((i, select_groups(rd["roll"], local)))
    pad = getattr(tr.model.config, "pad_token_id", None)
    roll = join_rollouts([p[1] for p in parts], pad if isinstance(pad, int) else 0)
    if roll.tool_stats is not None:          # the tool counts of every answer generated, kept or not
        roll = dataclasses.replace(roll, tool_stats={k: sum(rd["roll"].tool_stats[k] for rd in rounds)
                                                     for k in roll.tool_stats})
    # kept answers of every rank in rank order, each rank's groups in the order of its rollout
    kept_scores, kept_live = [], []
    for k in range(W):
        groups = sorted(chosen[k])                       # round, then place: the order join_rollouts gives
        for (i, g) in groups:
            kept_scores += rounds[i]["scores"][g * G:(g + 1) * G]
            kept_live.append(bool(rounds[i]["live"][g]))
    # the log: every generated answer, round after round
    prompts_all, texts_all, scores_all, turns_all, kept_flags, live_all = [], [], [], [], [], []
    dropped_s = total_s = 0.0
    for i, rd in enumerate(rounds):
        prompts_all += rd["prompts"]
        texts_all += rd["texts"]
        scores_all += rd["scores"]
        turns_all += rd["turns"] if rd["turns"] is not None else [None] * len(rd["texts"])
        kept_flags += [(i, g) in kept_set for g in range(len(rd["prompts"]))]
        live_all += rd["live"]
        mine = range(rank * rd["m"], (rank + 1) * rd["m"])
        dropped_s += rd["seconds"] * sum((i, g) not in kept_set for g in mine) / rd["m"]
        total_s += rd["seconds"]
    dropped_s, total_s = distributed.sum_values([dropped_s, total_s])
    tr.prompt_cursor = cursor
    n_groups = len(kept_flags)
    adv_all = group_advantages(scores_all, tr.channel_names, tr.weights, G, cfg.advantages)
    info = {"dynamic_rounds": extra_rounds, "dynamic_groups": n_groups, "dynamic_groups_kept": len(kept_set),
            "dynamic_groups_dropped": n_groups - len(kept_set), "dynamic_dead_groups": sum(not v for v in live_all),
            "dynamic_extra_answers": (n_groups - len(rounds[0]["prompts"])) * G,
            "seconds_share_dropped": dropped_s / total_s if total_s > 0 else 0.0,
            "dynamic_cap_reached": K < per_rank,
            "nonzero_adv_share_before": float((adv_all.abs() > LIVE_TOL).double().mean())}
    return {"roll": roll, "kept_scores": kept_scores, "live": kept_live, "prompts": prompts_all, "texts": texts_all,
            "scores": scores_all, "turns": turns_all if any(t is not None for t in turns_all) else None,
            "kept": kept_flags, "info": info,
            "rollout_seconds": rollout_seconds, "groups_per_rank": len(chosen[rank])}

