"""Environments whose scoring misbehaves deterministically, for the kill-and-resume tests, and
`run_in_child`: a function run in a forked child (torch is imported once), its end as a status.

`flaky_env`: the tiny letter environment whose batch verifier raises whenever the batch's answers
have an odd total length (the wrapper then scores them one by one and counts the failure).
`novelty_env`: a stateful plug-in (its score_many takes `record`): an answer seen before in
training scores 0.5 less, and its batch verifier fails as the flaky one does."""
from __future__ import annotations

import os
import traceback

from support.tiny_world import LetterEnv

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


def run_in_child(fn) -> int:
    """Run fn() in a forked child: its exit status (a SystemExit's code; 1 if it raised), or minus
    the signal that killed it."""
    pid = os.fork()
    if pid == 0:                                             # pragma: no cover (the child)
        code = 0
        try:
            fn()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
