#!/usr/bin/env bash
# The one launcher: `bash launch.sh [trainer flags]` on a workstation, in the container
# (`docker run --gpus all --ipc=host IMAGE bash launch.sh ...`) and in a Kubeflow PyTorchJob or
# TrainJob pod. It always runs torchrun; extra arguments go to `python -m app.train`.
#
#   PET_NNODES ... set        PyTorchJob/TrainJob: torchrun reads PET_NNODES, PET_NPROC_PER_NODE,
#                             PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT itself
#   NPROC_PER_NODE            processes on this node (default: visible GPUs, or 1 without a GPU;
#                             never "auto", which starts one process per CPU core)
#   NNODES, NODE_RANK         multi-node by hand (default 1 and 0), with MASTER_ADDR, MASTER_PORT
#   MAX_RESTARTS              elastic restarts of the whole group after a worker dies (default 0);
#                             restarted workers resume from OUTPUT_DIR/checkpoints/last.pt
#   SHUTDOWN_TIMEOUT          seconds torchrun gives the workers after passing on a SIGTERM,
#                             before SIGKILL (default 120): room for the mid-epoch checkpoint.
#                             Only torch >= 2.12's torchrun has --shutdown-timeout; an older one
#                             (the apex image's 2.8) gives a fixed 30 s, and app.launcher says so
#   PYTHON                    interpreter (default: python3, as in every image)
#
# On SIGTERM (Kubernetes preempting the pod) the trainer finishes its step, writes a mid-epoch
# checkpoint and exits; launch.sh then exits 143 (128 + 15), a code the PyTorchJob's ExitCode
# restart policy retries, as OnFailure retries any non-zero one.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

export NO_ALBUMENTATIONS_UPDATE=1 PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}
MAX_RESTARTS=${MAX_RESTARTS:-0}
SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-120}

die() { echo "launch.sh: $*" >&2; exit 2; }
is_count() { [[ $1 =~ ^[1-9][0-9]*$ ]]; }

is_count "$MAX_RESTARTS" || [[ $MAX_RESTARTS == 0 ]] \
  || die "MAX_RESTARTS must be a non-negative integer, got '$MAX_RESTARTS'"
is_count "$SHUTDOWN_TIMEOUT" \
  || die "SHUTDOWN_TIMEOUT must be a positive number of seconds, got '$SHUTDOWN_TIMEOUT'"

if [[ -n ${PET_NNODES:-} ]]; then
  # The operator injects PET_* (and, for v1, MASTER_ADDR/RANK/WORLD_SIZE of the pod, which
  # torchrun replaces with per-process values). torchrun reads PET_* as its defaults.
  for var in PET_NPROC_PER_NODE PET_NODE_RANK PET_MASTER_ADDR PET_MASTER_PORT; do
    [[ -n ${!var:-} ]] || die "PET_NNODES is set but $var is not: is this a PyTorchJob pod?"
  done
  is_count "$PET_NPROC_PER_NODE" \
    || die "PET_NPROC_PER_NODE must be a positive integer, got '$PET_NPROC_PER_NODE'"
  torchrun_args=(--max-restarts "$MAX_RESTARTS")
else
  if [[ -z ${NPROC_PER_NODE:-} ]]; then
    NPROC_PER_NODE=$("$PYTHON" -c 'import torch; print(max(torch.cuda.device_count(), 1))')
  fi
  is_count "$NPROC_PER_NODE" \
    || die "NPROC_PER_NODE must be a positive integer (not 'auto'), got '$NPROC_PER_NODE'"
  NNODES=${NNODES:-1}
  is_count "$NNODES" || die "NNODES must be a positive integer, got '$NNODES'"
  if [[ $NNODES == 1 ]]; then
    torchrun_args=(--standalone --nproc-per-node "$NPROC_PER_NODE")
  else
    [[ -n ${MASTER_ADDR:-} ]] || die "NNODES=$NNODES needs MASTER_ADDR (the rank-0 node's address)"
    NODE_RANK=${NODE_RANK:-0}
    [[ $NODE_RANK =~ ^[0-9]+$ && $NODE_RANK -lt $NNODES ]] \
      || die "NODE_RANK must be in 0..$((NNODES - 1)), got '$NODE_RANK'"
    torchrun_args=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC_PER_NODE"
      --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-29500}")
  fi
  torchrun_args+=(--max-restarts "$MAX_RESTARTS")
fi

# app.launcher drops this where the torchrun it runs has no such option (torch < 2.12).
torchrun_args+=(--shutdown-timeout "$SHUTDOWN_TIMEOUT")

# Not exec: this shell stays (PID 1 in a container) to pass a SIGTERM on to torchrun and to exit
# 128 + the signal once the workers have saved. A terminal's Ctrl-C reaches torchrun and the
# workers by itself, so SIGINT is only noted. app.launcher is torchrun, reporting a failed
# worker in one line (and its exit code) instead of a traceback.
"$PYTHON" -m app.launcher "${torchrun_args[@]}" -m app.train "$@" &
torchrun_pid=$!
stopped_by=0
trap 'stopped_by=15; kill -TERM "$torchrun_pid" 2>/dev/null || true' TERM
trap 'stopped_by=2' INT
while :; do
  status=0
  wait "$torchrun_pid" || status=$?
  kill -0 "$torchrun_pid" 2>/dev/null || break  # wait returned for a signal, not the exit
done
if ((stopped_by)); then
  exit $((128 + stopped_by))
fi
exit "$status"
