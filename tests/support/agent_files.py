"""Paths of the agent tests' user files, and the tokenizer and tiny policy they share."""
import functools
import os

TOOLS = os.path.join(os.path.dirname(__file__), "agent_tools.py")


def tool_specs(*names: str) -> list[str]:
    return [f"{TOOLS}:{n}" for n in names]


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer():
    """The bundled SmolLM2's tokenizer (ChatML without tools; vocabulary 49,152, EOS <|im_end|> = 2),
    loaded once per test process: tests that change it change a copy."""
    from fasttrain.models import load_tokenizer
    return load_tokenizer()


def tiny_tool_policy(dtype: str = "float32"):
    """(model, tokenizer): a random 2-layer Llama over SmolLM2's vocabulary, with SmolLM2's tokenizer."""
    import copy

    import torch
    from fasttrain.models import tiny_llama
    return tiny_llama(vocab_size=49152, hidden=32, layers=2, heads=4, seed=0, dtype=getattr(torch, dtype)), \
        copy.copy(smollm2_tokenizer())


def write_task(folder, rows=None, rewards_file=None):
    """A dataset of arithmetic rows for the tool tests; returns its path."""
    import json
    rows = rows or [{"prompt": f"What is {a} + {b}?", "answer": a + b} for a, b in
                    [(2, 3), (4, 5), (1, 1), (7, 8), (6, 6), (9, 1)]]
    path = folder / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
