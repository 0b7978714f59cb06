#!/usr/bin/env bash
# Build the project's real Dockerfile on the stand-in base (standin-base.sh) and run the image
# as a user does, as uid 1000 with the data at /data and the runs at /runs:
#   1. the image's CMD (bash launch.sh) trains synthetic IronGrain data with 2 CPU processes;
#   2. a SIGTERM to launch.sh mid-epoch exits 143 with a mid-epoch checkpoint, and
#      --resume auto then completes the run;
#   3. the original recipe's launcher, python -m torch.distributed.launch, trains compiled
#      (--compile on: the image has the C++ compiler inductor needs);
#   4. python -m app.predict segments the validation volumes with the run's best.pt.
# Any failure fails the script (and `make image-check`, and CI). Needs root, buildah and
# debootstrap; no Docker engine and no registry. What this cannot show (CUDA, NCCL, cuDNN, the
# real base image's own files) is bench/gpu_check.sh's, on a GPU machine.
#
# buildah runs the image with chroot isolation: `podman run` needs rlimits this kind of machine
# does not grant. --hostname localhost: torchrun's standalone rendezvous resolves the hostname,
# and the container's own name resolves nowhere (a 300 s wait).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

image=localhost/irongrain:ci
say() { printf '\n== image-check: %s\n' "$*"; }
fail() { echo "image-check: FAILED: $*" >&2; exit 1; }
t0=$SECONDS

say "stand-in base"
base=$(bash docker/ci/standin-base.sh)
echo "$base ($((SECONDS - t0)) s)"

say "build Dockerfile on $base"
t=$SECONDS
# PyPI is reached here only through this machine's CA bundle: mounted over the image's own for
# the RUN steps (pip in Debian and Ubuntu reads the system bundle), never copied into a layer.
buildah bud --isolation chroot --format docker --layers --quiet \
  --build-arg PYTORCH_IMAGE="$base" \
  -v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro \
  -f Dockerfile -t "$image" . >/dev/null
echo "built $image ($((SECONDS - t)) s)"

work=$(mktemp -d /tmp/irongrain-image-check.XXXXXX)
ctr=""
cleanup() {
  [[ -n $ctr ]] && buildah rm "$ctr" >/dev/null 2>&1
  rm -rf "$work"
}
trap cleanup EXIT
mkdir -p "$work/data" "$work/runs"
chmod 0777 "$work/data" "$work/runs"  # host folders the image's uid 1000 does not own
ctr=$(buildah from --pull-never "$image")

# One command in the image as uid 1000, with the data and runs folders mounted.
in_image() {
  buildah run --isolation chroot --hostname localhost --user 1000:1000 \
    -v "$work/data:/data" -v "$work/runs:/runs" \
    --env NPROC_PER_NODE=2 --env OMP_NUM_THREADS=1 --env TQDM_DISABLE=1 "$ctr" -- "$@"
}
checkpoint() {  # checkpoint() RUN EXPR: print EXPR of /runs/RUN/checkpoints/last.pt
  in_image python3 -c "import torch; s = torch.load('/runs/$1/checkpoints/last.pt', \
weights_only=True); print($2)"
}
# A small schedule on top of the image's own settings: tiny volumes, a tiny model.
small=(--config configs/demo.yaml --patch-size 16 32 32 --f-maps 4 --depth 3 --batch-size 1
  --samples-per-volume 4 --num-workers 0 --sw-batch-size 2)

say "synthetic data into /data (the image's datasets/make_synthetic.py)"
in_image python3 datasets/make_synthetic.py --out /data --n-train 4 --n-val 2 \
  --shape 16 48 48 --seed 0 >/dev/null

say "1. the image's CMD trains"
t=$SECONDS
mapfile -t cmd < <(buildah inspect --type image --format '{{range .Docker.Config.Cmd}}{{println .}}{{end}}' "$image" | sed '/^$/d')
[[ ${cmd[*]} == "bash launch.sh --data-root /data --output-dir /runs/irongrain" ]] \
  || fail "unexpected CMD: ${cmd[*]}"
in_image "${cmd[@]}" "${small[@]}" --epochs 2 --milestones 1 || fail "the CMD did not train"
[[ $(wc -l <"$work/runs/irongrain/metrics.jsonl") == 2 ]] || fail "CMD: not 2 epochs in metrics.jsonl"
[[ -f $work/runs/irongrain/checkpoints/best.pt ]] || fail "CMD: no best.pt"
echo "step 1 passed ($((SECONDS - t)) s)"

say "2. SIGTERM to launch.sh mid-epoch, then --resume auto"
t=$SECONDS
run=(--data-root /data --output-dir /runs/preempted "${small[@]}" --samples-per-volume 30
  --stop-check-every 2 --epochs 2 --milestones 1 --opt-level O0 --memory-format contiguous)
# config.yaml is written just before the first step: the SIGTERM lands inside epoch 1.
status=$(in_image bash -c '
  bash launch.sh "$@" & pid=$!
  for _ in $(seq 600); do [[ -f /runs/preempted/config.yaml ]] && break; sleep 0.1; done
  kill -TERM "$pid"; wait "$pid" && echo 0 || echo $?' _ "${run[@]}" | tail -1)
[[ $status == 143 ]] || fail "launch.sh exited $status after SIGTERM, not 143"
where=$(checkpoint preempted '(s["epoch"], s.get("position", {}).get("epoch"), s.get("position", {}).get("step"))')
[[ $where =~ ^\(0,\ 1,\ [1-9][0-9]*\)$ ]] || fail "last.pt is not a mid-epoch checkpoint of epoch 1: $where"
echo "exit 143, last.pt (epoch, position epoch, step) = $where"
in_image bash launch.sh "${run[@]}" --resume auto || fail "--resume auto did not complete"
[[ $(checkpoint preempted 's["epoch"]') == 2 ]] || fail "the resumed run did not reach epoch 2"
echo "step 2 passed ($((SECONDS - t)) s)"

say "3. python -m torch.distributed.launch (the original recipe's launcher), compiled"
t=$SECONDS
in_image python3 -m torch.distributed.launch --nproc_per_node=2 -m app.train \
  --data-root /data --output-dir /runs/legacy "${small[@]}" --epochs 1 --milestones 1 \
  --opt-level O0 --memory-format contiguous --compile on \
  || fail "torch.distributed.launch did not train (compiled: --compile on)"
[[ $(checkpoint legacy 's["epoch"]') == 1 ]] || fail "legacy launcher: no epoch 1 checkpoint"
echo "step 3 passed ($((SECONDS - t)) s)"

say "4. app.predict with the run's best.pt"
t=$SECONDS
in_image python3 -m app.predict --checkpoint /runs/irongrain/checkpoints/best.pt \
  --input /data/val_patches/images --output /runs/predictions --save mask \
  || fail "app.predict failed"
predicted=$(find "$work/runs/predictions" -name '*_mask.*' | wc -l)
[[ $predicted == 2 ]] || fail "app.predict wrote $predicted masks for 2 volumes"
echo "step 4 passed ($((SECONDS - t)) s)"

say "all 4 steps passed in the image built on the stand-in base ($((SECONDS - t0)) s in all)"
