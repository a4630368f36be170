#!/usr/bin/env bash
# The one-call GPU check for a lent GPU: builds the extension from source for sm_90a, runs
# `fasttrain selftest` (quick, then every case) so the verdict on the kernels comes first, prints
# `fasttrain info`, runs the CUDA tests and the kernel benchmarks, writes logs, JSON and CSV under
# $OUT and prints a short table last. Budget: under 8 minutes.
# Run on the device machine from the repository root:  bash tools/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
PY=${PY:-python3}
mkdir -p "$OUT"
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }
status=()

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" \
  > "$OUT/env.txt" 2>&1

# 1. Build (sm_90a only: the card in hand; CI builds sm_80 + sm_90a).
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

# 4. Kernel benchmarks (each bounded; the step/rollout benchmarks are skipped when their peers are
#    missing on the image).
for b in bench/bench_nf4.py bench/bench_logprob.py bench/bench_policy_loss.py bench/bench_nf4_linear.py \
         bench/bench_rollout.py; do
  [ -f "$b" ] || continue
  left=$(( 450 - $(elapsed) ))
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
