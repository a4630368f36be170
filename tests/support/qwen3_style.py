"""A Qwen3-style chat template (ChatML with Qwen3's `enable_thinking` switch), a byte-level
tokenizer that knows its control tokens, and a tiny policy built on both -- offline, for the
chat-template-variable tests."""
from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

# As Qwen3's template does it: with enable_thinking false the generation prompt already holds an
# empty think block, so the model answers without thinking; undefined or true leaves it open.
QWEN3_STYLE_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def qwen3_style_tokenizer() -> PreTrainedTokenizerFast:
    """Bytes are tokens 0..255 (GPT-2's byte alphabet, no merges); the control tokens follow."""
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=CONTROL_TOKENS[1:2] + CONTROL_TOKENS[3:])
    out.chat_template = QWEN3_STYLE_TEMPLATE
    out.padding_side = "left"
    return out


def tiny_qwen3_style_policy(dtype: str = "float32"):
    """(model, tokenizer): a random 2-layer Llama over the tokenizer's ids (a `module:factory`)."""
    from fasttrain.models import tiny_llama
    tok = qwen3_style_tokenizer()
    model = tiny_llama(vocab_size=len(tok), hidden=32, layers=1, heads=2, dtype=getattr(torch, dtype))
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok
