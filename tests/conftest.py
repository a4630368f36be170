import os
from pathlib import Path

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


# The folders whose tests run tiny models at most: each of their tests gets the `one_thread` mark
# (one_thread_for_tiny_models below). A module elsewhere opts in with `pytestmark = pytest.mark.one_thread`.
TESTS = Path(__file__).parent
ONE_THREAD_FOLDERS = ("cuda_emu", "cuda_trace", "integrations", "models", "plan", "rollout")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.is_relative_to(TESTS) and item.path.relative_to(TESTS).parts[0] in ONE_THREAD_FOLDERS:
            item.add_marker(pytest.mark.one_thread)
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
    Tests marked slow (the real model) keep the default thread count. Every test marked
    `one_thread` gets it (_one_thread_where_marked); a test may also request it by name."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _one_thread_where_marked(request, _seed):
    """The one-thread default, in one place: after _seed (which sets the worker's thread count)."""
    if request.node.get_closest_marker("one_thread"):
        request.getfixturevalue("one_thread_for_tiny_models")


@pytest.fixture(scope="module")
def smollm2():
    """The bundled SmolLM2-135M-Instruct as `fasttrain run` loads it: (model, tokenizer), loaded once
    per test module (tests that use it are marked slow)."""
    from fasttrain.models import load_policy
    return load_policy()


@pytest.fixture(scope="module")
def smollm2_fp32():
    """The same in float32 (the plan's measured-peak test)."""
    from fasttrain.models import load_policy
    return load_policy(None, dtype=torch.float32)
