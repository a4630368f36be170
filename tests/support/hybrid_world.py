"""A tiny Qwen3.5 hybrid over bytes and a plug-in environment it can learn from in a few steps.

The policy: 4 layers (3 Gated DeltaNet + 1 gated attention), hidden 64, over tiny_world's byte
tokenizer (259 ids), random. The environment scores an answer by its share of lowercase ASCII
letters (26 of the 256 bytes), which a random policy samples often enough that a group of 8 has
spread from step 0: the reward to climb is the letter share."""
from __future__ import annotations

import torch

from fasttrain.envs import Channel, Prompt, Score
from support.tiny_world import ByteTokenizer


def tiny_hybrid_policy(dtype: str = "float32"):
    """(model, tokenizer): a random 4-layer Qwen3.5 hybrid over bytes."""
    from fasttrain.models import tiny_qwen3_5
    model = tiny_qwen3_5(vocab_size=259, hidden=64, layers=4, interval=4, heads=4, kv_heads=2, head_dim=16,
                         linear_k_heads=2, value_heads_per_key=2, linear_head_dim=16, seed=0,
                         dtype=getattr(torch, dtype))
    return model, ByteTokenizer()


class LowercaseEnv:
    name = "lowercase"
    data_slices = ("train", "holdout")
    answer_format = "Answer in lowercase letters."
    channels = [Channel("core", 1.0, "share of the answer's characters that are a-z")]

    def prompts(self, split: str) -> list[Prompt]:
        n = 8 if split == "train" else 4
        return [Prompt(f"lowercase/{split}/{i}", f"Write word {i}.") for i in range(n)]

    def score(self, prompt, answer_text, data_slice="train"):
        if not answer_text:
            return Score({"core": 0.0}, True, 0.0, False, None)
        share = sum("a" <= c <= "z" for c in answer_text) / len(answer_text)
        return Score({"core": share}, True, share, share > 0.5, None)

    def score_many(self, prompts, answers, data_slice="train"):
        return [self.score(p, a, data_slice) for p, a in zip(prompts, answers)]


def make_env() -> LowercaseEnv:
    return LowercaseEnv()
