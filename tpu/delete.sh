#!/usr/bin/env bash
# Delete a Cloud TPU VM, a queued resource with its TPU, or a GPU VM: billing stops here.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() {
  cat <<'EOF_USAGE'
Usage: tpu/delete.sh --name NAME --zone ZONE [--queued | --gpu] [options]

Delete what tpu/create.sh or tpu/gpu_create.sh made, without asking (gcloud --quiet).
Fetch results first (tpu/fetch.sh): the VMs' disks go with them.

  --name NAME          TPU, queued resource or GPU VM name
  --zone ZONE          its zone
  --queued             it was created with tpu/create.sh --queued: delete the queued
                       resource and its TPU (--force)
  --gpu                it is a GPU VM from tpu/gpu_create.sh
  --project PROJECT    Google Cloud project (default: gcloud's configured project)
  --dry-run            print the commands, one per line, and run nothing
  -h, --help           this help

Example:
  tpu/delete.sh --name lab-v5e --zone us-west4-a
EOF_USAGE
}

QUEUED=0
GPU=0
split_eq "$@"
set -- ${ARGS[@]+"${ARGS[@]}"}
while (($#)); do
  case $1 in
    --name) need "$@"; NAME=$2; shift 2 ;;
    --zone) need "$@"; ZONE=$2; shift 2 ;;
    --queued) QUEUED=1; shift ;;
    --gpu) GPU=1; shift ;;
    --project) need "$@"; PROJECT=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) bad_flag "$1" ;;
  esac
done

check_required --name "$NAME" lab-v5e
check_required --zone "$ZONE" us-west4-a
check_name "$NAME"
check_zone "$ZONE"
((QUEUED + GPU < 2)) || die "--queued and --gpu do not go together"

gcloud_where
if ((QUEUED)); then
  run gcloud compute tpus queued-resources delete "$NAME" "${WHERE[@]}" --force --quiet
elif ((GPU)); then
  run gcloud compute instances delete "$NAME" "${WHERE[@]}" --quiet
  # rewritten from the instances that are left: the deleted VM's ssh alias goes with it
  if [[ -n ${PROJECT:-} ]]; then
    run gcloud compute config-ssh "--project=$PROJECT"
  else
    run gcloud compute config-ssh
  fi
else
  run gcloud compute tpus tpu-vm delete "$NAME" "${WHERE[@]}" --quiet
fi
