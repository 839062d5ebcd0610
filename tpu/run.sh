#!/usr/bin/env bash
# Run a lab command on every TPU worker (or ssh host) at once, as one multi-host JAX job.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() {
  cat <<'EOF_USAGE'
Usage: tpu/run.sh (--name NAME --zone ZONE | --hosts HOST,...) [options] [--] [KEY=VALUE ...]

Run `python -m lab.run KEY=VALUE ...` in ~/lab on every machine at the same time, so
that jax.distributed joins them into one global mesh. (Set them up with tpu/setup.sh.)

On a TPU VM every worker runs the same command (--worker=all); lab.run initialises
jax.distributed from the TPU environment (coordinator=, num_processes= and
process_id= are refused: every worker would get the same). On --hosts, host i runs it with
coordinator=COORDINATOR:PORT num_processes=N process_id=i added (when N > 1).
Output goes to the machines' ~/lab/runs/; bring it back with tpu/fetch.sh. Ctrl-C (exit
130) or SIGTERM (143) stops the ssh clients here; a remote lab.run may train on (see
tpu/README.md for stopping it). Only lab.run joins several hosts into one job.

  --name NAME          TPU VM name
  --zone ZONE          its zone
  --hosts H0,H1,...    ssh hosts instead; H0 hosts the jax.distributed coordinator
  --coordinator ADDR   the address the other hosts reach H0 at (default: H0 without
                       user@; for a gcloud compute config-ssh alias NAME.ZONE.PROJECT,
                       Compute Engine's internal name NAME.ZONE.c.PROJECT.internal); a host
                       alone, an IPv6 address in brackets ([fd00::2]): the port is --port's
  --port PORT          coordinator port (default 1234; open between the hosts)
  --module MODULE      python module to run (default lab.run; e.g. experiments)
  --project PROJECT    Google Cloud project (default: gcloud's configured project)
  --dry-run            print the commands, one per line, and run nothing
  -h, --help           this help
  KEY=VALUE ...        the module's arguments; everything after -- is passed as is
                       (lab.run takes KEY=VALUE words only: a -flag there is refused)

Examples:
  tpu/run.sh --name lab-v4 --zone us-central2-b -- name=pod mesh=4x4 model=1b
  tpu/run.sh --hosts gpu-0,gpu-1 -- name=two-hosts mesh=16x1
EOF_USAGE
}

MODULE=lab.run
PORT=1234
PORT_GIVEN=0
COORDINATOR=""
LAB_ARGS=()
split_eq "$@"
set -- ${ARGS[@]+"${ARGS[@]}"}
while (($#)); do
  case $1 in
    --name) need "$@"; NAME=$2; shift 2 ;;
    --zone) need "$@"; ZONE=$2; shift 2 ;;
    --hosts) need "$@"; HOSTS_CSV=$2; shift 2 ;;
    --coordinator) need "$@"; COORDINATOR=$2; shift 2 ;;
    --port) need "$@"; PORT=$2; PORT_GIVEN=1; shift 2 ;;
    --module) need "$@"; MODULE=$2; shift 2 ;;
    --project) need "$@"; PROJECT=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; LAB_ARGS+=("$@"); break ;;
    -*) bad_flag "$1" ;;
    *) LAB_ARGS+=("$1"); shift ;;
  esac
done

refuse_flags "$MODULE" ${LAB_ARGS[@]+"${LAB_ARGS[@]}"}
refuse_repeated_keys "$MODULE" ${LAB_ARGS[@]+"${LAB_ARGS[@]}"}
check_target
[[ $MODULE =~ ^[A-Za-z_][A-Za-z0-9_.]*$ ]] || die "--module '$MODULE' is not a module name"
check_uint --port "$PORT"
((PORT >= 1 && PORT <= 65535)) || die "--port $PORT is not between 1 and 65535"

# lab_command [KEY=VALUE...]: the remote command line, with the lab's arguments after.
lab_command() {
  local cmd="cd $LAB_DIR && .venv/bin/python -m $MODULE" a
  for a in "$@"; do
    cmd+=" $(quote "$a")"
  done
  printf '%s' "$cmd"
}

if [[ -z $HOSTS_CSV ]]; then
  # a TPU VM's workers find their coordinator in the TPU environment: these would do nothing
  [[ -z $COORDINATOR ]] || die "--coordinator is for --hosts: a TPU VM's workers find their coordinator themselves"
  ((PORT_GIVEN == 0)) || die "--port is for --hosts: a TPU VM's workers find their coordinator themselves"
  refuse_process_keys "would be the same on every worker: lab.run reads each worker's from the TPU environment" \
    ${LAB_ARGS[@]+"${LAB_ARGS[@]}"}
  tpu_ssh all "$(lab_command ${LAB_ARGS[@]+"${LAB_ARGS[@]}"})"
  exit 0
fi

n=${#HOSTS[@]}
if ((n == 1)); then # one host joins nobody: these would do nothing
  [[ -z $COORDINATOR ]] || die "--coordinator is for two or more --hosts: one host joins nobody"
  ((PORT_GIVEN == 0)) || die "--port is for two or more --hosts: one host joins nobody"
fi
if ((n > 1)); then
  [[ $MODULE == lab.run ]] ||
    die "--module $MODULE on $n hosts: only lab.run joins hosts into one job (run $MODULE on one host: --hosts ${HOSTS[0]})"
  refuse_process_keys "is set by run.sh for each host (use --coordinator and --port)" \
    ${LAB_ARGS[@]+"${LAB_ARGS[@]}"}
fi
if [[ -z $COORDINATOR ]]; then
  COORDINATOR=${HOSTS[0]#*@}
  gce_alias='^([a-z][-a-z0-9]*)\.([a-z]+(-[a-z]+[0-9]+)+-[a-z])\.([a-z][-a-z0-9]*)$'
  if [[ $COORDINATOR =~ $gce_alias ]]; then
    COORDINATOR="${BASH_REMATCH[1]}.${BASH_REMATCH[2]}.c.${BASH_REMATCH[4]}.internal"
  fi
fi
# a host alone: the port is --port's (a host:port here would become coordinator=H:P:PORT)
if [[ $COORDINATOR =~ ^[A-Za-z0-9._-]+:[0-9]*$ || $COORDINATOR =~ ^\[.*\]: ]]; then
  die "--coordinator '$COORDINATOR' holds a port: give the host alone and the port with --port"
fi
if [[ $COORDINATOR == *:* && ! $COORDINATOR =~ ^\[[0-9A-Fa-f:.]+\]$ ]]; then
  die "--coordinator '$COORDINATOR': write an IPv6 address in brackets ([$COORDINATOR]); the port goes in --port"
fi
[[ $COORDINATOR =~ ^([A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\])$ ]] ||
  die "--coordinator '$COORDINATOR' is not a host name"
# Ctrl-C or SIGTERM stops the ssh clients, and the exit status says which (130, 143)
trap 'kill_bg; exit 130' INT
trap 'kill_bg; exit 143' TERM
for ((i = 0; i < n; i++)); do
  keys=()
  if ((n > 1)); then
    keys=("coordinator=$COORDINATOR:$PORT" "num_processes=$n" "process_id=$i")
  fi
  # each line of a host's output carries its host (and process) name
  BG_TAG="${HOSTS[i]}" run_bg ssh "${HOSTS[i]}" "$(lab_command ${keys[@]+"${keys[@]}"} ${LAB_ARGS[@]+"${LAB_ARGS[@]}"})"
done
wait_bg
