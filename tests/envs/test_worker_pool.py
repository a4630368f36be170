"""The worker pool for user code: results and failure reasons, the timeout and the memory
watchdog kill the worker's whole process group (a function that forks leaves nothing behind),
a fresh worker takes the next call, and the trainer process never runs the code."""
import os
import time
from pathlib import Path

import pytest

from fasttrain.envs.worker_pool import WorkerPool, WorkerSpecError, group_rss_mb

F = "support.pool_functions"


@pytest.fixture
def pool():
    p = WorkerPool(memory_mb=200, max_workers=2)
    yield p
    p.close()


def _gone(pid: int, within_s: float = 300.0) -> bool:
    """The process no longer runs (absent, or a zombie no one has reaped yet). A SIGKILLed process
    ends as soon as the kernel runs its exit: `within_s` only bounds a process that survived."""
    end = time.monotonic() + within_s
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.05)


def test_calls_return_values_and_reasons(pool):
    assert pool.load(f"{F}:add") == {"params": {"a": False, "b": True, "scale": True}, "var_keyword": False,
                                     "is_async": False}
    out = pool.submit(f"{F}:add", (2,), {"b": 3, "scale": 2}).result()
    assert (out.ok, out.value, out.kind) == (True, 10, "ok")
    assert pool.submit(f"{F}:add_later", (2, 5)).result().value == 7
    out = pool.submit(f"{F}:fails", ("x",)).result()
    assert (out.ok, out.kind, out.failure) == (False, "raised", "raised ValueError: cannot take x")
    out = pool.submit(f"{F}:unpicklable").result()
    assert out.kind == "raised" and out.failure.startswith("raised its result cannot be sent back")
    out = pool.submit("no_such_module_here:f").result()
    assert out.kind == "load" and "ModuleNotFoundError" in out.failure
    with pytest.raises(WorkerSpecError, match="cannot load 'no_such_module_here:f': ModuleNotFoundError"):
        pool.load("no_such_module_here:f")
    with pytest.raises(WorkerSpecError, match="must look like"):
        pool.submit("not a spec")
    assert os.getpid() not in {pool.submit(f"{F}:pid").result().value}
    assert pool.state_dict() == {"restarts": 0, "timeouts": 0, "killed_for_memory": 0}


def test_a_timeout_kills_the_worker_and_the_processes_it_forked(pool, tmp_path):
    """The first call leaves a forked child behind and returns (its deadline bounds the work, so a
    busy machine cannot fail it); the second, in the same worker, hangs past its 1 s deadline: the
    kill takes the worker's whole group, that child included."""
    child = pool.submit(f"{F}:fork_then", ("sleep", str(tmp_path / "first"), 0), timeout=600).result().value
    worker = pool.pids()
    assert len(worker) == 1 and not _gone(child, within_s=0)
    out = pool.submit(f"{F}:fork_then", ("sleep", str(tmp_path / "second")), timeout=1.0).result()
    assert (out.ok, out.kind, out.failure) == (False, "timeout", "timed out after 1 s")
    assert _gone(worker[0]) and _gone(child)
    assert pool.submit(f"{F}:add", (1, 1)).result().value == 2             # a fresh worker
    assert pool.state_dict() == {"restarts": 1, "timeouts": 1, "killed_for_memory": 0}


def test_a_worker_over_its_memory_is_killed_with_its_children(pool, tmp_path):
    out = pool.submit(f"{F}:hog", timeout=120).result()
    assert (out.ok, out.kind) == (False, "memory")
    used = float(out.failure.split()[1])
    assert used > 200 and out.failure.endswith("over env.worker_memory_mb = 200 (killed with its processes)")
    # a child that allocates is counted with its worker and killed with it
    pid_file = tmp_path / "child"
    out = pool.submit(f"{F}:fork_then", ("hog", str(pid_file)), timeout=120).result()
    assert out.kind == "memory" and _gone(int(pid_file.read_text()))
    assert pool.submit(f"{F}:add", (2, 2)).result().value == 4
    assert pool.state_dict() == {"restarts": 2, "timeouts": 0, "killed_for_memory": 2}
    assert all(group_rss_mb(p) < 200 for p in pool.pids())


def test_calls_run_side_by_side_up_to_max_workers(pool):
    jobs = [pool.submit(f"{F}:sleeps", (0.5,), timeout=30) for _ in range(2)]
    assert [j.result().value for j in jobs] == [0.5, 0.5]
    assert len(pool.pids()) == 2
    third = pool.submit(f"{F}:add", (0, 0))                  # waits for a free worker, then runs
    assert third.result().value == 0 and len(pool.pids()) == 2
