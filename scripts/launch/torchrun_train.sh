#!/bin/bash
# Train with megatron-charm-train under torchrun on this node (or one node of a multi-node job).
#
#   scripts/launch/torchrun_train.sh [--nproc N] [--dry-run] CONFIG [section.key=value ...]
#
# CONFIG is a YAML config such as configs/gpt-tiny-cpu.yaml; overrides are passed on unchanged.
#
# Environment:
#   NPROC_PER_NODE  ranks on this node when --nproc is not given (default: GPU count, else 4)
#   NNODES          nodes in the job (default 1). With NNODES > 1 run this script once per node
#                   with the same MASTER_ADDR:MASTER_PORT; torchrun joins them by c10d rendezvous.
#   MASTER_ADDR, MASTER_PORT, RDZV_ID   rendezvous endpoint and job id (multi-node only)
#   PYTHON          interpreter with megatron-charm installed (default: python3)
set -euo pipefail

usage() { sed -n '2,15p' "$0" >&2; exit 2; }
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
if [[ ! -f $CONFIG ]]; then
    echo "error: config file '$CONFIG' not found" >&2
    exit 2
fi
if [[ -z $NPROC ]]; then
    gpus=$(nvidia-smi -L 2>/dev/null | wc -l || true)
    NPROC=$(( gpus > 0 ? gpus : 4 ))
fi
if ! [[ $NPROC =~ ^[1-9][0-9]*$ ]]; then
    echo "error: --nproc '$NPROC' must be a positive integer" >&2
    exit 2
fi

NNODES=${NNODES:-1}
if [[ $NNODES -gt 1 ]]; then
    : "${MASTER_ADDR:?set MASTER_ADDR to the first node for a multi-node run}"
    RDZV=(--nnodes="$NNODES" --rdzv-backend=c10d --rdzv-id="${RDZV_ID:-megatron-charm}"
          --rdzv-endpoint="$MASTER_ADDR:${MASTER_PORT:-29500}")
else
    RDZV=(--standalone)
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

CMD=("${PYTHON:-python3}" -m torch.distributed.run "${RDZV[@]}" --nproc-per-node="$NPROC"
     --module megatron_charm.train --config "$CONFIG" "$@")
if [[ $DRY_RUN -eq 1 ]]; then
    printf '%q ' "${CMD[@]}"
    echo
    exit 0
fi
exec "${CMD[@]}"
