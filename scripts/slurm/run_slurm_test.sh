#!/bin/bash
# Test the sbatch launcher under a real, single-node Slurm started just for this test.
#
#   sudo scripts/slurm/run_slurm_test.sh [--mode auto|smoke|train] [--keep]
#
# It installs Debian's slurm-wlm and munge when they are missing, writes a private slurm.conf
# for this host, starts its own munged, slurmctld and slurmd (private socket, ports and state
# folder, so a Slurm already on the host is left alone), submits jobs with sbatch and checks them:
#   smoke  `srun hostname` on 4 tasks, then scripts/launch/slurm_train.sbatch running a 4-rank
#          gloo all-reduce in both launch modes (torchrun rendezvous and srun + SLURM_* env);
#   train  scripts/launch/slurm_train.sbatch training CONFIG (default configs/gpt-tiny-cpu.yaml)
#          on 4 CPU ranks; the metrics file must show a falling loss.
# auto (default) runs smoke, then train when megatron_charm.train is importable.
# The daemons are stopped and the scratch folder removed at exit (--keep keeps the folder).
#
# Environment: PYTHON (default: the repository's .venv, else python3), CONFIG, NCPUS (CPUs the
# Slurm node advertises; default max(nproc, 8)), JOB_TIMEOUT (seconds per job, default 1800),
# SLURM_TEST_PORT (slurmctld port; slurmd uses the next one; default 16817), TRAIN_LAUNCH_MODES
# (launch modes of the training job, default "torchrun srun").
set -euo pipefail

MODE=auto
KEEP=0
while [[ $# -gt 0 ]]; do
    case $1 in
    --mode) MODE=${2:?--mode needs a value}; shift 2 ;;
    --keep) KEEP=1; shift ;;
    -h | --help) sed -n "2,19p" "$0"; exit 0 ;;
    *) echo "error: unknown argument '$1'; see --help" >&2; exit 2 ;;
    esac
done
case $MODE in auto | smoke | train) ;; *)
    echo "error: --mode '$MODE' is unknown; use auto, smoke or train" >&2; exit 2 ;;
esac
if [[ $(id -u) -ne 0 ]]; then
    echo "error: run as root (it installs packages and starts Slurm daemons)" >&2
    exit 2
fi

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
if [[ -z ${PYTHON:-} ]]; then
    if [[ -x $REPO/.venv/bin/python ]]; then PYTHON=$REPO/.venv/bin/python; else PYTHON=python3; fi
fi
CONFIG=${CONFIG:-configs/gpt-tiny-cpu.yaml}
NCPUS=${NCPUS:-$(( $(nproc) > 8 ? $(nproc) : 8 ))}
JOB_TIMEOUT=${JOB_TIMEOUT:-1800}
TRAIN_LAUNCH_MODES=${TRAIN_LAUNCH_MODES:-torchrun srun}
PORT=${SLURM_TEST_PORT:-16817}
NODE=$(hostname -s)
T_START=$SECONDS
log() { echo "[slurm-test +$((SECONDS - T_START))s] $*"; }

# --- packages -------------------------------------------------------------------------------
T0=$SECONDS
if ! dpkg -s slurm-wlm munge >/dev/null 2>&1; then
    log "installing slurm-wlm and munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi
T_INSTALL=$((SECONDS - T0))
log "packages ready (${T_INSTALL}s)"

# --- scratch folder and cleanup -------------------------------------------------------------
WORK=$(mktemp -d -t megatron-charm-slurm.XXXXXX)
PIDS=()
cleanup() {
    local rc=$?
    set +e
    [[ -n ${SLURM_CONF:-} ]] && scancel --quiet --user=root >/dev/null 2>&1
    for pidfile in "$WORK/slurmd.pid" "$WORK/slurmctld.pid" "$WORK/munged.pid"; do
        [[ -f $pidfile ]] && kill "$(cat "$pidfile")" 2>/dev/null
    done
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null; done
    sleep 1
    if [[ $KEEP -eq 1 || $rc -ne 0 ]]; then
        log "logs kept in $WORK"
    else
        rm -rf "$WORK"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
mkdir -p "$WORK/state" "$WORK/spool" "$WORK/jobs"
chmod 700 "$WORK"

# --- munge: a private key and socket --------------------------------------------------------
T0=$SECONDS
dd if=/dev/urandom of="$WORK/munge.key" bs=1024 count=1 status=none
chmod 400 "$WORK/munge.key"
/usr/sbin/munged --force --key-file="$WORK/munge.key" --socket="$WORK/munge.socket" \
    --pid-file="$WORK/munged.pid" --log-file="$WORK/munged.log" --seed-file="$WORK/munged.seed"
for _ in $(seq 50); do [[ -S $WORK/munge.socket ]] && break; sleep 0.2; done
munge --socket="$WORK/munge.socket" -n | unmunge --socket="$WORK/munge.socket" >/dev/null
log "munged up"

# --- slurm.conf for this host ---------------------------------------------------------------
export SLURM_CONF=$WORK/slurm.conf
cat >"$SLURM_CONF" <<CONF
ClusterName=charmtest
SlurmctldHost=$NODE
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$WORK/munge.socket
CredType=cred/munge
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd.pid
SlurmctldLogFile=$WORK/slurmctld.log
SlurmdLogFile=$WORK/slurmd.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$NCPUS State=UNKNOWN
PartitionName=test Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
CONF

/usr/sbin/slurmctld -f "$SLURM_CONF"
/usr/sbin/slurmd -f "$SLURM_CONF" -N "$NODE"
state=""
for _ in $(seq 60); do
    state=$(sinfo -h -n "$NODE" -o %t 2>/dev/null || true)
    [[ $state == idle ]] && break
    sleep 1
done
if [[ $state != idle ]]; then
    log "node state is '$state', not idle; slurmctld.log:"
    tail -n 20 "$WORK/slurmctld.log" "$WORK/slurmd.log" >&2
    exit 1
fi
T_DAEMONS=$((SECONDS - T0))
log "slurmctld and slurmd up, node $NODE idle with $NCPUS CPUs (${T_DAEMONS}s)"

# --- jobs -----------------------------------------------------------------------------------
# submit NAME [sbatch options] SCRIPT [args]: run a job to completion, print its output.
# Polls every second: `sbatch --wait` backs off to long sleeps and adds half a minute per job.
submit() {
    local name=$1 t0=$SECONDS job state="" info
    shift
    job=$(sbatch --parsable --job-name="$name" --chdir="$REPO" \
        --output="$WORK/jobs/$name.out" "$@")
    job=${job%%;*}
    while (( SECONDS - t0 < JOB_TIMEOUT )); do
        info=$(scontrol show job -o "$job")
        state=$(sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p' <<<"$info")
        case $state in PENDING | CONFIGURING | RUNNING | COMPLETING | SUSPENDED) sleep 1 ;; *) break ;; esac
    done
    if (( SECONDS - t0 >= JOB_TIMEOUT )); then
        scancel "$job"
        state="TIMEOUT (after ${JOB_TIMEOUT}s)"
    fi
    sed "s/^/    [$name] /" "$WORK/jobs/$name.out" 2>/dev/null | tail -n 40
    log "job $name ($job) ended $state in $((SECONDS - t0))s"
    [[ $state == COMPLETED ]]
}

HAVE_TRAIN=0
if (cd "$REPO" && "$PYTHON" -c "import megatron_charm.train" 2>/dev/null); then
    HAVE_TRAIN=1
    if [[ ! -f $REPO/$CONFIG ]]; then
        # The trainer embeds its default config; write it out so the launchers get a file.
        log "$CONFIG not found; using the trainer's embedded default config"
        (cd "$REPO" && "$PYTHON" -m megatron_charm.train --print-config) >"$WORK/config.yaml"
        CONFIG=$WORK/config.yaml
    fi
fi

LAUNCHER=scripts/launch/slurm_train.sbatch
T0=$SECONDS
if [[ $MODE != train ]]; then
    printf 'purpose: slurm smoke test\n' >"$WORK/smoke.yaml"
    submit hostnames --ntasks=4 --wrap="srun hostname"
    if [[ $(grep -c "^$NODE" "$WORK/jobs/hostnames.out") -ne 4 ]]; then
        echo "error: expected 4 lines '$NODE' from srun hostname" >&2
        exit 1
    fi
    for launch in torchrun srun; do
        if [[ $launch == torchrun ]]; then
            opts=(--nodes=1 --ntasks-per-node=1 --cpus-per-task=4)
        else
            opts=(--nodes=1 --ntasks-per-node=4 --cpus-per-task=1)
        fi
        LAUNCH_MODE=$launch NPROC_PER_NODE=4 PYTHON=$PYTHON \
            TRAIN_SCRIPT=scripts/slurm/allreduce_check.py \
            submit "allreduce-$launch" "${opts[@]}" "$LAUNCHER" "$WORK/smoke.yaml"
        if ! grep -q "ALLREDUCE OK world_size=4" "$WORK/jobs/allreduce-$launch.out"; then
            echo "error: the $launch all-reduce job did not report ALLREDUCE OK" >&2
            exit 1
        fi
    done
    if [[ $HAVE_TRAIN -eq 1 ]]; then
        # Megatron-LM needs GPUs; a stand-in pretrain_gpt.py checks the launcher's environment
        # and that the config arrives as Megatron-LM flags.
        mkdir -p "$WORK/megatron-lm"
        cp "$REPO/scripts/slurm/allreduce_check.py" "$WORK/megatron-lm/pretrain_gpt.py"
        for launch in torchrun srun; do
            if [[ $launch == torchrun ]]; then
                opts=(--nodes=1 --ntasks-per-node=1 --cpus-per-task=4)
            else
                opts=(--nodes=1 --ntasks-per-node=4 --cpus-per-task=1)
            fi
            LAUNCH_MODE=$launch NPROC_PER_NODE=4 PYTHON=$PYTHON MEGATRON_LM=$WORK/megatron-lm \
                submit "megatron-$launch" "${opts[@]}" \
                scripts/launch/slurm_megatron.sbatch "$CONFIG" data.kind=mock
            out=$WORK/jobs/megatron-$launch.out
            if ! grep -q "ALLREDUCE OK world_size=4" "$out" ||
                ! grep -q "arguments: .*--context-parallel-size 4 --cp-comm-type charm" "$out"; then
                echo "error: the $launch Megatron-LM launcher job did not pass" >&2
                exit 1
            fi
        done
    fi
    log "smoke jobs passed"
fi
T_SMOKE=$((SECONDS - T0))

T0=$SECONDS
skip_train() {
    # In auto mode a missing piece skips the training job; in train mode it fails the test.
    if [[ $MODE == train ]]; then echo "error: $*" >&2; exit 1; fi
    log "training job skipped: $*"
}
if [[ $MODE != smoke ]]; then
    if [[ $HAVE_TRAIN -eq 0 ]]; then
        skip_train "megatron_charm.train is not importable with $PYTHON"
    else
        for launch in $TRAIN_LAUNCH_MODES; do
            if [[ $launch == torchrun ]]; then
                opts=(--nodes=1 --ntasks-per-node=1 --cpus-per-task=4)
            else
                opts=(--nodes=1 --ntasks-per-node=4 --cpus-per-task=1)
            fi
            LAUNCH_MODE=$launch NPROC_PER_NODE=4 PYTHON=$PYTHON \
                submit "train-$launch" "${opts[@]}" "$LAUNCHER" "$CONFIG" \
                "run.dir=$WORK/run-$launch"
            "$PYTHON" "$REPO/scripts/slurm/check_metrics.py" "$WORK/run-$launch"
        done
        log "training jobs passed"
    fi
fi
T_TRAIN=$((SECONDS - T0))

log "timings: install ${T_INSTALL}s, daemons ${T_DAEMONS}s, smoke jobs ${T_SMOKE}s," \
    "training jobs ${T_TRAIN}s, total $((SECONDS - T_START))s"
echo "SLURM TEST PASSED"
