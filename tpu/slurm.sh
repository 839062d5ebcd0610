#!/usr/bin/env bash
# Submit one lab.run job over N GPU nodes of a SLURM cluster (sbatch + srun, one task per GPU).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() {
  cat <<'EOF_USAGE'
Usage: tpu/slurm.sh --nodes N [options] [--] [KEY=VALUE ...]

Run on a SLURM cluster's login node, in this checkout (which the GPU nodes must see:
a shared file system). Submits one batch job: srun starts one task of
`python -m lab.run KEY=VALUE ...` per GPU on every node, and each task joins the
same jax.distributed job through the variables SLURM sets (lab.run reads the
coordinator itself: the first node of the step, every bracket group of the node list
expanded, on a port derived from the job id; JAX's SLURM detection finds the process
count and id; task i of a node drives GPU i). No coordinator= keys: SLURM says who is who.
Give a mesh over all N x G GPUs, e.g. mesh=16x1 or mesh=data:-1: one over fewer
is refused here, before the job waits in the queue.

The job's environment: XLA_PYTHON_CLIENT_MEM_FRACTION (JAX preallocates that share
of each GPU's memory; the rest is left to NCCL's buffers and the CUDA context),
NCCL_DEBUG=WARN (NCCL's problems in the log, not its chatter), PYTHONUNBUFFERED=1
(each task's lines as they come), and NCCL_SOCKET_IFNAME with --nccl-ifname.
The job asks for whole nodes (--exclusive): a shared node's traffic skews the
step times. Output goes to slurm-JOBID.out in this checkout; runs/ as usual.

  --nodes N            GPU nodes
  --gpus-per-node G    GPUs (and tasks) per node (default 8)
  --partition P        SLURM partition (default: the cluster's default)
  --account A          SLURM account to charge (default: yours)
  --time T             time limit, as sbatch reads it (default 01:00:00)
  --job-name NAME      default lab
  --venv DIR           the virtual environment with the lab (default: .venv here)
  --setup              first make --venv (python3 -m venv) and pip install -e '.[cuda]'
                       in it, on this node (JAX's CUDA wheels bring CUDA and cuDNN;
                       the nodes need only NVIDIA's driver)
  --python PYTHON      the Python --setup makes the venv with (default python3;
                       the lab needs 3.11 or newer)
  --mem-fraction F     XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.90)
  --nccl-ifname IF     NCCL_SOCKET_IFNAME: the network interface between the nodes
                       (e.g. ib0), when NCCL's own choice is wrong
  --module MODULE      python module to run (default lab.run; e.g. experiments, which
                       runs as one task on one node: --nodes 1)
  --dry-run            print the commands, one per line, and run nothing (with a
                       warning where --venv has no python yet)
  -h, --help           this help
  KEY=VALUE ...        the module's arguments; everything after -- is passed as is
                       (lab.run takes KEY=VALUE words only: a -flag there is refused;
                       its mesh= must span every GPU of the job, e.g. mesh=data:-1)

Examples:
  tpu/slurm.sh --nodes 2 --setup --dry-run -- name=two mesh=16x1 model=1b
  tpu/slurm.sh --nodes 2 --partition gpu -- name=two mesh=16x1 model=1b
EOF_USAGE
}

NODES=""
GPUS=8
PARTITION=""
ACCOUNT=""
TIME=01:00:00
JOB_NAME=lab
VENV=$ROOT/.venv
SETUP=0
PYTHON=python3
MEM_FRACTION=0.90
NCCL_IFNAME=""
MODULE=lab.run
LAB_ARGS=()
split_eq "$@"
set -- ${ARGS[@]+"${ARGS[@]}"}
while (($#)); do
  case $1 in
    --nodes) need "$@"; NODES=$2; shift 2 ;;
    --gpus-per-node) need "$@"; GPUS=$2; shift 2 ;;
    --partition) need "$@"; PARTITION=$2; shift 2 ;;
    --account) need "$@"; ACCOUNT=$2; shift 2 ;;
    --time) need "$@"; TIME=$2; shift 2 ;;
    --job-name) need "$@"; JOB_NAME=$2; shift 2 ;;
    --venv) need "$@"; VENV=$2; shift 2 ;;
    --setup) SETUP=1; shift ;;
    --python) need "$@"; PYTHON=$2; shift 2 ;;
    --mem-fraction) need "$@"; MEM_FRACTION=$2; shift 2 ;;
    --nccl-ifname) need "$@"; NCCL_IFNAME=$2; shift 2 ;;
    --module) need "$@"; MODULE=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; LAB_ARGS+=("$@"); break ;;
    -*) bad_flag "$1" ;;
    *) LAB_ARGS+=("$1"); shift ;;
  esac
done

refuse_flags "$MODULE" ${LAB_ARGS[@]+"${LAB_ARGS[@]}"}
check_required --nodes "$NODES" 2
check_uint --nodes "$NODES"
check_uint --gpus-per-node "$GPUS"
((NODES >= 1)) || die "--nodes must be at least 1"
((GPUS >= 1)) || die "--gpus-per-node must be at least 1"
name='^[A-Za-z0-9_.-]+$'
[[ -z $PARTITION || $PARTITION =~ $name ]] || die "--partition '$PARTITION' is not a partition name"
[[ -z $ACCOUNT || $ACCOUNT =~ $name ]] || die "--account '$ACCOUNT' is not an account name"
[[ $JOB_NAME =~ $name ]] || die "--job-name '$JOB_NAME': use letters, digits, '_', '.' and '-'"
[[ $TIME =~ ^[0-9]+([-:][0-9]+){0,3}$ ]] ||
  die "--time '$TIME' is not a time limit like 01:00:00, 90 or 1-12:00:00"
[[ $MEM_FRACTION =~ ^(0?\.[0-9]*[1-9][0-9]*|1(\.0*)?)$ ]] ||
  die "--mem-fraction '$MEM_FRACTION' is not a fraction in (0, 1], like 0.90"
[[ -z $NCCL_IFNAME || $NCCL_IFNAME =~ ^\^?[A-Za-z0-9_.=-]+(,[A-Za-z0-9_.=-]+)*$ ]] ||
  die "--nccl-ifname '$NCCL_IFNAME' is not an interface name like ib0 (or a list: ^lo,docker0)"
[[ $MODULE =~ ^[A-Za-z_][A-Za-z0-9_.]*$ ]] || die "--module '$MODULE' is not a module name"
[[ $VENV != *,* ]] || die "--venv '$VENV': a path without commas, please"
# Only lab.run joins tasks into one job; any other module runs once, on one node, and sees all of
# that node's GPUs (one task per GPU would run it once per GPU, each on GPUs the others share).
TASKS=$GPUS
if [[ $MODULE != lab.run ]]; then
  ((NODES == 1)) ||
    die "--module $MODULE on $NODES nodes: only lab.run joins nodes into one job (run $MODULE with --nodes 1)"
  TASKS=1
fi
refuse_process_keys "is SLURM's to set: each task reads who is who from SLURM's variables" \
  ${LAB_ARGS[@]+"${LAB_ARGS[@]}"}

# check_mesh MESH GPUS: a lab.run mesh ("16x1", "data:2,model:8", one size -1 filling the rest)
# must span every GPU of the job: a task whose GPU the mesh leaves out holds none of it, and
# the job fails on the cluster after its wait in the queue. A mesh this cannot read is left
# to lab.run, which says what is wrong with it.
check_mesh() {
  local mesh=$1 total=$2 product=1 fill=0 part size sizes
  [[ $mesh =~ ^[A-Za-z0-9:,-]+$ ]] || return 0
  if [[ $mesh == *:* ]]; then
    sizes=""
    for part in ${mesh//,/ }; do sizes+=" ${part#*:}"; done
  else
    sizes=${mesh//[xX]/ }
  fi
  for size in $sizes; do
    if [[ $size == -1 ]]; then
      fill=1
    elif [[ $size =~ ^[1-9][0-9]{0,5}$ ]]; then
      product=$((product * size))
    else
      return 0
    fi
  done
  local gpus="$NODES nodes x $GPUS GPUs = $total GPUs"
  if ((fill)); then
    ((total % product == 0)) ||
      die "mesh=$mesh: its fixed sizes ($product) do not divide the job's $gpus"
  elif ((product != total)); then
    die "mesh=$mesh spans $product devices but the job has $gpus: give a mesh over all $total (e.g. mesh=${total}x1 or mesh=data:-1)"
  fi
}
refuse_repeated_keys "$MODULE" ${LAB_ARGS[@]+"${LAB_ARGS[@]}"}
if [[ $MODULE == lab.run ]]; then
  # the mesh= given to lab.run, not a MESH the caller's environment happens to hold
  MESH=$(lab_value mesh ${LAB_ARGS[@]+"${LAB_ARGS[@]}"}) || MESH=""
  RESUME=0 # a resume's tasks take the run's own mesh
  if is_true "$(lab_value resume ${LAB_ARGS[@]+"${LAB_ARGS[@]}"})"; then
    RESUME=1
  fi
  if [[ -n $MESH ]]; then
    check_mesh "$MESH" $((NODES * GPUS))
  elif ((NODES * TASKS > 1 && !RESUME)); then
    # lab.run's default mesh=1 is one device: the other tasks would hold none of it
    die "lab.run's default mesh=1 uses one of the job's $((NODES * TASKS)) GPUs: give a mesh over all of them (e.g. mesh=data:-1)"
  fi
fi
# the job runs in --chdir=ROOT: a relative venv is this directory's, made absolute
[[ $VENV == /* ]] || VENV="$PWD/$VENV"

if ((!DRY_RUN)); then
  command -v sbatch >/dev/null || die "sbatch not found: run this on the cluster's login node"
fi
if ((SETUP)); then
  run "$PYTHON" -m venv "$VENV"
  run "$VENV/bin/pip" install --quiet -e "${ROOT}[cuda]"
elif [[ ! -x $VENV/bin/python ]]; then
  ((DRY_RUN)) || die "no $VENV/bin/python: add --setup (or --venv DIR) to make it"
  note "warning: no $VENV/bin/python yet: the job would fail as printed; add --setup (or --venv DIR)"
fi

# What every task runs: srun starts one per GPU, and ends them all if one fails (a task of a
# jax.distributed job cannot go on alone: its next collective waits for every peer).
step="srun --kill-on-bad-exit=1 $(quote "$VENV/bin/python") -m $MODULE"
# a list of interfaces has commas, which --export would split: set in the job's shell instead
[[ -z $NCCL_IFNAME ]] || step="NCCL_SOCKET_IFNAME=$(quote "$NCCL_IFNAME") $step"
for a in ${LAB_ARGS[@]+"${LAB_ARGS[@]}"}; do
  step+=" $(quote "$a")"
done
export_vars="ALL,XLA_PYTHON_CLIENT_MEM_FRACTION=$MEM_FRACTION,NCCL_DEBUG=WARN,PYTHONUNBUFFERED=1"
SBATCH=(sbatch "--job-name=$JOB_NAME" "--nodes=$NODES" "--ntasks-per-node=$TASKS")
SBATCH+=("--gpus-per-node=$GPUS" --exclusive "--time=$TIME")
[[ -z $PARTITION ]] || SBATCH+=("--partition=$PARTITION")
[[ -z $ACCOUNT ]] || SBATCH+=("--account=$ACCOUNT")
SBATCH+=("--chdir=$ROOT" "--export=$export_vars" --wrap "$step")
run "${SBATCH[@]}"
((DRY_RUN)) || note "submitted; follow it with squeue --me and tail -f $ROOT/slurm-JOBID.out"
