#!/usr/bin/env bash
# The one-GPU check of megatron-charm (sized for well under 10 minutes on one H200): versions, the
# block-kernel matrix against float64 (forward and merged-lse backward), the merge, kernel speed,
# and cp_attention on a one-rank group. Writes its JSON report after every check and exits
# non-zero on any failure (2: no CUDA for --device cuda).
#
#   scripts/gpu_check.sh [--json out.json] [--device cpu] [more options, see --help]
#
# --device cpu runs the same kernel checks on the CPU kernels (and gloo for cp1).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
args=("$@")
[[ " $* " == *" --json "* ]] || args+=(--json gpu_check.json)
if [[ " $* " != *" --device cpu "* ]]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 600 "$PY" -m megatron_charm.bench.gpu_check \
    "${args[@]}"
