#!/usr/bin/env bash
# One-GPU check of megatron-charm (under 5 minutes on one H200): block attention kernels against
# torch SDPA (parity and speed), the merge's bandwidth, and cp_attention at CP = 1 on NCCL.
# Needs CUDA; fails at once (exit 2) without it. Writes JSON to $1 (default gpu_check.json).
#
#   scripts/gpu_check.sh [out.json]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
out=${1:-gpu_check.json}
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: CUDA is not available to $PY; run this on a GPU machine with a CUDA torch" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 300 "$PY" -m megatron_charm.bench.gpu_check \
    --json "$out"
