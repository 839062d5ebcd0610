#!/usr/bin/env bash
# Create a Cloud TPU VM or pod slice (directly, or through a queued resource).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() {
  cat <<'EOF'
Usage: tpu/create.sh --name NAME --zone ZONE --type ACCELERATOR_TYPE [options]

Create a Cloud TPU VM (one host) or pod slice (several hosts, one VM per host).
Billing runs from creation until tpu/delete.sh, whether or not anything runs.

  --name NAME          TPU name (lower-case letters, digits, '-')
  --zone ZONE          zone that offers the type, e.g. us-west4-a (v5e), us-east5-a (v5p),
                       us-central2-b (v4)
  --type TYPE          accelerator type, e.g. v5litepod-8 (v5e, 8 chips, 1 host),
                       v5p-8 (4 chips, 1 host), v4-32 (16 chips, 4 hosts), v6e-8
                       (also accepted as --accelerator-type)
  --version VERSION    TPU runtime (software) version; default by type:
                       v5litepod-*: v2-alpha-tpuv5-lite, v5p-*: v2-alpha-tpuv5,
                       v6e-*: v2-alpha-tpuv6e, v2/v3/v4-*: tpu-ubuntu2204-base
  --spot               spot capacity: much cheaper, may be preempted at any time
  --queued             ask through a queued resource (waits for capacity; the TPU
                       appears once it is ACTIVE): gcloud compute tpus queued-resources
  --project PROJECT    Google Cloud project (default: gcloud's configured project)
  --dry-run            print the commands, one per line, and run nothing
  -h, --help           this help

Example:
  tpu/create.sh --name lab-v5e --zone us-west4-a --type v5litepod-8 --spot
EOF
}

TYPE=""
VERSION=""
SPOT=0
QUEUED=0
split_eq "$@"
set -- ${ARGS[@]+"${ARGS[@]}"}
while (($#)); do
  case $1 in
    --name) need "$@"; NAME=$2; shift 2 ;;
    --zone) need "$@"; ZONE=$2; shift 2 ;;
    --type | --accelerator-type) need "$@"; TYPE=$2; shift 2 ;;
    --version) need "$@"; VERSION=$2; shift 2 ;;
    --spot) SPOT=1; shift ;;
    --queued) QUEUED=1; shift ;;
    --project) need "$@"; PROJECT=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) bad_flag "$1" ;;
  esac
done

check_required --name "$NAME" lab-v5e
check_required --zone "$ZONE" us-west4-a
check_required --type "$TYPE" v5litepod-8
check_name "$NAME"
check_zone "$ZONE"
[[ $TYPE =~ ^(v[0-9][a-z0-9]*|tpu[0-9][a-z0-9]*)-[0-9]+$ ]] ||
  die "--type '$TYPE' is not an accelerator type like v5litepod-8 or tpu7x-8"
if [[ -z $VERSION ]]; then
  case $TYPE in
    v5litepod-*) VERSION=v2-alpha-tpuv5-lite ;;
    v5p-*) VERSION=v2-alpha-tpuv5 ;;
    v6e-*) VERSION=v2-alpha-tpuv6e ;;
    v2-* | v3-* | v4-*) VERSION=tpu-ubuntu2204-base ;;
    *) die "no default runtime for --type $TYPE; pass --version (gcloud compute tpus versions list)" ;;
  esac
fi

gcloud_where
EXTRA=()
if ((SPOT)); then
  EXTRA+=(--spot)
fi
if ((QUEUED)); then
  run gcloud compute tpus queued-resources create "$NAME" "--node-id=$NAME" "${WHERE[@]}" \
    "--accelerator-type=$TYPE" "--runtime-version=$VERSION" ${EXTRA[@]+"${EXTRA[@]}"}
  ((DRY_RUN)) || note "queued; it is ready when 'gcloud compute tpus queued-resources describe" \
    "$NAME --zone=$ZONE' says ACTIVE. Then: tpu/setup.sh --name $NAME --zone $ZONE"
else
  run gcloud compute tpus tpu-vm create "$NAME" "${WHERE[@]}" \
    "--accelerator-type=$TYPE" "--version=$VERSION" ${EXTRA[@]+"${EXTRA[@]}"}
  ((DRY_RUN)) || note "next: tpu/setup.sh --name $NAME --zone $ZONE"
fi
