#!/usr/bin/env bash
# Runs python -m grpo_jax.train on every worker of a Cloud TPU VM slice: one process per host,
# joined by jax.distributed through the slice's own metadata (no Pathways).
#
#   launch/tpu_pod.sh --project P --zone Z --name N --accelerator-type v5p-128 \
#       --config configs/qwen2_5_32b_dapo_aime.yaml --workdir /mnt/shared/runs/dapo [--set k=v ...] \
#       [--version RUNTIME] [--queued] [--spot] [--delete] [--dry-run]
#
# Steps: create the slice (or reuse it when it exists; --queued asks through a queued resource),
# copy this project to every worker, install requirements.txt and the TPU jax on all of them, start
# the train command on all workers with its output streamed here, and delete the slice afterwards
# with --delete. --workdir must be on storage every worker shares (a Filestore/NFS or gcsfuse
# mount): all hosts write their shards of each checkpoint there. --dry-run prints the exact
# commands and runs nothing.
set -euo pipefail

PROJECT="" ZONE="" NAME="" ACCELERATOR="" CONFIG="" WORKDIR="" VERSION="v2-alpha-tpuv5"
QUEUED=0 SPOT=0 DELETE=0 DRY_RUN=0
OVERRIDES=()
JAX_TPU_SPEC="jax[tpu]==0.12.0.1"  # requirements.txt's jax (tests/test_launch.py)

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --project) PROJECT="$2"; shift 2 ;;
    --zone) ZONE="$2"; shift 2 ;;
    --name) NAME="$2"; shift 2 ;;
    --accelerator-type) ACCELERATOR="$2"; shift 2 ;;
    --version) VERSION="$2"; shift 2 ;;
    --config) CONFIG="$2"; shift 2 ;;
    --workdir) WORKDIR="$2"; shift 2 ;;
    --set) OVERRIDES+=("$2"); shift 2 ;;
    --queued) QUEUED=1; shift ;;
    --spot) SPOT=1; shift ;;
    --delete) DELETE=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage 0 ;;
    *) echo "error: unknown argument $1" >&2; usage ;;
  esac
done
for required in PROJECT ZONE NAME ACCELERATOR CONFIG WORKDIR; do
  if [[ -z "${!required}" ]]; then
    flag="--$(echo "$required" | tr 'A-Z_' 'a-z-')"
    [[ "$required" == ACCELERATOR ]] && flag="--accelerator-type"
    echo "error: $flag is required" >&2; exit 2
  fi
done
if [[ ! -f "$CONFIG" ]]; then echo "error: --config $CONFIG not found" >&2; exit 2; fi

# Prints a command (quoted as it will run) and, unless --dry-run, runs it.
run() {
  printf '%q ' "$@" | sed 's/ $//'; echo
  if [[ "$DRY_RUN" == 0 ]]; then "$@"; fi
}

GCLOUD=(gcloud compute tpus tpu-vm)
WHERE=(--project="$PROJECT" --zone="$ZONE")
REMOTE_DIR="grpo_jax"

# 1. The slice: reused when it exists, else created (directly or through a queued resource).
exists=0
if [[ "$DRY_RUN" == 0 ]] && "${GCLOUD[@]}" describe "$NAME" "${WHERE[@]}" >/dev/null 2>&1; then exists=1; fi
if [[ "$exists" == 1 ]]; then
  echo "# reusing TPU $NAME"
elif [[ "$QUEUED" == 1 ]]; then
  echo "# create (skipped when $NAME exists)"
  run gcloud compute tpus queued-resources create "$NAME-qr" "${WHERE[@]}" --node-id="$NAME" \
    --accelerator-type="$ACCELERATOR" --runtime-version="$VERSION" $([[ "$SPOT" == 1 ]] && echo --spot)
  echo "# wait until the queued resource is ACTIVE"
  run gcloud compute tpus queued-resources describe "$NAME-qr" "${WHERE[@]}" --format='value(state.state)'
else
  echo "# create (skipped when $NAME exists)"
  run "${GCLOUD[@]}" create "$NAME" "${WHERE[@]}" --accelerator-type="$ACCELERATOR" --version="$VERSION" \
    $([[ "$SPOT" == 1 ]] && echo --spot)
fi

# 2. The project on every worker.
cd "$(dirname "$0")/.."
run "${GCLOUD[@]}" scp --recurse --worker=all "${WHERE[@]}" grpo_jax conversion configs launch requirements.txt \
  pyproject.toml "$NAME:$REMOTE_DIR/"

# 3. Requirements and the TPU jax on every worker.
run "${GCLOUD[@]}" ssh "$NAME" --worker=all "${WHERE[@]}" \
  --command="cd $REMOTE_DIR && python3 -m pip install --quiet -r requirements.txt '$JAX_TPU_SPEC' && python3 -m pip install --quiet --no-deps -e ."

# 4. The run on every worker (one process per host, all joined by jax.distributed), streamed here.
TRAIN="cd $REMOTE_DIR && python3 -m grpo_jax.train --config $CONFIG --workdir $WORKDIR --set distributed.auto=true"
for override in "${OVERRIDES[@]+"${OVERRIDES[@]}"}"; do TRAIN+=" --set $(printf '%q' "$override")"; done
run "${GCLOUD[@]}" ssh "$NAME" --worker=all "${WHERE[@]}" --command="$TRAIN"

# 5. Delete on request.
if [[ "$DELETE" == 1 ]]; then
  if [[ "$QUEUED" == 1 ]]; then
    run gcloud compute tpus queued-resources delete "$NAME-qr" "${WHERE[@]}" --force --quiet
  else
    run "${GCLOUD[@]}" delete "$NAME" "${WHERE[@]}" --quiet
  fi
fi
