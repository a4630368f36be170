import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(request):
    """Tiny-model tests run thousands of microsecond ops; on a shared 2-core box, OpenMP's
    second thread turns each into a wait (measured: 2.1 s vs 0.06 s for one sample call).
    Tests marked slow (the real model) keep the default thread count."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
