import os

import pytest
import torch
from hypothesis import settings

# `make test` runs the suite in pytest-xdist workers (-n 2); each worker takes an equal share of the
# cores for torch's intra-op threads (2 workers on 2 cores: one thread each), so the workers do not
# oversubscribe the machine. Tests that need more threads set them themselves and restore them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
_WORKER_THREADS = max(1, len(os.sched_getaffinity(0)) // _WORKERS) if _WORKERS else None
if _WORKER_THREADS:
    torch.set_num_threads(_WORKER_THREADS)

# torch.compile's on-disk cache (inductor's compiled C++ kernels) is kept per ATen capability and
# thread count. On a 2-core AMX Xeon, tests/ops/test_fused_logprob.py's inductor test, run outside
# xdist (two threads) after `make test` (one thread a worker, then the numeric tests again under
# lower ATEN_CPU_CAPABILITY), gave wrong gradients or aborted with the shared cache and passed with
# a fresh one. Which of the two the cache's key misses was not isolated; keying on both covers it.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import tempfile
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"fasttrain-tests-inductor-{os.getuid()}",
        f"{os.environ.get('ATEN_CPU_CAPABILITY', 'host')}-t{torch.get_num_threads()}")

# hypothesis' default deadline (200 ms per example) is a wall-clock bound: a loaded machine fails it
# with correct code. No example has a deadline here; speed is measured in bench/.
settings.register_profile("fasttrain", deadline=None)
settings.load_profile("fasttrain")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    if _WORKER_THREADS:       # a test that set run.threads (the trainer keeps it) does not pass it on
        torch.set_num_threads(_WORKER_THREADS)


@pytest.fixture
def one_thread_for_tiny_models(request):
    """Tiny-model tests run thousands of microsecond ops; on a shared 2-core box, OpenMP's
    second thread turns each into a wait (measured: 2.1 s vs 0.06 s for one sample call).
    Tests marked slow (the real model) keep the default thread count. A directory opts in
    with an autouse fixture in its conftest.py that requests this one."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
