"""fasttrain.envs — verifiers that turn (prompt, answer text) into named reward channels.

Public API (what the trainer consumes):

    Channel(name, priority=1.0, description="")        one reward channel; priority = GDPO weight
    Prompt(id, spec, fields={})                         spec = text shown to the model
    Score(channels: dict[str, float], valid: bool, core: float, success: bool, reason: str | None)
        success = core > 0 (above break-even; the prompt filter's pass/fail)
        invalid answers: valid=False, core=INVALID_CORE (-1.0), reason says why
    Environment (Protocol):
        .name: str
        .channels: list[Channel]                 ordered; every Score has exactly these keys
        .data_slices: tuple[str, ...]            A: ("train", "holdout"); B: ("slice0".."slice3")
        .answer_format: str                      how the model must format its answer
        .prompts(split) -> list[Prompt]          split: "train" (500) or "probe" (50 unseen)
        .score(prompt, answer_text, data_slice="train") -> Score
        .score_many(prompts, answers, data_slice="train") -> list[Score]
    load_env(spec, **kwargs) -> Environment     (fasttrain.tasks.load_env: the same, and the built-in
                                                 tasks' names: "signal-a", "signal-b")
        "dataset", dataset=, rewards=, ...       a prompt dataset scored by reward functions in
                                                 TRL's signature (fasttrain.envs.dataset)
        "package.module:factory"                 plug-in, wrapped in GuardedEnvironment: a
                                                 raising verifier, wrong/missing channel or
                                                 non-finite value gives an invalid Score
    The signal task's SignalEnvironment also takes `record=False` in score/score_many (probes and
    evaluation: do not add answers to the novelty archive).

The signal task's channels and priorities (formulas in fasttrain.tasks.signal.env): core 3.0,
stability 1.0, action_cost 1.0, secondary 1.0, complexity 0.2, format 1.0, syntax 1.0,
novelty 1.0, neutrality 1.0, min_activity 1.0, pattern_guard 0.3, stress 1.0.
Format and syntax give partial credit (tags present; tokenizes / parses / within limits) so a
weak policy sees a gradient before its first valid answer. Model output is parsed by
fasttrain.tasks.signal.lang and never executed.

Example plug-in (tests/support/toy_plugin.py is a full one):

    from fasttrain.envs import Channel, Prompt, Score
    class Echo:
        name, data_slices, answer_format = "echo", ("train",), "Answer with one word."
        channels = [Channel("core", 3.0, "1 if the answer repeats the prompt")]
        def prompts(self, split): return [Prompt("echo/0", "say hi")]
        def score(self, prompt, answer, data_slice="train"):
            ok = answer.strip() == "hi"
            return Score({"core": float(ok)}, True, float(ok), ok, None)
        def score_many(self, ps, as_, data_slice="train"):
            return [self.score(p, a, data_slice) for p, a in zip(ps, as_)]
    env = load_env("mypkg.envs:Echo")
"""

from .plugin import BUILTINS, GuardedEnvironment, load_env
from .protocol import INVALID_CORE, Channel, Environment, Prompt, Score, check_score, invalid_score

__all__ = ["BUILTINS", "INVALID_CORE", "Channel", "Environment", "GuardedEnvironment", "Prompt",
           "Score", "check_score", "invalid_score", "load_env"]
