"""The emulator itself: it refuses what the hardware refuses, hangs on or leaves undefined, and it
accepts the correct twin of each broken kernel (fixtures in csrc/cuda_emu/fixtures.cpp)."""
from __future__ import annotations

import math

import pytest
import torch

from cuda_emu.emulator import emu, module, use_schedule

pytestmark = pytest.mark.cuda_emu

REFUSED = {
    "divergent_shuffle": "exits while its warp waits|has exited|different warp intrinsics|deadlock",
    "read_outside_mask": "not in the mask",
    "divergent_barrier": "different __syncthreads",
    "mask_names_missing_lanes": "lanes this block does not have",
    "exit_while_awaited": "exits while its warp waits|has exited",
    "too_much_dynamic_shared": "too much dynamic shared memory",
    "empty_grid": "empty grid",
    "threads_1025": "more than 1024 threads",
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_the_emulator_refuses_a_broken_kernel(name, every_schedule):
    with pytest.raises(RuntimeError, match=REFUSED[name]):
        emu().fixture(name)


def test_the_correct_twins_pass(every_schedule):
    assert emu().fixture("block_sum")[0].item() == 1000.0
    assert torch.equal(emu().fixture("rotate")[:64], torch.ones(64))
    lanes = emu().fixture("read_inside_mask")[:32]
    assert lanes.tolist() == [float(i ^ 8) for i in range(16)] + [float(i) for i in range(16, 32)]


def test_a_missing_barrier_reads_the_poison_of_static_shared_memory():
    # Thread 0 runs ahead of the other warps: their slots still hold 0xFF (NaN) from the block's start.
    with use_schedule("forward"):
        assert math.isnan(emu().fixture("block_sum_without_barrier")[0].item())
    with use_schedule("forward"):
        assert emu().fixture("block_sum")[0].item() == 1000.0


def test_a_missing_barrier_reads_the_poison_of_dynamic_shared_memory():
    # Without a barrier each thread runs to its end before the next starts: in order, thread t reads
    # slot t + 1 before thread t + 1 wrote it; in reverse, only thread 63 reads an unwritten slot (0).
    with use_schedule("forward"):
        out = emu().fixture("rotate_without_barrier")[:64]
    assert bool(out[:63].isnan().all()) and out[63].item() == 1.0
    with use_schedule("reverse"):
        out = emu().fixture("rotate_without_barrier")[:64]
    assert bool(out[:63].eq(1).all()) and math.isnan(out[63].item())


def test_counters_count_the_fibers_switched():
    m = module()
    m.reset_counters()
    emu().fixture("block_sum")
    c = m.counters()
    assert c["launches"] == 1 and c["blocks"] == 1 and c["barriers"] == 1
    assert c["warp_ops"] == 8 * 5  # 8 warps x 5 butterfly steps
    assert c["switches"] >= 256


def test_grid_stride_launches_get_the_tests_grid_cap():
    """The tests cap grid-stride launches at GRID_CAP blocks (a GPU's cap is 8 x 65,535), so that a
    kernel over more than GRID_CAP blocks of items runs its grid-stride loop more than once."""
    from cuda_emu.emulator import GRID_CAP
    m = module()
    assert m.grid_cap() == GRID_CAP
    code = torch.linspace(-1, 1, 256)
    q, absmax = emu().blockwise8_quantize(torch.randn(5000), code, 256)
    m.reset_counters()
    out = emu().blockwise8_dequantize(q, absmax, code, 256)  # 5,000 items: 20 blocks of 256 uncapped
    assert m.counters()["blocks"] == GRID_CAP and out.shape == (5000,) and not bool(out.isnan().any())
    with pytest.raises(RuntimeError, match="set_grid_cap"):
        m.set_grid_cap(0)
    assert m.grid_cap() == GRID_CAP
