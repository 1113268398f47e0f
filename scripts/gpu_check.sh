#!/usr/bin/env bash
# The one-GPU check of megatron-charm, sized for well under 10 minutes on one H200 (hard limit:
# timeout 600): versions, the block-kernel matrix against float64 (forward and merged-lse
# backward), the merge, kernel speed, cp_attention on one rank (cp1) and on 4 processes sharing
# the GPU (cp4: NCCL over sockets as best effort, gloo staged through pinned memory), megatron-core
# GPTModel with CharmDotProductAttention plus 20 trainer iterations (megatron), and one CP = 4
# step's time breakdown with CUDA_DEVICE_MAX_CONNECTIONS=1 and 8 (overlap). Writes its JSON report
# after every check and exits non-zero on any failure (2: no CUDA for --device cuda).
#
#   scripts/gpu_check.sh [--json out.json] [--device cpu] [more options, see --help]
#
# --device cpu runs the same checks on the CPU kernels and gloo (the connections comparison of
# overlap is skipped there). See docs/results/gpu-check.md.
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
