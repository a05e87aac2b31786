#!/bin/bash
# One training job over Slurm nodes: srun starts one torchrun per node, torchrun starts one
# worker per GPU, and the torchruns meet at a c10d rendezvous on the job's first node.
#
#   sbatch --nodes=4 --gpus-per-node=8 launch/slurm.sh pipelines.text2image.train \
#       --config pipelines/text2image/configs/base.yaml run.dir=/shared/runs/t2i parallel.tp=8
#
# Arguments: the pipeline's train module, then its own arguments (config, key=value overrides).
# At the time limit Slurm sends every process of the job SIGTERM and, KillWait (30 s) later, SIGKILL.
# The ranks would save the step in flight on it (train.save_on_signal), but srun gets that SIGTERM
# too and answers it by sending its tasks SIGKILL ("srun: forcing job termination"), so they may not
# get the time: ask for an early signal instead (not checked here: no Slurm on the test machines).
# `sbatch --signal=USR1@120 ...` signals the steps two minutes ahead: the ranks save and exit,
# torchrun restarts them (a restart from MAX_RESTARTS) and they resume from that checkpoint until
# the time limit. torchrun ignores SIGUSR1 here, which would otherwise end it, and srun with it the
# whole step.
# To go on past the time limit, `sbatch --signal=B:USR1@300 ...` signals this script alone: it
# sends the step's processes SIGTERM (`scancel --signal=TERM`, steps only, so srun is spared), the
# ranks save the step in flight within torchrun's 30 s, and the script requeues the job (`scontrol
# requeue`), which runs it again and resumes from that checkpoint (run.resume=auto).
# Environment knobs: NPROC_PER_NODE (default: GPUs Slurm gave each node), MASTER_PORT (29500),
# MAX_RESTARTS (3: torchrun restarts every worker after a failure; run.resume=auto then continues
# from the latest complete checkpoint), REQUEUE (1: on B:USR1 requeue after the save; 0: only
# save and stop), PYTHON (python).
#SBATCH --job-name=mmpretrain
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --output=%x-%j.out
set -euo pipefail

if [ $# -lt 1 ]; then
    echo "usage: sbatch [sbatch options] launch/slurm.sh <pipeline train module> [--config FILE] [key=value ...]" >&2
    exit 2
fi
MODULE=$1
shift

NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:?not inside a Slurm allocation (SLURM_JOB_NUM_NODES unset)}}
# SLURM_GPUS_ON_NODE is set when GPUs were requested; CPU-only allocations must say NPROC_PER_NODE.
NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:?set NPROC_PER_NODE (no GPUs in this allocation)}}
# The rendezvous store lives on the first node of the allocation, which every node can resolve.
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-29500}
MAX_RESTARTS=${MAX_RESTARTS:-3}
REQUEUE=${REQUEUE:-1}
PYTHON=${PYTHON:-python}

# Threads per worker: the task's CPUs shared by the node's workers (torchrun would otherwise set 1).
CPUS=${SLURM_CPUS_PER_TASK:-$NPROC_PER_NODE}
THREADS=$(( CPUS / NPROC_PER_NODE ))
(( THREADS >= 1 )) || THREADS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$THREADS}

# NCCL settings: printed by every run's start-up line; uncomment what the cluster needs.
# export NCCL_SOCKET_IFNAME=ib0            # interface for NCCL's bootstrap / socket transport
# export GLOO_SOCKET_IFNAME=ib0            # same for gloo (CPU collectives, checkpoint barriers)
# export NCCL_IB_HCA=mlx5                  # which InfiniBand adapters to use
# export NCCL_DEBUG=WARN                   # INFO to see rings/trees and transports at start
# export TORCH_NCCL_ASYNC_ERROR_HANDLING=1 # torchrun's default: a failed collective ends the process, so
#                                          # torchrun restarts the workers instead of hanging
# export TORCH_NCCL_DUMP_ON_TIMEOUT=1      # flight-recorder dump of the collectives when one times out
# export NCCL_CROSS_NIC=1                  # rail-optimised fabrics

echo "slurm.sh: job ${SLURM_JOB_ID:-?}: $NNODES nodes x $NPROC_PER_NODE processes, rendezvous $HEAD_NODE:$MASTER_PORT," \
     "max restarts $MAX_RESTARTS, module $MODULE"

SRUN_PID=""
STOPPED_BY_USR1=0
stop_for_requeue() {
    local after="then stopping"
    [ "$REQUEUE" = 1 ] && after="then requeueing job ${SLURM_JOB_ID:-?}"
    echo "slurm.sh: SIGUSR1 to the batch script: stopping the step (its ranks save the step in flight), $after"
    STOPPED_BY_USR1=1
    # Job steps only (not this batch step): torchrun passes SIGTERM on, and the ranks take it too.
    scancel --signal=TERM "$SLURM_JOB_ID" || echo "slurm.sh: scancel --signal=TERM $SLURM_JOB_ID failed" >&2
}
trap stop_for_requeue USR1

# --kill-on-bad-exit: a node whose torchrun gave up ends the step instead of leaving the others
# waiting. srun does not inherit sbatch's --cpus-per-task (Slurm >= 22.05): pass it on.
# In the background, so that the USR1 trap runs while the step does (bash runs traps between
# commands, and `wait` returns for one).
srun --nodes="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 ${SLURM_CPUS_PER_TASK:+--cpus-per-task=$SLURM_CPUS_PER_TASK} \
    bash -c 'trap "" USR1; exec "$@"' torchrun \
    "$PYTHON" -m torch.distributed.run \
    --nnodes="$NNODES" \
    --nproc-per-node="$NPROC_PER_NODE" \
    --rdzv-backend=c10d \
    --rdzv-endpoint="$HEAD_NODE:$MASTER_PORT" \
    --rdzv-id="${SLURM_JOB_ID:-mmpretrain}" \
    --max-restarts="$MAX_RESTARTS" \
    -m "$MODULE" "$@" &
SRUN_PID=$!
while :; do
    wait "$SRUN_PID" && rc=0 || rc=$?
    kill -0 "$SRUN_PID" 2>/dev/null || break  # still running: the wait returned for the trap
done
if [ "$STOPPED_BY_USR1" = 1 ] && [ "$REQUEUE" = 1 ]; then
    if scontrol requeue "$SLURM_JOB_ID"; then
        echo "slurm.sh: job $SLURM_JOB_ID requeued; it resumes from the latest checkpoint when it runs again"
    else
        echo "slurm.sh: scontrol requeue $SLURM_JOB_ID failed (requeueing may be off for this job or cluster):" \
             "submit the same sbatch command again to resume from the latest checkpoint" >&2
    fi
fi
exit "$rc"
