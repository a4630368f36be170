import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tiny_grpo.py, logprob_reference.py


@pytest.fixture(autouse=True)
def _one_thread():
    # The tiny model's ops are microseconds long: on a shared 2-core box, one thread is 3x faster than two.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
