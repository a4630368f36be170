"""A prompt-list environment with dead groups by construction, for dynamic sampling's tests.

12 prompts. On a prompt whose number is a multiple of 3 every answer scores 0 (a dead group, always);
on the others an answer scores 1 when its first byte is even, else 0 (a group of 4 random-byte
answers is dead with probability 1/8). Deterministic and stateless; one channel."""
from __future__ import annotations

from fasttrain.envs import Channel, Prompt, Score


class ParityEnv:
    name = "parity"
    data_slices = ("train", "holdout")
    answer_format = "Answer with a short word."
    channels = [Channel("core", 1.0, "1 if the first byte is even (0 on prompts 0, 3, 6, 9)")]

    def prompts(self, split: str) -> list[Prompt]:
        n = 12 if split == "train" else 3
        return [Prompt(f"parity/{split}/{i}", f"Say a word number {i}.", {"i": i}) for i in range(n)]

    def score(self, prompt, answer_text, data_slice="train"):
        b = answer_text.encode()[:1]
        ok = prompt.fields["i"] % 3 != 0 and bool(b) and b[0] % 2 == 0
        return Score({"core": float(ok)}, True, float(ok), ok, None)

    def score_many(self, prompts, answers, data_slice="train"):
        return [self.score(p, a, data_slice) for p, a in zip(prompts, answers)]


def make_env() -> ParityEnv:
    return ParityEnv()
