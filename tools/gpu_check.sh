#!/usr/bin/env bash
# The one-call GPU check for a lent GPU: builds the extension (and the CUDA emulator) from source
# for sm_90a, runs `fasttrain selftest` (quick, then every case) so the verdict on the kernels comes
# first, prints `fasttrain info`, runs the CUDA tests, then the emulator's kernel tests with the GPU
# as the peer (the same inputs through the CUDA kernels on the CPU emulator and on the GPU, compared
# within the tests' derived bounds), the kernel benchmarks, writes logs, JSON and CSV under $OUT,
# a summary to bench/results/<device>-<date>-gpu-check.md, and prints a short table last.
# Budget: under 8 minutes. Not yet run on a GPU (no GPU has been lent to this project so far).
# Run on the device machine from the repository root:  bash tools/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
PY=${PY:-python3}
mkdir -p "$OUT"
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }
status=()

# 0. A GPU, or a loud stop: everything below needs one, and a run without it would report nothing.
if ! nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || \
   ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: NO GPU. nvidia-smi or torch.cuda.is_available() says there is no usable CUDA device here." >&2
  echo "gpu_check: run this on a machine with an NVIDIA GPU and a CUDA build of torch; nothing was checked." >&2
  exit 2
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" \
  > "$OUT/env.txt" 2>&1

# 1. Build (sm_90a only: the card in hand; CI builds sm_80 + sm_90a); in place, so the CUDA emulator
#    (fasttrain._C_emu) is built too.
if FASTTRAIN_CUDA=1 FASTTRAIN_CUDA_ARCHS=90a FASTTRAIN_NATIVE_ARCH=0 MAX_JOBS=16 \
   timeout 240 "$PY" setup.py build_ext --inplace > "$OUT/build.log" 2>&1; then
  status+=("build: ok ($(elapsed) s)")
else
  tail -40 "$OUT/build.log"; echo "BUILD FAILED after $(elapsed) s (log in \$OUT/build.log)"; exit 1
fi
# 2. The kernels against the float64 reference: the quick set (what the trainer runs before step 1;
#    it must take under 5 s here), then every case. Reports: $OUT/selftest_quick.json, selftest.json.
export FASTTRAIN_CACHE_DIR="$OUT/cache"
PYTHONPATH=python timeout 60 "$PY" -m fasttrain.selftest --device cuda --quick --json "$OUT/selftest_quick.json" \
  > "$OUT/selftest_quick.log" 2>&1
status+=("selftest --quick: rc=$? $(grep 'cases passed' "$OUT/selftest_quick.log") ($(elapsed) s)")
PYTHONPATH=python timeout 150 "$PY" -m fasttrain.selftest --device cuda --json "$OUT/selftest.json" \
  > "$OUT/selftest.log" 2>&1
status+=("selftest: rc=$? $(grep 'cases passed' "$OUT/selftest.log") ($(elapsed) s)")
grep -E '^FAIL' "$OUT/selftest.log" | head -20 > "$OUT/selftest_failing.txt"
PYTHONPATH=python "$PY" -m fasttrain.cli info > "$OUT/info.txt" 2>&1

# 3. CUDA tests (what is left of the first 6 minutes, at most 180 s).
left=$(( 360 - $(elapsed) )); left=$(( left < 180 ? left : 180 )); left=$(( left < 30 ? 30 : left ))
PYTHONPATH=python timeout "$left" "$PY" -m pytest -q -m cuda -p no:cacheprovider tests \
  --junitxml="$OUT/pytest_cuda.xml" > "$OUT/pytest_cuda.log" 2>&1
status+=("cuda tests: $(tail -1 "$OUT/pytest_cuda.log") ($(elapsed) s)")

# 3b. The emulator against the GPU: the emulator's kernel tests with FASTTRAIN_EMU_PEER=cuda, so each
#     "vs peer" comparison runs the CUDA op on the GPU on the very inputs the emulator ran (at most 90 s).
left=$(( 400 - $(elapsed) )); left=$(( left < 90 ? left : 90 )); left=$(( left < 20 ? 20 : left ))
FASTTRAIN_EMU_PEER=cuda PYTHONPATH=python timeout "$left" "$PY" -m pytest -q -m cuda_emu -p no:cacheprovider \
  tests/cuda_emu --junitxml="$OUT/pytest_emu_vs_gpu.xml" > "$OUT/pytest_emu_vs_gpu.log" 2>&1
status+=("emulator vs GPU: $(tail -1 "$OUT/pytest_emu_vs_gpu.log") ($(elapsed) s)")

# 4. Kernel benchmarks (each bounded; the step/rollout benchmarks are skipped when their peers are
#    missing on the image).
for b in bench/bench_nf4.py bench/bench_logprob.py bench/bench_policy_loss.py bench/bench_nf4_linear.py \
         bench/bench_rollout.py; do
  [ -f "$b" ] || continue
  left=$(( 460 - $(elapsed) ))
  [ "$left" -gt 20 ] || { status+=("$(basename "$b"): skipped, out of time"); continue; }
  t=$(( left < 90 ? left : 90 ))
  if (cd bench && PYTHONPATH=../python timeout "$t" "$PY" "$(basename "$b")" --csv "$OUT/bench.csv") \
      > "$OUT/$(basename "$b" .py).log" 2>&1; then
    status+=("$(basename "$b"): ok")
  else
    status+=("$(basename "$b"): FAILED rc=$? (see log)")
  fi
done

# 5. The RL step against TRL's GRPOTrainer and the rollout loop against generate (quick config:
#    1 prompt x 4 answers, 8 new tokens; skipped when trl is missing on the image).
left=$(( 470 - $(elapsed) ))
if [ "$left" -gt 60 ] && "$PY" -c "import trl, peft" 2>/dev/null; then
  if (cd bench && PYTHONPATH=../python timeout "$(( left < 240 ? left : 240 ))" "$PY" bench_step.py --quick \
      --device cuda --timeout 200 --csv "$OUT/bench.csv") > "$OUT/bench_step.log" 2>&1; then
    status+=("bench_step.py: ok")
  else
    status+=("bench_step.py: FAILED rc=$? (see log)")
  fi
else
  status+=("bench_step.py: skipped (out of time or trl/peft missing)")
fi

# 6. The plan against the step: `fasttrain plan`'s peak per phase vs torch.cuda.max_memory_allocated
#    for the same step (SmolLM2-135M's architecture, random weights, the study's 4 x 12 rows of
#    ~300 + 128 tokens); both numbers land in $OUT/plan_check_smollm2-135m.json.
left=$(( 520 - $(elapsed) ))
if [ "$left" -gt 45 ]; then
  if PYTHONPATH=python timeout "$(( left < 150 ? left : 150 ))" "$PY" tools/plan_check.py --model smollm2-135m \
      --device cuda --out "$OUT" > "$OUT/plan_check.log" 2>&1; then
    status+=("plan_check: ok ($(grep -c ratio "$OUT/plan_check.log") phases compared)")
  else
    status+=("plan_check: FAILED rc=$? (see plan_check.log)")
  fi
else
  status+=("plan_check: skipped, out of time")
fi

echo "== fasttrain GPU check: $(head -1 "$OUT/env.txt") =="
cat "$OUT/info.txt" | head -30
for s in "${status[@]}"; do echo "  $s"; done
[ -s "$OUT/selftest_failing.txt" ] && { echo "-- selftest failures"; cat "$OUT/selftest_failing.txt"; }
[ -f "$OUT/plan_check.log" ] && { echo "-- plan_check.log"; tail -6 "$OUT/plan_check.log"; }
for f in "$OUT"/bench_*.log; do [ -f "$f" ] && { echo "-- $(basename "$f")"; tail -14 "$f"; }; done
echo "total $(elapsed) s"

# The summary for the repository: bench/results/<device>-<date>-gpu-check.md.
device=$("$PY" -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-'))" 2>/dev/null || echo unknown)
report="bench/results/${device}-$(date -u +%Y-%m-%d)-gpu-check.md"
mkdir -p bench/results
{
  echo "# GPU check on ${device}, $(date -u +%Y-%m-%d)"
  echo
  echo "\`bash tools/gpu_check.sh\` ($(head -1 "$OUT/env.txt")), $(elapsed) s in all."
  echo
  for s in "${status[@]}"; do echo "- $s"; done
  if [ -s "$OUT/selftest_failing.txt" ]; then echo; echo "Selftest failures:"; echo; sed 's/^/    /' "$OUT/selftest_failing.txt"; fi
  if grep -qE "failed|error" "$OUT/pytest_emu_vs_gpu.log" 2>/dev/null; then
    echo; echo "Emulator vs GPU failures:"; echo; grep -E "^(FAILED|ERROR)" "$OUT/pytest_emu_vs_gpu.log" | head -20 | sed 's/^/    /'
  fi
  for f in "$OUT"/bench_*.log; do [ -f "$f" ] && { echo; echo "## $(basename "$f" .log)"; echo; tail -14 "$f" | sed 's/^/    /'; }; done
} > "$report"
cp "$report" "$OUT/" 2>/dev/null
echo "summary: $report"
