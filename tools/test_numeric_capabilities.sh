#!/usr/bin/env bash
# Reruns the numeric tests (tests/ops, tests/nn, tests/rl) under every PyTorch CPU kernel set that
# this host supports below its own best one, where fasttrain's CPU kernels of the same level run. `make test` runs the whole suite once at the host's
# best set (AVX-512 or AVX2 on current x86-64); this script adds the others, so a tolerance that
# only holds for one ISA's kernels fails on the developer's own machine, not first on a user's.
# tests/ops/test_cpu_variants.py is left out: it forces each capability in processes of its own.
#   usage: tools/test_numeric_capabilities.sh PYTHON [pytest args...]
set -euo pipefail
py=${1:?usage: $0 PYTHON [pytest args...]}
shift
best=$("$py" -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')
# PyTorch's kernel sets on x86-64, lowest first; ATEN_CPU_CAPABILITY picks one at start-up.
order=(DEFAULT AVX2 AVX512)
case " ${order[*]} " in
  *" $best "*) ;;
  *) echo "CPU kernel set $best is not an x86-64 one; numeric tests ran once, under it"; exit 0 ;;
esac
status=0
for cap in "${order[@]}"; do
  [ "$cap" = "$best" ] && break
  got=$(ATEN_CPU_CAPABILITY=${cap,,} "$py" -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')
  if [ "$got" != "$cap" ]; then
    echo "ATEN_CPU_CAPABILITY=${cap,,} gave $got; expected $cap" >&2
    exit 1
  fi
  # fasttrain's CPU kernels follow: the variant of that level runs (a -march=native build has one)
  variant=$(ATEN_CPU_CAPABILITY=${cap,,} "$py" -c 'from fasttrain._native import build_info; print(build_info()["cpu_variant"])')
  if [ "$variant" != "${cap,,}" ] && [ "$variant" != native ]; then
    echo "ATEN_CPU_CAPABILITY=${cap,,} runs fasttrain's $variant CPU kernels; expected ${cap,,}" >&2
    exit 1
  fi
  echo "== numeric tests under ATEN_CPU_CAPABILITY=${cap,,}, fasttrain's $variant CPU kernels (host best: ${best,,}) =="
  # torch.compile's inductor cache does not key on ATEN_CPU_CAPABILITY: a kernel cached by a run at
  # another capability fails to compile against this one's headers, so each run gets its own cache.
  inductor_cache=$(mktemp -d)
  TORCHINDUCTOR_CACHE_DIR=$inductor_cache ATEN_CPU_CAPABILITY=${cap,,} \
    "$py" -m pytest -q -p no:cacheprovider --ignore=tests/ops/test_cpu_variants.py "$@" tests/ops tests/nn tests/rl \
    || status=$?
  rm -rf "$inductor_cache"
done
exit $status
