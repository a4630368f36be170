"""Tools and an environment class for the agent tests, written for TRL's GRPOTrainer (the parity
test hands this very file to TRL). Some misbehave on purpose: fail, hang, noisy, huge, die."""
import asyncio
import os
import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


async def shout(text: str) -> str:
    """Upper-case a text.

    Args:
        text: The text to shout.
    """
    await asyncio.sleep(0)
    return text.upper()


def fail(x: int) -> str:
    """Always raises.

    Args:
        x: Anything.
    """
    raise ValueError(f"bad x {x}")


def hang(x: int) -> str:
    """Never returns.

    Args:
        x: Anything.
    """
    time.sleep(3600)
    return "late"


def noisy(x: int) -> str:
    """Prints to stdout, then answers.

    Args:
        x: Anything.
    """
    print("noise on stdout " * 1000)
    return "quiet"


def huge(x: int) -> str:
    """Returns 10 MB.

    Args:
        x: Anything.
    """
    return "x" * 10_000_000


def die(x: int) -> str:
    """Kills its own process.

    Args:
        x: Anything.
    """
    os._exit(3)


class Counter:
    """An environment in TRL's protocol: count up to the row's target."""

    def reset(self, **row):
        self.n = 0
        self.target = row.get("target", 3)
        return f"Count to {self.target}."

    def increment(self, step: int) -> str:
        """Add `step` to the counter.

        Args:
            step: How much to add.
        """
        self.n += step
        return str(self.n)

    def get_reward(self) -> float:
        return float(self.n == self.target)

    def _private(self) -> None:
        raise AssertionError("never a tool")


def rewards_see_environments(completions, environments=None, **kwargs):
    """1.0 when the reward function got the environment instances (TRL passes `environments=`)."""
    return [float(environments is not None) for _ in completions]


def sees_conversation(completions, completion_ids, answer, **kwargs):
    """1.0 when the completion is a message list whose last assistant message holds the answer;
    -1.0 when it is not a message list (the reward function sees what TRL passes)."""
    out = []
    for c, a in zip(completions, answer):
        if not isinstance(c, list) or not all(isinstance(m, dict) and "role" in m for m in c):
            out.append(-1.0)
            continue
        last = [m for m in c if m["role"] == "assistant"][-1]
        out.append(1.0 if str(a) in last["content"] else 0.0)
    return out


def tool_turns(completions, **kwargs):
    """The number of tool messages in the conversation."""
    return [float(sum(m["role"] == "tool" for m in c)) for c in completions]


RECORDED = []


def record_completions(completions, **kwargs):
    """Keeps what it was given (in TRL's process: the test reads RECORDED); 0.0 each."""
    RECORDED.append([[dict(m) for m in c] if isinstance(c, list) else c for c in completions])
    return [0.0 for _ in completions]


class Flaky(Counter):
    """Counter whose reset raises for the target "boom"."""

    def reset(self, **row):
        if row.get("target") == "boom":
            raise RuntimeError("reset exploded")
        return super().reset(**row)
