"""Functions for the worker-pool tests: well-behaved, raising, hanging, allocating without bound,
and forking ones."""
import asyncio
import os
import time


def add(a, b=1, *, scale=1):
    return (a + b) * scale


async def add_later(a, b):
    await asyncio.sleep(0)
    return a + b


def fails(x):
    raise ValueError(f"cannot take {x}")


def sleeps(seconds):
    time.sleep(seconds)
    return seconds


def hog(step_mb=32):
    """Allocates (and touches) memory without bound."""
    held = []
    while True:
        held.append(b"\1" * (step_mb << 20))
        time.sleep(0.005)


def fork_then(what, pid_file, seconds=3600):
    """Forks a child that writes its pid to pid_file and then hogs memory (what="hog") or sleeps;
    the parent waits for `seconds`."""
    pid = os.fork()
    if pid == 0:
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
        if what == "hog":
            hog()
        time.sleep(3600)
        os._exit(0)
    time.sleep(seconds)
    return pid


def unpicklable():
    return lambda: None


def pid():
    return os.getpid()
