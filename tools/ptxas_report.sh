#!/usr/bin/env bash
# Register, shared-memory, stack and spill report per CUDA kernel for sm_90a (ptxas -v), from a
# separate build folder so the normal build is untouched; exits 1 when a kernel spills registers
# (the kernels with a fixed block size declare it with __launch_bounds__, so ptxas may give each
# thread up to 65536 / that many registers: a spill there means the kernel needs a smaller bound or
# fewer live values). Usage: make ptxas; PTXAS_LOG=<build log> reads an existing -Xptxas=-v log.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
log=${PTXAS_LOG:-build/ptxas.log}
mkdir -p build
if [ -z "${PTXAS_LOG:-}" ]; then
  rm -rf build/cmake-ptxas
  FASTTRAIN_CUDA=1 FASTTRAIN_CUDA_ARCHS=90a FASTTRAIN_PTXAS_VERBOSE=1 FASTTRAIN_EMU=0 FASTTRAIN_BUILD_DIR=build/cmake-ptxas \
    "$PY" setup.py build_ext --build-lib build/ptxas-lib --build-temp build/ptxas-tmp > "$log" 2>&1 \
    || { tail -30 "$log"; echo "ptxas build failed (log: $log)"; exit 1; }
fi
"$PY" - "$log" <<'PYEOF'
import re, subprocess, sys
lines = open(sys.argv[1]).read().splitlines()
rows, fn = [], None
for ln in lines:
    m = re.search(r"Compiling entry function '([^']+)' for '(sm_\w+)'", ln)
    if m:
        fn, arch = m.group(1), m.group(2); stack = spill = "0"; continue
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", ln)
    if m and fn:
        stack, spill = m.group(1), f"{m.group(2)}/{m.group(3)}"; continue
    m = re.search(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?", ln)
    if m and fn:
        rows.append((fn, arch, m.group(1), m.group(2) or "0", stack, spill)); fn = None
names = subprocess.run(["c++filt"], input="\n".join(r[0] for r in rows), capture_output=True, text=True).stdout.splitlines() if rows else []
print(f"{'kernel':70s} {'arch':7s} {'regs':>4s} {'smem':>6s} {'stack':>5s} {'spill st/ld':>11s}")
for r, name in zip(rows, names or [r[0] for r in rows]):
    short = re.sub(r"\(.*", "", name.replace("(anonymous namespace)::", ""))[:70]
    print(f"{short:70s} {r[1]:7s} {r[2]:>4s} {r[3]:>6s} {r[4]:>5s} {r[5]:>11s}")
if not rows:
    print("no kernels found in", sys.argv[1]); sys.exit(1)
spilling = [name for r, name in zip(rows, names or [r[0] for r in rows]) if r[5] != "0/0" and r[5] != "0"]
if spilling:
    print(f"{len(spilling)} kernel(s) spill registers:", *spilling, sep="\n  "); sys.exit(1)
print(f"{len(rows)} kernel instances, none spills")
PYEOF
