"""The prompt template: an environment's prompt spec -> one chat turn of token ids, and a
completion's text -> the answer text the verifier scores."""

from __future__ import annotations

import re

SYSTEM_PROMPT = "You are a precise assistant. Reply with the answer only."

# End-of-turn markers of the supported families (ChatML/Qwen/SmolLM, Llama 3, Llama 2/Mistral,
# Phi): text after the first one is not part of the answer.
_END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>", "<|end|>")
_SPECIAL = re.compile(r"<\|[A-Za-z0-9_]{1,40}\|>|<s>|</s>")


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
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
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
        text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
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
