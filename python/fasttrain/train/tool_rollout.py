"""Answers with tool calls: the multi-turn rollout, the tools' worker processes and the chat
template put together, under TRL's rules (fasttrain.models.tool_template lists them).

For each step: each row's environment instance (if any) is reset with its dataset row and its
observation is appended to the last user message; the prompts are rendered with the tools'
schemas; fasttrain.rollout.multi_turn decodes, and at each finished model turn this file parses
the tool calls, runs every waiting row's calls at once in the workers, renders the results as
tool messages, and hands back the tool turn's tokens (the template diff). A tool turn that does
not fit the row's room in `max_new_tokens` is dropped and the answer ends there (TRL's rule), as
it does after `max_tool_calls` rounds. Each row's conversation (assistant, tool, ..., assistant),
the calls, their errors and the model turns are returned with the rollout.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from fasttrain.envs.tools import MAX_RESULT_CHARS, ToolCall, ToolWorkers
from fasttrain.models.tool_template import parse_turn, tool_chat_template, tool_prompt_ids, tool_suffix_ids

__all__ = ["ToolTurns", "prompt_messages_with_observations", "sample_tool_answers", "tool_prompts"]


class ToolTurns:
    """The end-of-turn handler of one multi-turn rollout (its state is per row)."""

    def __init__(self, tokenizer, workers: ToolWorkers, template: str, prompt_ids: Sequence[Sequence[int]],
                 max_tool_calls: int = 0, template_kwargs: dict | None = None, first_slot: int = 0):
        self.tok, self.workers, self.template = tokenizer, workers, template
        self.first_slot = first_slot                          # row r's environment slot: first_slot + r
        self.kwargs = dict(template_kwargs or {})
        self.max_tool_calls = max_tool_calls
        B = len(prompt_ids)
        self.prefix = [list(p) for p in prompt_ids]          # what each row's next turn follows
        self.conversations: list[list[dict[str, Any]]] = [[] for _ in range(B)]
        self.rounds = [0] * B
        self.parsed_upto = [0] * B                            # completion tokens already in the conversation
        self.tool_calls = self.tool_errors = self.malformed = self.dropped = 0

    def _take_turn(self, r: int, span: list[int]):
        parsed = parse_turn(self.tok, span, prefix=self.prefix[r])
        self.conversations[r].append(parsed.message)
        self.prefix[r] += span
        self.parsed_upto[r] += len(span)
        self.malformed += parsed.malformed
        return parsed

    def __call__(self, rows: list[int], spans: list[list[int]], room: list[int]) -> list[list[int] | None]:
        calls: dict[int, list[ToolCall]] = {}
        for r, span in zip(rows, spans):
            parsed = self._take_turn(r, span)
            if parsed.calls and (not self.max_tool_calls or self.rounds[r] < self.max_tool_calls):
                calls[r] = [ToolCall(n, a) for n, a in parsed.calls]
        results = self.workers.call({self.first_slot + r: c for r, c in calls.items()}) if calls else {}
        results = {r - self.first_slot: v for r, v in results.items()}
        out: list[list[int] | None] = []
        for r, left in zip(rows, room):
            if r not in results:
                out.append(None)
                continue
            msgs = [m for m, _ in results[r]]
            self.tool_calls += len(msgs)
            self.tool_errors += sum(failed for _, failed in results[r])
            over = any(len(m["content"]) > MAX_RESULT_CHARS for m in msgs)   # past any budget: not tokenised
            suffix = None if over else tool_suffix_ids(self.tok, msgs, self.template, self.kwargs)
            if suffix is None or len(suffix) > left:
                self.dropped += 1                                            # TRL: rolled back, answer ends
                out.append(None)
                continue
            self.conversations[r] += msgs
            self.prefix[r] += suffix
            self.parsed_upto[r] += len(suffix)
            self.rounds[r] += 1
            out.append(suffix)
        return out

    def finish(self, roll) -> None:
        """Parse each row's last model turn that no end-of-turn call saw (cut by the budget)."""
        for r in range(len(self.conversations)):
            n = int(roll.lengths[r])
            if self.parsed_upto[r] < n:
                self._take_turn(r, roll.completion_ids[r, self.parsed_upto[r]:n].tolist())

    def stats(self) -> dict[str, int]:
        return {"tool_calls": self.tool_calls, "tool_errors": self.tool_errors + self.malformed,
                "turns": sum(sum(m["role"] == "assistant" for m in c) for c in self.conversations),
                "tool_results_dropped": self.dropped}


def prompt_messages_with_observations(messages: list[dict[str, Any]], observation: str | None) -> list[dict[str, Any]]:
    """TRL's rule for reset()'s return value: appended to the last message's content (a copy)."""
    if observation is None:
        return messages
    return messages[:-1] + [{**messages[-1], "content": messages[-1]["content"] + observation}]


def tool_prompts(tokenizer, env, messages: Sequence[list], template_kwargs: dict | None = None) -> list[list[int]]:
    """Token ids of each conversation with the tools' schemas and the generation prompt, in the
    template a tool run renders with (policy.chat_template_kwargs from the tokenizer)."""
    from fasttrain.models import template_kwargs as set_kwargs
    kw = {**set_kwargs(tokenizer), **(template_kwargs or {})}
    template = tool_chat_template(tokenizer, kw)
    return [tool_prompt_ids(tokenizer, m, env.tool_workers.schemas, template, kw) for m in messages]


def sample_tool_answers(model, tokenizer, env, prompts, *, group_size: int, max_new_tokens: int,
                        temperature: float, seed, eos_token_ids: Sequence[int], max_tool_calls: int = 0,
                        template_kwargs: dict | None = None, weights=None, replay=None, first_slot: int = 0,
                        truncation=None):
    """(rollout with .conversations and .tool_stats, answer texts [B]) for an environment with
    `tool_workers` and `chat_messages` (fasttrain.envs.dataset). The answer text is the last
    assistant message's content, cut at its end of turn. `replay`: fasttrain.rollout.multi_turn's
    scripted model turns (tests, and the comparison with TRL's loop). `first_slot`: the environment
    slot of row 0 (a step sampled in chunks gives each chunk its own slots, so the step's answer i
    is slot i when it is scored)."""
    from fasttrain.models import extract_answer, template_kwargs as set_kwargs
    from fasttrain.rollout.multi_turn import sample_turns

    template_kwargs = {**set_kwargs(tokenizer), **(template_kwargs or {})}   # policy.chat_template_kwargs
    workers: ToolWorkers = env.tool_workers
    template = tool_chat_template(tokenizer, template_kwargs)
    G = group_size
    messages = [env.chat_messages(p) for p in prompts]
    if workers.has_environment:
        rows = [dict(p.fields) for p in prompts for _ in range(G)]
        obs = workers.reset(rows, first_slot)
        firsts = []
        for i in range(len(prompts)):
            # a reset that raised or timed out leaves that answer's instance broken: its calls and
            # get_reward become errors (an invalid answer), the rollout goes on
            got = {v for k, v in obs[i * G:(i + 1) * G] if k == "ok"}
            if len(got) > 1:
                raise RuntimeError(f"environment reset returned different observations for the {G} answers "
                                   f"of prompt {prompts[i].id}; fasttrain shares one prompt among a group")
            firsts.append(next(iter(got), None))
        messages = [prompt_messages_with_observations(m, o) for m, o in zip(messages, firsts)]
    prompt_ids = tool_prompts(tokenizer, env, messages, template_kwargs)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and max(map(len, prompt_ids)) + max_new_tokens > limit:
        raise ValueError(f"a prompt of {max(map(len, prompt_ids))} tokens plus rollout.max_new_tokens = "
                         f"{max_new_tokens} passes the model's {limit} positions; lower max_new_tokens")
    turns = ToolTurns(tokenizer, workers, template, [p for p in prompt_ids for _ in range(G)], max_tool_calls,
                      template_kwargs, first_slot)
    roll = sample_turns(model, prompt_ids, group_size=G, max_new_tokens=max_new_tokens, temperature=temperature,
                        eos_token_ids=eos_token_ids, seed=seed, end_of_turn=turns, weights=weights, replay=replay,
                        truncation=truncation)
    turns.finish(roll)
    roll = dataclasses.replace(roll, conversations=turns.conversations, tool_stats=turns.stats())
    texts = [extract_answer(next((m["content"] for m in reversed(c) if m["role"] == "assistant"), ""))
             for c in turns.conversations]
    return roll, texts
