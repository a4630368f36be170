"""Chat templates for tool calling: which template a tool run renders with, the tool turn's token
ids, and the tool calls of a finished model turn.

The rules are TRL's GRPOTrainer's, read in its code:
- a template must render a whole tool exchange (user, assistant with tool_calls, tool) with every
  part visible, and be prefix-preserving: the conversation rendered with a tool turn appended
  starts with the tokens of the one without it (the model's own tokens are never re-tokenised);
- a template that renders tools but is not prefix-preserving is swapped for TRL's training
  template of that family (Qwen3, Qwen3.5, ... via trl.chat_template_utils); a ChatML template
  without tools (the bundled SmolLM2's) gets CHATML_TOOLS below; anything else is an error;
- a tool turn's tokens are the difference between a small conversation rendered with and
  without the tool messages, the shorter one cut after its last EOS token;
- tool calls come from transformers' `parse_response` when the tokenizer has a response template
  or schema, else from Hermes/Qwen blocks `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
  a turn whose calls cannot be read is plain text without calls (the answer ends there).

What it is not: a tool runner (fasttrain.envs.tools) or the rollout (fasttrain.rollout.multi_turn).
JSON from the model is read with json.loads under size and depth limits; nothing is evaluated.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

__all__ = ["CHATML_TOOLS", "ParsedTurn", "TemplateError", "is_prefix_preserving", "parse_turn",
           "renders_tools", "tool_chat_template", "tool_prompt_ids", "tool_suffix_ids"]

MAX_CALLS_PER_TURN = 32            # more calls than this in one turn end the answer
MAX_CALL_CHARS = 1 << 16           # one <tool_call> block's JSON, characters
MAX_JSON_DEPTH = 64                # nesting of a call's JSON

# A ChatML template with tools in the Hermes layout: tools as JSON lines in the system turn, calls
# as <tool_call> blocks, results as <tool_response> blocks in a user turn. Without tools it renders
# exactly as SmolLM2-Instruct's own template (same default system turn).
CHATML_TOOLS = (
    "{%- set default_system = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- default_system }}{%- endif %}"
    "{{- '\\n\\nYou can call functions. Their signatures are between <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call a function, write a JSON object with its name and arguments between "
    "<tool_call></tool_call> tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\n' + default_system + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first and tools %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set f = call['function'] if call['function'] is defined else call %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}"
    "{%- if f['arguments'] is string %}{{- f['arguments'] }}{%- else %}{{- f['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_SENTINELS = ("tool_name_x7q", "arg_key_x7q", "arg_value_x7q", "tool_result_x7q")
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "</s>", "<|end|>")


class TemplateError(ValueError):
    """The policy's chat template cannot run tools; the message says why and what to do."""


def _render(tokenizer, messages, template: str, kwargs: dict, **kw) -> str:
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, **kw, **kwargs)


def renders_tools(tokenizer, template: str, kwargs: dict | None = None) -> bool:
    """Whether `template` renders a tool exchange with the call's name, its argument and the
    result all visible (TRL's supports_tool_calling test)."""
    name, key, value, result = _SENTINELS
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {key: value}}}]},
            {"role": "tool", "name": name, "content": result}]
    try:
        text = _render(tokenizer, msgs, template, kwargs or {})
    except Exception:                                   # noqa: BLE001 (jinja errors of any kind)
        return False
    return all(s in text for s in _SENTINELS)


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def is_prefix_preserving(tokenizer, template: str, kwargs: dict | None = None) -> bool:
    """[user, assistant with a call] rendered is a token prefix of the same plus a tool turn and
    the generation prompt (the property the tool turn's token diff relies on)."""
    call = [{"type": "function", "function": {"name": "dummy", "arguments": {}}}]
    one = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": call}]
    two = one + [{"role": "tool", "name": "dummy", "content": "dummy"}]
    a = _ids(tokenizer, _render(tokenizer, one, template, kwargs or {}))
    b = _ids(tokenizer, _render(tokenizer, two, template, kwargs or {}, add_generation_prompt=True))
    return b[:len(a)] == a


def tool_chat_template(tokenizer, kwargs: dict | None = None) -> str:
    """The template a tool run renders with (module docstring: the tokenizer's own when it fits,
    TRL's training template, CHATML_TOOLS for a ChatML template without tools, or an error)."""
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):
        own = own.get("default")
    if not own:
        raise TemplateError("tools need a chat template; the tokenizer has none (a base model?)")
    if renders_tools(tokenizer, own, kwargs):
        if is_prefix_preserving(tokenizer, own, kwargs):
            return own
        try:
            from trl.chat_template_utils import get_training_chat_template
        except ImportError:
            raise TemplateError("the chat template is not prefix-preserving (it rewrites earlier turns, "
                                "e.g. drops <think> blocks); TRL's training templates fix the known ones: "
                                "pip install trl") from None
        try:
            fixed = get_training_chat_template(tokenizer)
        except ValueError as e:
            raise TemplateError(f"the chat template is not prefix-preserving and TRL has no training "
                                f"template for it ({e})") from None
        return fixed or own
    if "<|im_start|>" in own and "<|im_end|>" in own:
        return CHATML_TOOLS
    raise TemplateError("the chat template cannot render tool calls and tool results (and is not ChatML, "
                        "for which fasttrain has one); use a model whose template supports tools")


def tool_prompt_ids(tokenizer, messages: Sequence[dict], tools: Sequence[dict], template: str,
                    kwargs: dict | None = None) -> list[int]:
    """Token ids of `messages` with the tools' schemas and the generation prompt."""
    return _ids(tokenizer, _render(tokenizer, list(messages), template, kwargs or {}, tools=list(tools) or None,
                                   add_generation_prompt=True))


def tool_suffix_ids(tokenizer, tool_messages: Sequence[dict], template: str, kwargs: dict | None = None) -> list[int]:
    """The tokens that follow a model turn's end token for these tool results, up to and
    including the next assistant header: a small conversation rendered with and without them,
    the shorter cut after its last EOS (TRL's rule; the name is the first call's, as some
    templates put it in the tool turn's header)."""
    call = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    base = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": call}]
    short = _ids(tokenizer, _render(tokenizer, base, template, kwargs or {}))
    full = _ids(tokenizer, _render(tokenizer, base + list(tool_messages), template, kwargs or {},
                                   add_generation_prompt=True))
    eos = tokenizer.eos_token_id
    ends = [i for i, t in enumerate(short) if t == eos]
    if ends:
        short = short[:ends[-1] + 1]
    if full[:len(short)] != short:
        raise TemplateError("the chat template renders the conversation before a tool turn differently once "
                            "the tool turn is added (not prefix-preserving)")
    return full[len(short):]


@dataclass
class ParsedTurn:
    """A finished model turn as a chat message, its tool calls (name, arguments) and whether it
    held tool-call blocks that could not be read (then it has no calls: the answer ends)."""
    message: dict[str, Any]
    calls: list[tuple[str, Any]] = field(default_factory=list)
    malformed: bool = False


def _depth(text: str) -> int:
    depth = top = 0
    in_str = esc = False
    for ch in text:
        if in_str:
            esc, in_str = (False, in_str) if esc else (ch == "\\", ch != '"')
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            top = max(top, depth)
        elif ch in "]}":
            depth -= 1
    return top


def _read_call(block: str) -> tuple[str, Any] | None:
    block = block.strip()
    if len(block) > MAX_CALL_CHARS or _depth(block) > MAX_JSON_DEPTH:
        return None
    try:
        obj = json.loads(block)
        args = obj.get("arguments", {}) if isinstance(obj, dict) else None
        if isinstance(args, str):
            args = json.loads(args) if _depth(args) <= MAX_JSON_DEPTH and len(args) <= MAX_CALL_CHARS else None
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return obj["name"], ({} if args is None and "arguments" not in obj else args)


def parse_turn(tokenizer, ids: Sequence[int], prefix: Sequence[int] | None = None) -> ParsedTurn:
    """The model turn `ids` (ending at its end token or cut by the budget) as a message
    {"role": "assistant", "content", "tool_calls"?} and its calls (module docstring)."""
    plain = tokenizer.decode(list(ids), skip_special_tokens=True)
    if getattr(tokenizer, "response_template", None) is not None or getattr(tokenizer, "response_schema", None) is not None:
        return _parse_with_transformers(tokenizer, ids, prefix, plain)
    text = tokenizer.decode(list(ids), skip_special_tokens=False)
    cut = min([i for i in (text.find(m) for m in _END_MARKERS) if i >= 0], default=len(text))
    text = text[:cut]
    blocks = _TOOL_CALL.findall(text)
    if not blocks:
        return ParsedTurn({"role": "assistant", "content": plain}, malformed="<tool_call>" in text)
    calls = [_read_call(b) for b in blocks[:MAX_CALLS_PER_TURN + 1]]
    if len(blocks) > MAX_CALLS_PER_TURN or any(c is None for c in calls):
        return ParsedTurn({"role": "assistant", "content": plain}, malformed=True)
    content = text[:text.find("<tool_call>")].strip()
    return ParsedTurn({"role": "assistant", "content": content,
                       "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}}
                                      for n, a in calls]}, calls)


def _parse_with_transformers(tokenizer, ids, prefix, plain: str) -> ParsedTurn:
    """transformers' parse_response with TRL's fallback (plain text when it cannot parse), also
    on the errors deep JSON raises."""
    try:
        if prefix is not None and getattr(tokenizer, "response_template", None) is not None:
            msg = tokenizer.parse_response(list(ids), prefix=list(prefix))
        else:
            msg = tokenizer.parse_response(list(ids))
        if msg is None:
            raise ValueError("nothing parsed")
        msg = dict(msg)
        if isinstance(msg.get("content"), str) and tokenizer.eos_token:
            msg["content"] = msg["content"].removesuffix(tokenizer.eos_token)
        msg["content"] = msg.get("content") or ""
        calls = []
        for c in msg.get("tool_calls") or []:
            f = c.get("function", c) if isinstance(c, dict) else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                raise ValueError("a tool call without a name")
            f["arguments"] = {} if f.get("arguments") is None else f["arguments"]
            calls.append((f["name"], f["arguments"]))
        if len(calls) > MAX_CALLS_PER_TURN:
            raise ValueError("too many calls")
    except (ValueError, TypeError, RecursionError, KeyError, AttributeError):
        return ParsedTurn({"role": "assistant", "content": plain}, malformed=True)
    return ParsedTurn(msg, calls)
