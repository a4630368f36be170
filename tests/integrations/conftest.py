import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tiny_grpo.py, logprob_reference.py

# DEVELOPMENT ONLY, removed once fasttrain.ops.fused_logprob lands on main: give fasttrain.ops the stand-in.
import fasttrain.ops  # noqa: E402

if not hasattr(fasttrain.ops, "fused_logprob"):
    from logprob_reference import standin_fused_logprob

    fasttrain.ops.fused_logprob = standin_fused_logprob


import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    # The tiny model's ops are microseconds long: on a shared 2-core box, one thread is 3x faster than two.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
