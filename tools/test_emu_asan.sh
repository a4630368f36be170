#!/usr/bin/env bash
# The CUDA emulator's tests (tests/cuda_emu) under AddressSanitizer and UBSan, alignment included:
# builds fasttrain._C_emu with -fsanitize=address,undefined in its own build folder (the normal
# build is untouched) and runs the tests with that module and the sanitizer runtimes preloaded.
# Slower than `make test` (about 2x); not part of it. Usage: make test-emu-asan
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
out=build/emu-asan
FASTTRAIN_CUDA=0 FASTTRAIN_EMU=1 FASTTRAIN_EMU_SANITIZE=1 FASTTRAIN_BUILD_DIR=build/cmake-emu-asan \
  FASTTRAIN_EMU_OUTPUT_DIR="$out" FASTTRAIN_BUILD_TARGET=_C_emu "$PY" setup.py --quiet build_ext > build/emu-asan.log 2>&1 \
  || { tail -30 build/emu-asan.log; echo "the sanitized emulator build failed (log: build/emu-asan.log)"; exit 1; }
lib=$(ls "$out"/_C_emu*.so)
preload="$(g++ -print-file-name=libasan.so) $(g++ -print-file-name=libubsan.so)"
# Leaks are the interpreter's and torch's, not the kernels'. The emulator announces its fiber switches
# to ASan (runtime.cpp); ASan still warns once that it does not fully support swapcontext.
# --capture=sys: a sanitizer report is written to file descriptor 2 and the process ends at once,
# so pytest's capture of that descriptor would swallow it (the run would exit 1 with no output).
LD_PRELOAD="$preload" ASAN_OPTIONS=detect_leaks=0:detect_stack_use_after_return=0:alloc_dealloc_mismatch=0 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 FASTTRAIN_EMU_LIB="$PWD/$lib" FASTTRAIN_EMU_SANITIZED=1 \
  PYTHONPATH=python "$PY" -m pytest -q -p no:cacheprovider --capture=sys tests/cuda_emu
