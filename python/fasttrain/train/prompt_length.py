"""rollout.max_prompt_tokens: every prompt of the run, rendered as the rollout renders it (chat
template, system prompt, answer prefix, and the tools' schemas for an environment with tools),
measured once the tokenizer is loaded and before the first step. (An environment class's first
observation joins the prompt only when the rollout resets it; it is not counted here.) A longer prompt is a ConfigError naming its row and the fix, or, with
env.skip_bad_rows, left out of the run with its reason kept for the report.

Why before the first step: an over-long prompt otherwise fails deep in the rollout (positions
past the model's context) or silently leaves no room for the answer, after the run has started.
"""
from __future__ import annotations

from typing import Sequence

from fasttrain.envs import Prompt
from fasttrain.train.answers import prompt_token_ids
from fasttrain.train.config import Config, ConfigError

__all__ = ["prompt_limit", "check_prompt_lengths"]


def prompt_limit(cfg: Config, model) -> int:
    """The setting, or the model's context (max_position_embeddings) minus max_new_tokens."""
    if cfg.rollout.max_prompt_tokens:
        return cfg.rollout.max_prompt_tokens
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return int(context) - cfg.rollout.max_new_tokens if context else 0


def _rendered_lengths(tokenizer, env, prompts: Sequence[Prompt], answer_prefix: str) -> list[int]:
    # prompt_token_ids renders a tool environment's prompts with the tools' schemas, as the tool
    # rollout does: one renderer for the check and the run
    return [len(ids) for ids in prompt_token_ids(tokenizer, env, prompts, answer_prefix)]


def _where(env, prompt_id: str) -> str:
    row_of = getattr(env, "row_of", None)
    return row_of(prompt_id) if callable(row_of) else f"prompt {prompt_id!r} of {env.name}"


def check_prompt_lengths(cfg: Config, tokenizer, env, model, splits: dict[str, Sequence[Prompt]],
                         skipped: list[str]) -> dict[str, list[Prompt]]:
    """`splits` (name -> prompts) without the prompts over the limit (env.skip_bad_rows; their
    reasons appended to `skipped`); ConfigError for the first one otherwise."""
    limit = prompt_limit(cfg, model)
    if limit <= 0:
        if cfg.rollout.max_prompt_tokens == 0 and limit < 0:
            raise ConfigError(f"rollout.max_new_tokens = {cfg.rollout.max_new_tokens} leaves no room for a prompt "
                              f"in the model's context ({limit + cfg.rollout.max_new_tokens} tokens)")
        return {k: list(v) for k, v in splits.items()}
    out = {}
    for split, prompts in splits.items():
        keep = []
        lengths = _rendered_lengths(tokenizer, env, prompts, cfg.rollout.answer_prefix)
        for p, n in zip(prompts, lengths):
            if n <= limit:
                keep.append(p)
                continue
            why = (f"{_where(env, p.id)}: the rendered prompt is {n} tokens, over rollout.max_prompt_tokens = "
                   f"{limit}" + ("" if cfg.rollout.max_prompt_tokens else
                                 f" (the model's context minus rollout.max_new_tokens = {cfg.rollout.max_new_tokens})"))
            if not cfg.env.skip_bad_rows:
                raise ConfigError(f"{why}. Shorten it, raise rollout.max_prompt_tokens, or set "
                                  "env.skip_bad_rows = true to leave such rows out")
            skipped.append(why)
        if not keep:
            raise ConfigError(f"every {split} prompt is over rollout.max_prompt_tokens = {limit}; the first: "
                              f"{skipped[-len(prompts)]}")
        out[split] = keep
    return out
