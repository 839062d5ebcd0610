#!/usr/bin/env bash
# Copy runs/ and results/ back from a TPU VM worker (or an ssh host) into this checkout.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() {
  cat <<'EOF_USAGE'
Usage: tpu/fetch.sh (--name NAME --zone ZONE | --hosts HOST,...) [options]

Pack ~/lab/runs and ~/lab/results on one machine, copy the archive here and unpack it
into --dest (files of the same name are replaced). In a multi-host run, process 0 (TPU
worker 0, or the first of --hosts) writes the run folder, so that is the default.

  --name NAME          TPU VM name
  --zone ZONE          its zone
  --hosts H0,H1,...    ssh hosts instead
  --worker I           which worker / host to fetch from (default 0)
  --dest DIR           where runs/ and results/ land (default: this checkout)
  --project PROJECT    Google Cloud project (default: gcloud's configured project)
  --dry-run            print the commands, one per line, and run nothing
  -h, --help           this help

Example:
  tpu/fetch.sh --name lab-v5e --zone us-west4-a
EOF_USAGE
}

WORKER=0
DEST=$ROOT
split_eq "$@"
set -- ${ARGS[@]+"${ARGS[@]}"}
while (($#)); do
  case $1 in
    --name) need "$@"; NAME=$2; shift 2 ;;
    --zone) need "$@"; ZONE=$2; shift 2 ;;
    --hosts) need "$@"; HOSTS_CSV=$2; shift 2 ;;
    --worker) need "$@"; WORKER=$2; shift 2 ;;
    --dest) need "$@"; DEST=$2; shift 2 ;;
    --project) need "$@"; PROJECT=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) bad_flag "$1" ;;
  esac
done

check_target
check_uint --worker "$WORKER"
if [[ -n $HOSTS_CSV ]]; then
  ((WORKER < ${#HOSTS[@]})) || die "--worker $WORKER: there are only ${#HOSTS[@]} hosts"
fi

PACK="mkdir -p $LAB_DIR/runs $LAB_DIR/results"
PACK+=" && tar -czf $OUT_ARCHIVE -C $LAB_DIR runs results"
if [[ -z $HOSTS_CSV ]]; then
  LOCAL_ARCHIVE="$TMP/lab-out-$NAME.tar.gz"
  tpu_ssh "$WORKER" "$PACK"
  tpu_scp "$WORKER" "$NAME:$OUT_ARCHIVE" "$LOCAL_ARCHIVE"
  tpu_ssh "$WORKER" "rm -f $OUT_ARCHIVE"  # copied: the worker's archive goes
else
  host=${HOSTS[WORKER]}
  LOCAL_ARCHIVE="$TMP/lab-out-${host#*@}.tar.gz"
  run ssh "$host" "$PACK"
  run scp "$host:$OUT_ARCHIVE" "$LOCAL_ARCHIVE"
  run ssh "$host" "rm -f $OUT_ARCHIVE"
fi
run mkdir -p "$DEST"
run tar -xzf "$LOCAL_ARCHIVE" -C "$DEST"
run rm "$LOCAL_ARCHIVE"
((DRY_RUN)) || note "runs/ and results/ are in $DEST"
