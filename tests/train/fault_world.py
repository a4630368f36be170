"""Environments whose scoring misbehaves deterministically, for the kill-and-resume tests.

`flaky_env`: the tiny letter environment whose batch verifier raises whenever the batch's answers
have an odd total length (the wrapper then scores them one by one and counts the failure).
`novelty_env`: a stateful plug-in (its score_many takes `record`): an answer seen before in
training scores 0.5 less, and its batch verifier fails as the flaky one does."""
from __future__ import annotations

from tiny_world import LetterEnv

from fasttrain.envs import Score


def _odd(answers) -> bool:
    return sum(len(a) for a in answers) % 2 == 1


class FlakyBatchEnv(LetterEnv):
    name = "flaky-letters"

    def score_many(self, prompts, answers, data_slice="train"):
        if len(answers) > 1 and _odd(answers):
            raise RuntimeError("odd batch")
        return [self.score(p, a, data_slice) for p, a in zip(prompts, answers)]


class NoveltyEnv(LetterEnv):
    name = "novel-letters"

    def __init__(self):
        self.seen: set[str] = set()

    def score_many(self, prompts, answers, data_slice="train", record=True):
        if len(answers) > 1 and _odd(answers):
            raise RuntimeError("odd batch")
        out = []
        for p, a in zip(prompts, answers):
            s = self.score(p, a, data_slice)
            if a in self.seen and s.valid:
                core = s.core - 0.5
                s = Score({**s.channels, "core": core}, True, core, core > 0, None)
            if record:
                self.seen.add(a)
            out.append(s)
        return out


def flaky_env() -> FlakyBatchEnv:
    return FlakyBatchEnv()


def novelty_env() -> NoveltyEnv:
    return NoveltyEnv()
