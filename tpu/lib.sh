# shellcheck shell=bash disable=SC2034  # variables here are used by the scripts that source it
# Shared by the tpu/ scripts: flag checks, shell quoting, and --dry-run execution.
#
# Every command a script would run goes through `run` (or `run_bg`): under --dry-run it is
# printed on stdout, one command per line, quoted so that the line can be pasted into a
# shell; otherwise it is echoed on stderr with a "+ " prefix and executed. Notes and errors
# go to stderr, so stdout under --dry-run is exactly the list of commands.
# Only bash 3.2 features (macOS's /bin/bash): no mapfile, no ${x,,}, guarded empty arrays.

PROG=$(basename "$0")
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd) # the lab checkout these scripts are in
TMP=${TMPDIR:-/tmp}
TMP=${TMP%/}
LAB_DIR=lab          # the checkout on each remote machine, relative to its home directory
ARCHIVE=lab-src.tar.gz # the copied source on each remote machine
OUT_ARCHIVE=lab-out.tar.gz
DRY_RUN=0
PROJECT=""
BG_PIDS=() # the commands run_bg started, the sed of their tagged lines, their tags
BG_SEDS=()
BG_TAGS=()
BG_DIR=""

die() {
  printf '%s: error: %s\n' "$PROG" "$*" >&2
  exit 2
}

note() { printf '%s: %s\n' "$PROG" "$*" >&2; }

bad_flag() {
  case $1 in
    -*) die "unknown flag $1 (see --help)" ;;
    *) die "unexpected argument '$1' (see --help)" ;;
  esac
}

# need FLAG [VALUE]: FLAG takes a value, and it is not missing or another flag.
need() {
  [[ $# -ge 2 && -n $2 && $2 != -* ]] || die "$1 needs a value (see --help)"
}

# split_eq ARG...: "--flag=value" → "--flag" "value" (up to a bare "--"), into ARGS.
split_eq() {
  ARGS=()
  while (($#)); do
    case $1 in
      --) ARGS+=("$@") && return ;;
      --*=*) ARGS+=("${1%%=*}" "${1#*=}") ;;
      *) ARGS+=("$1") ;;
    esac
    shift
  done
}

# quote WORD: WORD as a POSIX shell word, in single quotes only when it needs them.
quote() {
  local w=$1
  if [[ -n $w && $w != *[!A-Za-z0-9_./:=,@%+-]* ]]; then
    printf '%s' "$w"
  else
    printf "'%s'" "${w//\'/\'\\\'\'}"
  fi
}

# quote_cmd WORD...: the words quoted and joined by spaces, on one line.
quote_cmd() {
  local out="" w
  for w in "$@"; do
    out+="${out:+ }$(quote "$w")"
  done
  printf '%s\n' "$out"
}

run() {
  if ((DRY_RUN)); then
    quote_cmd "$@"
  else
    printf '+ %s\n' "$(quote_cmd "$@")" >&2
    "$@"
  fi
}

# run_bg CMD...: like run, but in the background; wait_bg waits for all of them.
# With BG_TAG set, every line the command prints (stdout and stderr) starts with "[BG_TAG] ",
# so the output of several hosts at once says which host wrote it. The tagging runs through
# named pipes in a folder of its own, so that wait_bg can wait for the last tagged line too.
run_bg() {
  local fifo
  if ((DRY_RUN)); then
    quote_cmd "$@"
    return 0
  fi
  printf '+ %s &\n' "$(quote_cmd "$@")" >&2
  if [[ -n ${BG_TAG:-} ]]; then
    [[ -n $BG_DIR ]] || BG_DIR=$(mktemp -d "$TMP/lab-bg.XXXXXX")
    fifo="$BG_DIR/${#BG_PIDS[@]}"
    mkfifo "$fifo.out" "$fifo.err"
    sed -u "s/^/[$BG_TAG] /" <"$fifo.out" &
    BG_SEDS+=("$!")
    sed -u "s/^/[$BG_TAG] /" <"$fifo.err" >&2 &
    BG_SEDS+=("$!")
    "$@" >"$fifo.out" 2>"$fifo.err" &
  else
    "$@" &
  fi
  BG_PIDS+=("$!")
  BG_TAGS+=("${BG_TAG:-}")
}

kill_bg() {
  local pid
  for pid in ${BG_PIDS[@]+"${BG_PIDS[@]}"}; do
    kill "$pid" 2>/dev/null || true
  done
  [[ -z $BG_DIR ]] || rm -rf "$BG_DIR"
}

# wait_bg: wait for every run_bg command and its output; fail (status 1) if any of them failed,
# with one line per failed command, after its output, naming its host (BG_TAG).
wait_bg() {
  local i pid status failed=()
  for ((i = 0; i < ${#BG_PIDS[@]}; i++)); do
    status=0
    wait "${BG_PIDS[i]}" || status=$?
    if ((status)); then
      if [[ -n ${BG_TAGS[i]} ]]; then
        failed+=("${BG_TAGS[i]} failed (exit status $status): its lines above start with [${BG_TAGS[i]}]")
      else
        failed+=("a command failed (exit status $status; see its output above)")
      fi
    fi
  done
  for pid in ${BG_SEDS[@]+"${BG_SEDS[@]}"}; do
    wait "$pid" || true
  done
  [[ -z $BG_DIR ]] || rm -rf "$BG_DIR"
  BG_PIDS=() BG_SEDS=() BG_TAGS=() BG_DIR=""
  for i in ${failed[@]+"${failed[@]}"}; do
    note "error: $i"
  done
  ((${#failed[@]} == 0))
}

# --- values -------------------------------------------------------------------------------

check_name() { # a Compute Engine / Cloud TPU resource name
  [[ $1 =~ ^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$ ]] ||
    die "--name '$1': use lower-case letters, digits and '-', starting with a letter"
}

check_zone() {
  [[ $1 =~ ^[a-z]+(-[a-z]+[0-9]+)+-[a-z]$ ]] || die "--zone '$1' is not a zone like us-central2-b"
}

check_uint() { # FLAG VALUE (no leading zero: bash arithmetic would read 08 as octal)
  [[ $2 =~ ^(0|[1-9][0-9]*)$ ]] || die "$1 '$2' is not a whole number (digits, no leading zero)"
}

check_required() { # FLAG VALUE EXAMPLE
  [[ -n $2 ]] || die "$1 is required (e.g. $1 $3)"
}

refuse_process_keys() { # WHY KEY=VALUE... : the keys that say who a process is, set by the script
  local why=$1 a
  shift
  for a in "$@"; do
    [[ $a == *=* ]] || continue
    a=$(trim "${a%%=*}") # lab.run strips its keys: ' coordinator =x' is coordinator=
    case $a in
      coordinator | num_processes | process_id) die "$a= $why" ;;
    esac
  done
}

refuse_flags() { # MODULE WORD... : lab.run takes KEY=VALUE words only; a flag after -- reaches it
  local module=$1 a
  shift
  [[ $module == lab.run ]] || return 0
  for a in "$@"; do
    [[ $a != -* ]] ||
      die "'$a' after --: lab.run takes KEY=VALUE words only (this script's flags go before --)"
  done
}

# trim WORD: WORD without leading and trailing white space (lab.run strips keys and values).
trim() {
  local w=$1
  w=${w#"${w%%[![:space:]]*}"}
  printf '%s' "${w%"${w##*[![:space:]]}"}"
}

# refuse_repeated_keys MODULE WORD... : lab.run refuses a key given twice; say so before anything
# runs or waits in a queue (a check here that reads one of the two would pass the other).
refuse_repeated_keys() {
  local module=$1 a key seen=" "
  shift
  [[ $module == lab.run ]] || return 0
  for a in "$@"; do
    [[ $a == *=* ]] || continue
    key=$(trim "${a%%=*}")
    [[ $seen != *" $key "* ]] || die "$key is given more than once (lab.run takes each key once)"
    seen+="$key "
  done
}

# lab_value KEY WORD... : the value of KEY= among the words (trimmed), or status 1 without one.
lab_value() {
  local key=$1 a
  shift
  for a in "$@"; do
    if [[ $a == *=* && $(trim "${a%%=*}") == "$key" ]]; then
      trim "${a#*=}"
      return 0
    fi
  done
  return 1
}

# is_true VALUE: VALUE is a word lab.run reads as true (1, true, yes, on; any case).
is_true() {
  case $(printf '%s' "$1" | tr '[:upper:]' '[:lower:]') in
    1 | true | yes | on) return 0 ;;
    *) return 1 ;;
  esac
}

# --- where commands go: a Cloud TPU VM (every worker) or a list of ssh hosts ---------------

NAME=""
ZONE=""
HOSTS_CSV=""
HOSTS=()

# check_target: exactly one of --name/--zone (TPU VM) and --hosts (ssh hosts).
check_target() {
  if [[ -n $HOSTS_CSV ]]; then
    [[ -z $NAME && -z $ZONE ]] ||
      die "give --name/--zone (a TPU VM) or --hosts (ssh hosts), not both"
    local host='[^-,[:space:]][^,[:space:]]*' # not empty, no spaces, not an ssh option
    [[ $HOSTS_CSV =~ ^$host(,$host)*$ ]] ||
      die "--hosts '$HOSTS_CSV': want host names separated by commas, like gpu-0,user@gpu-1"
    IFS=, read -r -a HOSTS <<<"$HOSTS_CSV"
  else
    [[ -n $NAME || -n $ZONE ]] || die "give --name and --zone (a TPU VM) or --hosts (ssh hosts)"
    check_required --name "$NAME" my-tpu
    check_required --zone "$ZONE" us-central2-b
    check_name "$NAME"
    check_zone "$ZONE"
  fi
}

# gcloud_where: the flags that place a gcloud command (zone, and project when given).
gcloud_where() {
  WHERE=("--zone=$ZONE")
  if [[ -n $PROJECT ]]; then
    WHERE+=("--project=$PROJECT")
  fi
}

# tpu_ssh WORKER COMMAND: run COMMAND on TPU VM worker(s) WORKER ("all" = every worker at once).
tpu_ssh() {
  gcloud_where
  run gcloud compute tpus tpu-vm ssh "$NAME" "${WHERE[@]}" "--worker=$1" --command "$2"
}

# tpu_scp WORKER SRC DEST: copy to/from TPU VM worker(s); remote paths are "$NAME:path".
tpu_scp() {
  gcloud_where
  run gcloud compute tpus tpu-vm scp "$2" "$3" "${WHERE[@]}" "--worker=$1"
}
