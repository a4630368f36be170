"""Sample answers from the policy and score them with the environment (used by training, the
probe and the prompt filter alike)."""
from __future__ import annotations

import dataclasses
import inspect
from typing import Sequence

import torch

from fasttrain.envs import Prompt, Score
from fasttrain.train import distributed

__all__ = ["answer_token_ids", "eos_ids", "prompt_token_ids", "sample_answers", "score_answers", "has_slice",
           "group_seeds", "join_rollouts", "tool_settings", "score_step", "sample_chunks"]


def tool_settings(cfg) -> dict:
    """The settings a multi-turn rollout with tools reads from a run's config."""
    return {"max_tool_calls": cfg.rollout.max_tool_calls}


def group_seeds(key: Sequence[int], start: int, stop: int) -> list[int]:
    """One sampling seed per prompt position in [start, stop), a hash of (key..., position):
    a prompt's answers depend on the run's seed, the step and its place in the step, never on
    which data-parallel rank samples it."""
    import numpy as np
    return [int(np.random.SeedSequence([*map(int, key), j]).generate_state(1, np.uint64)[0] >> 1)
            for j in range(start, stop)]


def eos_ids(model, tokenizer) -> list[int]:
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    for v in (getattr(gen, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if v is None:
            continue
        ids += [int(x) for x in (v if isinstance(v, (list, tuple)) else [v]) if int(x) not in ids]
    if not ids:
        raise ValueError("the tokenizer and model declare no eos_token_id: cannot stop answers")
    return ids


def prompt_token_ids(tokenizer, env, prompts: Sequence[Prompt], answer_prefix: str = "") -> list[list[int]]:
    """Chat-turn token ids of each prompt; `answer_prefix` is written at the start of the
    assistant's turn (prefilled: part of the prompt, never trained on, prepended to the answer
    text the verifier scores). With tools the prompt carries their schemas, rendered as the tool
    rollout renders it (fasttrain.train.tool_rollout; an environment's reset text comes on top)."""
    from fasttrain.models import chat_messages_ids, chat_prompt_ids
    tail = list(tokenizer(answer_prefix, add_special_tokens=False)["input_ids"]) if answer_prefix else []
    messages = getattr(env, "chat_messages", None)    # environments whose prompts are chats
    if getattr(env, "tool_workers", None) is not None:
        from fasttrain.train.tool_rollout import tool_prompts
        return [ids + tail for ids in tool_prompts(tokenizer, env, [messages(p) for p in prompts])]
    if messages is not None:
        return [list(chat_messages_ids(tokenizer, messages(p))) + tail for p in prompts]
    return [list(chat_prompt_ids(tokenizer, p.spec, env.answer_format)) + tail for p in prompts]


def answer_token_ids(roll) -> list[list[int]]:
    """Each row's sampled completion ids, up to and including its EOS (what TRL passes to
    reward functions as `completion_ids`)."""
    ids, mask = roll.completion_ids.cpu(), roll.completion_mask.cpu().bool()
    return [ids[b][mask[b]].tolist() for b in range(ids.shape[0])]


@torch.no_grad()
def sample_answers(model, tokenizer, env, prompts: Sequence[Prompt], *, group_size: int,
                   max_new_tokens: int, temperature: float, seed: int | Sequence[int], answer_prefix: str = "",
                   stop_strings: Sequence[str] = (), weights=None, compile_decode: bool = False,
                   tool_settings: dict | None = None, prefill_chunk: int = 0, truncation=None):
    """(rollout, answer texts [B]); rows grouped by prompt (row b answers prompts[b // G]).
    Each answer text is `answer_prefix` + the decoded completion (special tokens skipped), cut at
    the end of the turn and stripped (fasttrain.models.extract_answer), or left as decoded for an
    environment with `decoded_answers = True` (TRL's reward-function text, the dataset environment);
    a row stops at EOS or once its text contains one of `stop_strings`. `weights`: dense rollout
    weights (fasttrain.nn.RolloutWeights), re-merged here if the adapters changed since the last
    call; `compile_decode`: the decode step through torch.compile; `prefill_chunk`: prompts
    prefilled at once (0: all). An environment with tools
    (`env.tool_workers`) gets multi-turn answers (fasttrain.train.tool_rollout) with
    `tool_settings` (max_tool_calls); the rollout then carries the conversations. `truncation`:
    top_k / top_p / min_p (fasttrain.rollout.sampling.Truncation, or None: plain temperature)."""
    from fasttrain.models import extract_answer
    from fasttrain.rollout import sample

    if getattr(env, "tool_workers", None) is not None and (answer_prefix or stop_strings):
        raise ValueError("rollout.answer_prefix and rollout.stop_strings are single-turn settings; "
                         "with tools a model turn ends at its end-of-turn token")
    was = model.training
    model.eval()
    cfg = getattr(model, "config", None)
    use_cache = getattr(cfg, "use_cache", None)
    if cfg is not None:
        cfg.use_cache = True
    if weights is not None:
        weights.refresh()
    try:
        if getattr(env, "tool_workers", None) is not None:
            from fasttrain.train.tool_rollout import sample_tool_answers
            return sample_tool_answers(model, tokenizer, env, prompts, group_size=group_size,
                                       max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                       eos_token_ids=eos_ids(model, tokenizer), weights=weights,
                                       truncation=truncation, **(tool_settings or {}))
        roll = sample(model, prompt_token_ids(tokenizer, env, prompts, answer_prefix), group_size=group_size,
                      max_new_tokens=max_new_tokens, temperature=temperature,
                      eos_token_ids=eos_ids(model, tokenizer), seed=seed, stop_strings=stop_strings,
                      token_text=lambda i: tokenizer.decode([i]), weights=weights, compile=compile_decode,
                      prefill_chunk=prefill_chunk, truncation=truncation)
    finally:
        if cfg is not None:
            cfg.use_cache = use_cache
        model.train(was)
    ids = roll.completion_ids.cpu()
    mask = roll.completion_mask.cpu().bool()
    decoded = [answer_prefix + tokenizer.decode(ids[b][mask[b]], skip_special_tokens=True) for b in range(ids.shape[0])]
    if getattr(env, "decoded_answers", False):      # TRL's reward functions get the decoded text as it is
        return roll, decoded
    return roll, [extract_answer(t) for t in decoded]


def truncation_of(section):
    """The sampler's Truncation from a config section's top_k, top_p and min_p (rollout or probe),
    or None when they are all off."""
    from fasttrain.rollout.sampling import Truncation
    t = Truncation(section.top_k, section.top_p, section.min_p)
    return t if t.active() else None


def sample_chunks(model, tokenizer, env, cfg, prompts: Sequence[Prompt], seeds: Sequence[int],
                  per_chunk: int | None, *, weights=None, prefill_chunk: int = 0):
    """(one Rollout, the answer texts) of `prompts` (one sampling seed each) under the run config
    `cfg`'s rollout settings, sampled `per_chunk` prompts at a time (all at once: None) and joined,
    rows in prompt order; with rollout.replay_kept_set off the kept sets are dropped (the update
    then scores on the whole vocabulary, as TRL does)."""
    R = cfg.rollout
    n = per_chunk or len(prompts)
    parts, texts = [], []
    for a in range(0, len(prompts), n):
        roll, tx = sample_answers(model, tokenizer, env, prompts[a:a + n], group_size=R.group_size,
                                  max_new_tokens=R.max_new_tokens, temperature=R.temperature, seed=seeds[a:a + n],
                                  answer_prefix=R.answer_prefix, stop_strings=R.stop_strings, weights=weights,
                                  compile_decode=R.compile, prefill_chunk=prefill_chunk, truncation=truncation_of(R),
                                  tool_settings={**tool_settings(cfg), "first_slot": a * R.group_size})
        parts.append(roll)
        texts += tx
    pad = getattr(model.config, "pad_token_id", None)
    roll = join_rollouts(parts, pad if isinstance(pad, int) else 0)
    if not R.replay_kept_set and roll.keep_delta is not None:
        roll = dataclasses.replace(roll, keep_delta=None)
    return roll, texts


def join_rollouts(parts: Sequence, pad_id: int):
    """One Rollout of chunks sampled one after the other (rows in order): prompts left-padded to
    the longest prompt, completions right-padded to the longest; the padding is masked out, so
    every row's tokens, positions and log-probs are its chunk's."""
    from fasttrain.rollout import Rollout
    from fasttrain.rollout.moe_routing import join_routing
    if len(parts) == 1:
        return parts[0]
    P = max(r.prompt_len for r in parts)
    T = max(r.completion_ids.shape[1] for r in parts)
    G = parts[0].group_size

    def pad(x: torch.Tensor, left: int, right: int, value) -> torch.Tensor:
        return torch.nn.functional.pad(x, (left, right), value=value)

    ids, att, comp, cmask, amask, logp, offset, index = [], [], [], [], [], [], 0, []
    kept = any(r.keep_delta is not None for r in parts)
    deltas = []
    for r in parts:
        left, right = P - r.prompt_len, T - r.completion_ids.shape[1]
        ids.append(pad(r.input_ids, left, right, pad_id))
        att.append(pad(r.attention_mask, left, right, 0))
        comp.append(pad(r.completion_ids, 0, right, pad_id))
        cmask.append(pad(r.completion_mask, 0, right, False))
        amask.append(pad(r.action_mask, 0, right, False))
        logp.append(pad(r.logprobs, 0, right, 0.0))
        if kept:   # +inf: the whole vocabulary (an untruncated chunk, the padding)
            d = r.keep_delta if r.keep_delta is not None else torch.full_like(r.logprobs, float("inf"))
            deltas.append(pad(d, 0, right, float("inf")))
        index.append(r.prompt_index + offset)
        offset += r.completion_ids.shape[0] // G
    attention_mask = torch.cat(att)
    return Rollout(input_ids=torch.cat(ids), attention_mask=attention_mask,
                   position_ids=(attention_mask.long().cumsum(-1) - 1).clamp_min(0), prompt_len=P,
                   completion_ids=torch.cat(comp), completion_mask=torch.cat(cmask), action_mask=torch.cat(amask),
                   lengths=torch.cat([r.lengths for r in parts]), prompt_index=torch.cat(index),
                   logprobs=torch.cat(logp), finished=torch.cat([r.finished for r in parts]), group_size=G,
                   conversations=(None if parts[0].conversations is None
                                  else [c for r in parts for c in r.conversations]),
                   tool_stats=(None if parts[0].tool_stats is None
                               else {k: sum(r.tool_stats[k] for r in parts) for k in parts[0].tool_stats}),
                   routing=join_routing(parts, P, T), keep_delta=torch.cat(deltas) if kept else None)


def has_slice(env, name: str) -> bool:
    slices = tuple(getattr(env, "data_slices", ()))
    return name in slices or (name in ("train", "holdout") and len(slices) >= 2)


def _takes(env, name: str) -> bool:
    try:
        return name in inspect.signature(env.score_many).parameters
    except (TypeError, ValueError):
        return False


def _takes_record(env) -> bool:
    return _takes(env, "record")


def score_answers(env, prompts: Sequence[Prompt], answers: Sequence[str], data_slice: str,
                  record: bool = True, completion_ids: Sequence[Sequence[int]] | None = None,
                  conversations: Sequence[list] | None = None) -> list[Score]:
    """Score; `record=False` (probes, filter) keeps a stateful environment (novelty archive)
    unchanged where the environment supports it. `completion_ids` (the sampled token ids of
    each answer) and `conversations` (a multi-turn answer's chat messages) go to environments
    whose score_many takes them."""
    kw = {}
    if _takes_record(env):
        kw["record"] = record
    if completion_ids is not None and _takes(env, "completion_ids"):
        kw["completion_ids"] = completion_ids
    if conversations is not None and _takes(env, "conversations"):
        kw["conversations"] = conversations
    return env.score_many(prompts, answers, data_slice, **kw)


def is_stateful(env) -> bool:
    """Environments whose scores depend on what they scored before declare `record` (a wrapped
    plug-in says so through its `stateful` attribute)."""
    stateful = getattr(env, "stateful", None)
    return bool(stateful) if stateful is not None else _takes_record(env)


def score_step(env, prompts: Sequence[Prompt], lo: int, hi: int, texts: list[str], ids: list[list[int]],
               turns: list | None, group_size: int, data_slice: str):
    """(scores, answer texts, conversations or None) of a training step's answers, the whole step
    in the one-process order, on every rank; this rank's answers are those of prompts[lo:hi]. A
    stateful environment scores every answer on every rank, in that order, so its state stays the
    one-process state; a stateless one scores each rank's answers where they are."""
    G = group_size
    turns = turns if turns is not None else [None] * len(texts)
    if is_stateful(env) or distributed.world_size() == 1:
        both = distributed.gather_list(list(zip(texts, ids, turns)))
        texts, ids, turns = [x[0] for x in both], [x[1] for x in both], [x[2] for x in both]
        rep = [p for p in prompts for _ in range(G)]
        conv = turns if turns and turns[0] is not None else None
        return score_answers(env, rep, texts, data_slice, record=True,
                             completion_ids=ids, conversations=conv), texts, conv
    rep = [p for p in prompts[lo:hi] for _ in range(G)]
    conv = turns if turns and turns[0] is not None else None
    mine = score_answers(env, rep, texts, data_slice, record=True, completion_ids=ids, conversations=conv)
    both = distributed.gather_list(list(zip(mine, texts, turns)))
    conv = [x[2] for x in both]
    return [x[0] for x in both], [x[1] for x in both], conv if conv and conv[0] is not None else None
