"""Checks that need the sanitized emulator (`make test-emu-asan`; skipped otherwise): a kernel that
declares its dynamic shared memory as bytes and reads doubles from it, as the gated delta kernels
did, is refused by the alignment sanitizer, while the kernels as they are pass the whole suite."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.cuda_emu,
              pytest.mark.skipif(not os.environ.get("FASTTRAIN_EMU_SANITIZED"),
                                 reason="needs the sanitized emulator (make test-emu-asan)")]

RUN_FIXTURE = """
from cuda_emu.emulator import emu
emu().fixture({name!r})
"""


def run_fixture(name: str) -> subprocess.CompletedProcess:
    code = RUN_FIXTURE.format(name=name)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}      # tests/ (pytest's pythonpath) included
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


def test_doubles_read_from_byte_aligned_shared_memory_are_refused():
    done = run_fixture("bytes_read_as_doubles")
    assert done.returncode != 0 and "misaligned address" in done.stderr, done.stderr[-2000:]


def test_the_same_kernel_shape_with_a_correct_declaration_passes():
    done = run_fixture("rotate")
    assert done.returncode == 0, done.stderr[-2000:]
