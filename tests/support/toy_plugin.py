"""A tiny plug-in environment for tests: guess a number. `mode` makes it misbehave on purpose."""

from __future__ import annotations

import math

from fasttrain.envs import Channel, Prompt, Score


class GuessEnv:
    name = "guess"
    data_slices = ("train",)
    answer_format = "Answer with one integer."
    channels = [Channel("core", 3.0, "1 - |guess - 7| / 7"), Channel("format", 1.0, "1 if an integer")]

    def __init__(self, mode: str = "ok"):
        self.mode = mode

    def prompts(self, split: str) -> list[Prompt]:
        return [Prompt(f"guess/{split}/0", "Guess my number (1-10).", {"target": 7})]

    def score(self, prompt: Prompt, answer_text: str, data_slice: str = "train") -> Score:
        if self.mode == "raise" or (self.mode == "raise_on_boom" and answer_text == "boom"):
            raise RuntimeError("verifier exploded")
        try:
            g = int(answer_text.strip())
        except ValueError:
            return Score({"core": -1.0, "format": 0.0}, False, -1.0, False, "not an integer")
        core = 1.0 - abs(g - prompt.fields["target"]) / 7.0
        ch = {"core": core, "format": 1.0}
        if self.mode == "missing":
            del ch["format"]
        if self.mode == "extra":
            ch["bonus"] = 1.0
        if self.mode == "nan":
            ch["format"] = math.nan
        if self.mode == "wrongtype":
            return {"core": core}  # type: ignore[return-value]
        return Score(ch, True, core, core > 0, None)

    def score_many(self, prompts, answers, data_slice="train"):
        if self.mode == "batch_raise":
            raise RuntimeError("batch verifier exploded")
        out = [self.score(p, a, data_slice) for p, a in zip(prompts, answers)]
        return out[:-1] if self.mode == "batch_short" else out


class NoveltyEnv(GuessEnv):
    """Stateful: an answer seen before scores 0 on novelty (like the signal archive); `record`."""
    name = "novelty"
    channels = [Channel("core", 3.0, "1 if new"), Channel("format", 1.0, "1")]

    def __init__(self, mode: str = "ok"):
        super().__init__(mode)
        self.seen: list[str] = []

    def score_many(self, prompts, answers, data_slice="train", record=True):
        out = [Score({"core": float(a not in self.seen), "format": 1.0}, True, float(a not in self.seen),
                     a not in self.seen, None) for a in answers]
        if record:
            self.seen.extend(answers)
        if self.mode == "batch_raise" and len(answers) > 1:
            raise RuntimeError("batch verifier exploded")
        return out


def make_env(mode: str = "ok") -> GuessEnv:
    return GuessEnv(mode)


def make_novelty_env(mode: str = "ok") -> NoveltyEnv:
    return NoveltyEnv(mode)


def broken_factory() -> object:
    return object()
