"""Loading a policy: the bundled SmolLM2-135M-Instruct, a Hugging Face safetensors directory or
a GGUF file; the chat prompt template; a tiny random Llama for tests."""

from .bundled import BUNDLED_NAME, bundled_gguf, cache_root
from .chat_template import (chat_messages_ids, chat_prompt_ids, extract_answer, set_template_kwargs, system_message,
                            template_kwargs)
from .gguf_conversion import convert_gguf
from .loading import SUPPORTED_FAMILIES, eos_token_ids, load_policy, load_tokenizer
from .tiny import tiny_llama, tiny_qwen3_5

__all__ = [
    "BUNDLED_NAME", "SUPPORTED_FAMILIES", "bundled_gguf", "cache_root", "chat_messages_ids", "chat_prompt_ids",
    "convert_gguf", "eos_token_ids", "extract_answer", "load_policy", "load_tokenizer", "set_template_kwargs",
    "system_message", "template_kwargs", "tiny_llama", "tiny_qwen3_5",
]
