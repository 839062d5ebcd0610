#!/usr/bin/env bash
# Create a GPU VM on Compute Engine, ready for tpu/setup.sh --hosts and tpu/run.sh --hosts.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() {
  cat <<'EOF_USAGE'
Usage: tpu/gpu_create.sh --name NAME --zone ZONE --machine-type TYPE [options]

Create a Compute Engine VM with NVIDIA GPUs from a Deep Learning VM image (the NVIDIA
driver installs itself on first boot; jax's cuda extra brings CUDA and cuDNN), then
write an ssh alias NAME.ZONE.PROJECT for it (gcloud compute config-ssh), which is the
host to give tpu/setup.sh, tpu/run.sh and tpu/fetch.sh as --hosts.
Billing runs until tpu/delete.sh --gpu: a failure once the VM exists says so and names
the command that deletes it. Run again after such a failure: a VM that exists already is
kept and the steps after its creation run.

  --name NAME            VM name
  --zone ZONE            a zone that has the GPU, e.g. us-central1-a
  --machine-type TYPE    a3-highgpu-8g (8x H100 80GB), a2-ultragpu-1g (1x A100 80GB),
                         a2-highgpu-1g (1x A100 40GB), g2-standard-8 (1x L4): these
                         include their GPUs; an N1 type (n1-standard-8) needs --gpu
  --gpu TYPE             attach GPUs of TYPE, e.g. nvidia-tesla-t4 (N1 machine types)
  --gpu-count N          how many --gpu GPUs (default 1)
  --image-family FAMILY  default common-cu124-debian-11-py310; list others with
                         gcloud compute images list --project deeplearning-platform-release
  --image-project PROJ   default deeplearning-platform-release
  --disk-size GB         boot disk size in GB (default 200)
  --spot                 spot VM: much cheaper, may be preempted (it is then stopped)
  --project PROJECT      Google Cloud project (default: gcloud's configured project)
  --dry-run              print the commands, one per line, and run nothing
  -h, --help             this help

Example:
  tpu/gpu_create.sh --name lab-h100 --zone us-central1-a --machine-type a3-highgpu-8g
EOF_USAGE
}

MACHINE=""
GPU_TYPE=""
GPU_COUNT=1
GPU_COUNT_GIVEN=0
IMAGE_FAMILY=common-cu124-debian-11-py310
IMAGE_PROJECT=deeplearning-platform-release
DISK_GB=200
SPOT=0
split_eq "$@"
set -- ${ARGS[@]+"${ARGS[@]}"}
while (($#)); do
  case $1 in
    --name) need "$@"; NAME=$2; shift 2 ;;
    --zone) need "$@"; ZONE=$2; shift 2 ;;
    --machine-type) need "$@"; MACHINE=$2; shift 2 ;;
    --gpu) need "$@"; GPU_TYPE=$2; shift 2 ;;
    --gpu-count) need "$@"; GPU_COUNT=$2; GPU_COUNT_GIVEN=1; shift 2 ;;
    --image-family) need "$@"; IMAGE_FAMILY=$2; shift 2 ;;
    --image-project) need "$@"; IMAGE_PROJECT=$2; shift 2 ;;
    --disk-size) need "$@"; DISK_GB=$2; shift 2 ;;
    --spot) SPOT=1; shift ;;
    --project) need "$@"; PROJECT=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) bad_flag "$1" ;;
  esac
done

check_required --name "$NAME" lab-h100
check_required --zone "$ZONE" us-central1-a
check_required --machine-type "$MACHINE" a3-highgpu-8g
check_name "$NAME"
check_zone "$ZONE"
check_uint --gpu-count "$GPU_COUNT"
check_uint --disk-size "$DISK_GB"
((GPU_COUNT >= 1)) || die "--gpu-count must be at least 1"
((DISK_GB >= 50)) || die "--disk-size $DISK_GB: give at least 50 (GB) for the image, the CUDA wheels and the runs"
[[ $MACHINE =~ ^[a-z][a-z0-9]*(-[a-z0-9]+)+$ ]] ||
  die "--machine-type '$MACHINE' is not a machine type like a3-highgpu-8g"
[[ -z $GPU_TYPE || $GPU_TYPE =~ ^[a-z][a-z0-9-]*$ ]] ||
  die "--gpu '$GPU_TYPE' is not a GPU type like nvidia-tesla-t4 (its count is --gpu-count)"
case $MACHINE in
  a2-* | a3-* | a4-* | g2-*)
    [[ -z $GPU_TYPE ]] ||
      die "--machine-type $MACHINE comes with its GPUs; leave --gpu out"
    ((GPU_COUNT_GIVEN == 0)) ||
      die "--machine-type $MACHINE comes with its GPUs (the type sets how many); leave --gpu-count out" ;;
  n1-*)
    [[ -n $GPU_TYPE ]] ||
      die "--machine-type $MACHINE has no GPU of its own; add --gpu, e.g. --gpu nvidia-tesla-t4" ;;
  *) die "--machine-type $MACHINE takes no GPU: use an a2, a3, g2 type, or n1 with --gpu" ;;
esac

gcloud_where
EXTRA=()
if [[ -n $GPU_TYPE ]]; then
  EXTRA+=("--accelerator=type=$GPU_TYPE,count=$GPU_COUNT")
fi
EXTRA+=("--image-family=$IMAGE_FAMILY" "--image-project=$IMAGE_PROJECT")
EXTRA+=("--boot-disk-size=${DISK_GB}GB" --maintenance-policy=TERMINATE)
EXTRA+=(--metadata=install-nvidia-driver=True)
if ((SPOT)); then
  EXTRA+=(--provisioning-model=SPOT --instance-termination-action=STOP)
fi
CONFIG_SSH=(gcloud compute config-ssh)
[[ -z $PROJECT ]] || CONFIG_SSH+=("--project=$PROJECT")
DELETE="tpu/delete.sh --name $NAME --zone $ZONE --gpu${PROJECT:+ --project $PROJECT}"
if ! run gcloud compute instances create "$NAME" "${WHERE[@]}" "--machine-type=$MACHINE" "${EXTRA[@]}"; then
  # a rerun after a failure below: the VM is there already, so go on to what is left
  run gcloud compute instances describe "$NAME" "${WHERE[@]}" "--format=value(status)" >/dev/null ||
    { note "error: creating $NAME failed (gcloud's message is above)"; exit 1; }
  note "$NAME exists already (see gcloud's message above): going on to config-ssh"
fi
# From here the VM bills: a failure says so, with how to delete it or finish by hand.
((DRY_RUN)) || trap 'status=$?; ((status == 0)) || note "error: the VM $NAME ($MACHINE) is running and billing;" \
  "finish by hand ($(quote_cmd "${CONFIG_SSH[@]}")) or delete it: $DELETE"' EXIT
run "${CONFIG_SSH[@]}"
if ((!DRY_RUN)); then
  # the alias's last part is the project: gcloud's configured one without --project
  project=${PROJECT:-$(gcloud config get-value project 2>/dev/null || true)}
  if [[ -n $project ]]; then
    note "next: tpu/setup.sh --hosts $NAME.$ZONE.$project" \
      "(the alias gcloud compute config-ssh wrote to ~/.ssh/config)"
  else
    note "next: tpu/setup.sh --hosts $NAME.$ZONE.PROJECT, PROJECT being the VM's project" \
      "(the alias gcloud compute config-ssh wrote to ~/.ssh/config)"
  fi
fi
