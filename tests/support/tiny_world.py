"""A tiny policy (2-layer Llama, byte tokenizer) and a tiny environment for end-to-end tests.

The environment rewards answers that use the letter 'a' (core) and penalises length (cost), with
a narrow and a wide channel so GDPO has something to balance. Answers shorter than 2 characters
are invalid. Deterministic and stateless."""
from __future__ import annotations

import torch

from fasttrain.envs import Channel, Prompt, Score


class ByteTokenizer:
    """Bytes 0..255 are tokens 3..258; 0 pad, 1 bos, 2 eos."""
    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    vocab_size = 259
    name_or_path = "tiny-bytes"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([self.bos_token_id] if add_special_tokens else []) + [b + 3 for b in text.encode()]

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return bytes(i - 3 for i in ids if i >= 3).decode("utf-8", errors="replace")


def tiny_policy(dtype: str = "float32"):
    """(model, tokenizer): a random 2-layer Llama over bytes."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    return model, ByteTokenizer()


class LetterEnv:
    name = "letters"
    data_slices = ("train", "holdout")
    answer_format = "Answer with a short word."
    channels = [Channel("core", 3.0, "share of letters that are 'a', minus 0.2"),
                Channel("action_cost", 1.0, "-10 x length"),
                Channel("format", 1.0, "1 if it has >= 2 chars")]

    def prompts(self, split: str) -> list[Prompt]:
        n = 12 if split == "train" else 4
        return [Prompt(f"letters/{split}/{i}", f"Say a word number {i}.") for i in range(n)]

    def score(self, prompt, answer_text, data_slice="train"):
        t = answer_text
        if len(t) < 2:
            return Score({"core": -1.0, "action_cost": -10.0 * len(t), "format": 0.0}, False, -1.0, False, "too short")
        share = t.count("a") / len(t) - 0.2 + (0.05 if data_slice == "holdout" else 0.0)
        return Score({"core": share, "action_cost": -10.0 * len(t), "format": 1.0}, True, share, share > 0, None)

    def score_many(self, prompts, answers, data_slice="train"):
        return [self.score(p, a, data_slice) for p, a in zip(prompts, answers)]


def make_env() -> LetterEnv:
    return LetterEnv()
