#!/bin/bash
# Train with patched Megatron-LM's pretrain_gpt.py under torchrun, driven by a megatron-charm
# YAML config (see docs/megatron-lm.md).
#
#   MEGATRON_LM=path/to/Megatron-LM scripts/launch/torchrun_megatron.sh [--nproc N] [--dry-run] \
#       CONFIG [section.key=value ...] [-- extra pretrain_gpt.py flags]
#
# The config is translated with `megatron-charm megatron-args`; flags after `--` are appended
# (tokenizer and data flags for a real corpus, --no-gradient-accumulation-fusion, ...).
#
# Environment:
#   MEGATRON_LM     Megatron-LM core_v0.16.1 checkout patched with `megatron-charm patch-megatron`
#   NPROC_PER_NODE  ranks on this node when --nproc is not given (default: GPU count, else 1)
#   NNODES          nodes in the job (default 1). With NNODES > 1 run this script once per node
#                   with the same MASTER_ADDR:MASTER_PORT; torchrun joins them by c10d rendezvous.
#   MASTER_ADDR, MASTER_PORT, RDZV_ID   rendezvous endpoint and job id (multi-node only)
#   PYTHON          interpreter with Megatron-LM's requirements and megatron-charm (default: python3)
set -euo pipefail

usage() { sed -n '2,19p' "$0" >&2; exit 2; }
NPROC=${NPROC_PER_NODE:-}
DRY_RUN=0
while [[ $# -gt 0 ]]; do
    case $1 in
    --nproc) NPROC=${2:?--nproc needs a number}; shift 2 ;;
    --nproc=*) NPROC=${1#--nproc=}; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) usage ;;
    -*) echo "error: unknown option '$1'" >&2; usage ;;
    *) break ;;
    esac
done
[[ $# -ge 1 ]] || usage
CONFIG=$1
shift
OVERRIDES=()
while [[ $# -gt 0 && $1 != -- ]]; do OVERRIDES+=("$1"); shift; done
[[ $# -gt 0 ]] && shift  # the "--"
EXTRA=("$@")

: "${MEGATRON_LM:?set MEGATRON_LM to your patched Megatron-LM checkout}"
if [[ ! -f $MEGATRON_LM/pretrain_gpt.py ]]; then
    echo "error: MEGATRON_LM='$MEGATRON_LM' has no pretrain_gpt.py; point it at a Megatron-LM clone" >&2
    exit 2
fi
if ! grep -q -- "megatron_charm" "$MEGATRON_LM/megatron/training/arguments.py" 2>/dev/null; then
    echo "warning: $MEGATRON_LM is not patched; run: megatron-charm patch-megatron $MEGATRON_LM" >&2
fi
if [[ ! -f $CONFIG ]]; then
    echo "error: config file '$CONFIG' not found" >&2
    exit 2
fi
if [[ -z $NPROC ]]; then
    gpus=$(nvidia-smi -L 2>/dev/null | wc -l || true)
    NPROC=$(( gpus > 0 ? gpus : 1 ))
fi
if ! [[ $NPROC =~ ^[1-9][0-9]*$ ]]; then
    echo "error: --nproc '$NPROC' must be a positive integer" >&2
    exit 2
fi

PYTHON=${PYTHON:-python3}
flags=$("$PYTHON" -m megatron_charm.cli megatron-args --lines --config "$CONFIG" \
    "${OVERRIDES[@]}")
mapfile -t MEGATRON_ARGS <<<"$flags"

NNODES=${NNODES:-1}
if [[ $NNODES -gt 1 ]]; then
    : "${MASTER_ADDR:?set MASTER_ADDR to the first node for a multi-node run}"
    RDZV=(--nnodes="$NNODES" --rdzv-backend=c10d --rdzv-id="${RDZV_ID:-megatron-charm}"
          --rdzv-endpoint="$MASTER_ADDR:${MASTER_PORT:-29500}")
else
    RDZV=(--standalone)
fi
# Megatron-LM's validate_args requires it with tensor or context parallelism before Blackwell.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

CMD=("$PYTHON" -m torch.distributed.run "${RDZV[@]}" --nproc-per-node="$NPROC"
     "$MEGATRON_LM/pretrain_gpt.py" "${MEGATRON_ARGS[@]}" "${EXTRA[@]}")
if [[ $DRY_RUN -eq 1 ]]; then
    printf 'CUDA_DEVICE_MAX_CONNECTIONS=%q ' "$CUDA_DEVICE_MAX_CONNECTIONS"
    printf '%q ' "${CMD[@]}"
    echo
    exit 0
fi
exec "${CMD[@]}"
