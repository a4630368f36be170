"""The prompt template: an environment's prompt spec -> one chat turn of token ids, and a
completion's text -> the answer text the verifier scores.

Chat-template variables (`policy.chat_template_kwargs`, e.g. Qwen3's `enable_thinking = false`)
are set once on the tokenizer when the policy is built (`set_template_kwargs`); every prompt
builder here renders with them, so the rollout, probe, filter, dataset prompts and the plan's
length check see the same text."""

from __future__ import annotations

import logging
import re
from typing import Any, Mapping

log = logging.getLogger(__name__)

SYSTEM_PROMPT = "You are a precise assistant. Reply with the answer only."

# End-of-turn markers of the supported families (ChatML/Qwen/SmolLM, Llama 3, Llama 2/Mistral,
# Phi): text after the first one is not part of the answer.
_END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>", "<|end|>")
_SPECIAL = re.compile(r"<\|[A-Za-z0-9_]{1,40}\|>|<s>|</s>")


# Where a tokenizer carries the variables its chat template is rendered with (a fasttrain name,
# so it never collides with a transformers attribute; not saved with the tokenizer).
_KWARGS_ATTR = "fasttrain_chat_template_kwargs"


def _template_text(tokenizer) -> str:
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):                       # named templates ("default", "tool_use", ...)
        return "\n".join(str(v) for v in t.values())
    return t if isinstance(t, str) else ""


def set_template_kwargs(tokenizer, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Make every prompt this module builds from `tokenizer` render its chat template with
    `kwargs`, keeping only the variables the template mentions (so `enable_thinking = false`
    turns Qwen3's thinking off and leaves a template without that switch, e.g. SmolLM2's,
    rendering exactly as before). Returns the variables kept; the dropped ones are logged."""
    text = _template_text(tokenizer)
    kept = {k: v for k, v in kwargs.items() if re.search(rf"\b{re.escape(k)}\b", text)}
    dropped = sorted(set(kwargs) - set(kept))
    if dropped:
        log.info("policy.chat_template_kwargs: %s not read by this model's chat template; ignored",
                 ", ".join(dropped))
    setattr(tokenizer, _KWARGS_ATTR, kept)
    return dict(kept)


def template_kwargs(tokenizer) -> dict[str, Any]:
    """The chat-template variables set on `tokenizer` by `set_template_kwargs` ({} if none)."""
    return dict(getattr(tokenizer, _KWARGS_ATTR, None) or {})


def system_message(answer_format: str | None) -> str:
    return SYSTEM_PROMPT if not answer_format else f"{SYSTEM_PROMPT} {answer_format.strip()}"


def chat_prompt_ids(tokenizer, spec_text: str, answer_format: str | None = None) -> list[int]:
    """Token ids of a chat with a system message (answer only, plus `answer_format` when given),
    the user turn `spec_text`, and the assistant's generation prompt. A tokenizer without a chat
    template (a base model) gets a plain 'System/User/Assistant' text layout instead."""
    if not isinstance(spec_text, str) or not spec_text.strip():
        raise ValueError("chat_prompt_ids: spec_text must be a non-empty string")
    system = system_message(answer_format)
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": spec_text}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             **template_kwargs(tokenizer))
        # The template already wrote any BOS it wants; don't let the tokenizer add another.
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = f"System: {system}\n\nUser: {spec_text}\n\nAssistant:"
    return list(tokenizer(text)["input_ids"])


def chat_messages_ids(tokenizer, messages) -> list[int]:
    """Token ids of a conversation given as chat messages ({"role", "content"} dicts, as in TRL's
    conversational datasets) followed by the assistant's generation prompt. A tokenizer without
    a chat template gets the same 'Role: content' text layout as `chat_prompt_ids`."""
    if not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                               and isinstance(m.get("content"), str) for m in messages):
        raise ValueError("chat_messages_ids: messages must be a non-empty list of "
                         "{'role': str, 'content': str} dicts")
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True,
                                             **template_kwargs(tokenizer))
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    turns = "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages)
    return list(tokenizer(f"{turns}Assistant:")["input_ids"])


def extract_answer(completion_text: str) -> str:
    """The answer part of a decoded completion: text up to the first end-of-turn marker, other
    special tokens removed, surrounding whitespace stripped. Never evaluates anything."""
    if not isinstance(completion_text, str):
        raise TypeError(f"extract_answer: completion_text must be str, got {type(completion_text).__name__}")
    cut = len(completion_text)
    for marker in _END_MARKERS:
        i = completion_text.find(marker)
        if 0 <= i < cut:
            cut = i
    return _SPECIAL.sub("", completion_text[:cut]).strip()
