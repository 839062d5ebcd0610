#!/usr/bin/env bash
# Put the lab on every worker of a TPU VM (or on a list of ssh hosts) and install it.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() {
  cat <<'EOF_USAGE'
Usage: tpu/setup.sh (--name NAME --zone ZONE | --hosts HOST,...) [options]

On every TPU worker (all at once), or on every ssh host: put the lab in ~/lab, make
~/lab/.venv with uv (installed on first use from astral.sh; it fetches a Python
when the image's is too old) and install the lab with its extra: pip install -e '.[tpu]'
on TPU VMs, '.[cuda]' on --hosts. Safe to run again, in either mode: ~/lab's source
is replaced (a file deleted from the repository goes); its .venv, runs/, results/ and
any file of your own beside the source's are kept.

By default the source is this checkout at --ref (git archive; uncommitted changes are
not included), copied over with scp. With --repo, each machine clones or fetches URL.

  --name NAME          TPU VM name (every worker of a pod slice is set up)
  --zone ZONE          its zone
  --hosts H0,H1,...    ssh hosts instead (e.g. GPU VMs: NAME.ZONE.PROJECT after
                       gcloud compute config-ssh, or user@address)
  --repo URL           clone URL on each machine instead of copying this checkout
  --ref REF            what to install (default HEAD; with --repo: a branch, tag or full
                       commit hash of URL, fetched anew on every run, default its HEAD)
  --extra EXTRA        pyproject extra to install (default tpu, or cuda with --hosts;
                       none = no extra)
  --python VERSION     Python for the venv, as uv understands it (default 3.12)
  --project PROJECT    Google Cloud project (default: gcloud's configured project)
  --dry-run            print the commands, one per line, and run nothing
  -h, --help           this help

Example:
  tpu/setup.sh --name lab-v5e --zone us-west4-a
EOF_USAGE
}

REPO=""
REF=""
EXTRA=""
PYTHON=3.12
split_eq "$@"
set -- ${ARGS[@]+"${ARGS[@]}"}
while (($#)); do
  case $1 in
    --name) need "$@"; NAME=$2; shift 2 ;;
    --zone) need "$@"; ZONE=$2; shift 2 ;;
    --hosts) need "$@"; HOSTS_CSV=$2; shift 2 ;;
    --repo) need "$@"; REPO=$2; shift 2 ;;
    --ref) need "$@"; REF=$2; shift 2 ;;
    --extra) need "$@"; EXTRA=$2; shift 2 ;;
    --python) need "$@"; PYTHON=$2; shift 2 ;;
    --project) need "$@"; PROJECT=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) bad_flag "$1" ;;
  esac
done

check_target
if [[ -z $EXTRA ]]; then
  EXTRA=tpu
  [[ -z $HOSTS_CSV ]] || EXTRA=cuda
fi
[[ $EXTRA =~ ^[a-z0-9_,-]+$ ]] || die "--extra '$EXTRA' is not an extra name like tpu or cuda"
[[ $PYTHON =~ ^[A-Za-z0-9_.+-]+$ ]] || die "--python '$PYTHON' is not a version like 3.12"
# the lab needs 3.11 or newer (pyproject.toml): refused here, not on every host after its venv
# (3.10, 3.10.4, python3.10, 2.7 and a bare 3 are refused; 3.12, pypy3.11 and the like pass)
if [[ $PYTHON =~ ^(python|cpython-?)?([0-9]+)(\.([0-9]+))?([.-].*)?$ ]]; then
  major=$((10#${BASH_REMATCH[2]}))
  minor=${BASH_REMATCH[4]:+$((10#${BASH_REMATCH[4]}))}
  if ((major < 3)) || { ((major == 3)) && [[ -z $minor ]]; } || ((major == 3 && ${minor:-0} < 11)); then
    die "--python $PYTHON: the lab needs Python 3.11 or newer (give e.g. 3.12)"
  fi
fi
SPEC=".[$EXTRA]"
[[ $EXTRA != none ]] || SPEC=.

# The install, run in ~ on each machine once the source is in ~/lab.
INSTALL="cd $LAB_DIR"
# shellcheck disable=SC2016  # $HOME and $PATH are the remote machine's
INSTALL+=' && export PATH="$HOME/.local/bin:$PATH"'
INSTALL+=' && { command -v uv >/dev/null || curl -LsSf https://astral.sh/uv/install.sh | sh; }'
INSTALL+=" && { test -x .venv/bin/python || uv venv --python $PYTHON .venv; }"
# a first install takes minutes (jax and its accelerator wheels): say so, and show uv's progress
INSTALL+=" && echo 'installing the lab and its dependencies (the first time takes minutes)' >&2"
INSTALL+=" && uv pip install --python .venv/bin/python -e \"$SPEC\""
# Before the new source goes in, ~/lab's entries that the source itself has at its top (lab/,
# tests/, README.md, …; read from stdin, one a line) are removed, so that a file deleted from
# the repository goes too (a stale module would stay importable); anything else there (the
# venv, runs/, results/, a user's own files) is kept.
CLEAR="grep -vxE '\\.?|\\.git|\\.venv|runs|results' | (cd $LAB_DIR && xargs -r -d '\\n' rm -rf --)"

if [[ -n $REPO ]]; then
  REF=${REF:-HEAD}
  REF=${REF#origin/} # the remote's own name for it: fetched below, never a stale local branch
  url=$(quote "$REPO")
  ref=$(quote "$REF")
  # A clone follows --repo: a changed URL becomes its origin. A ~/lab that is no clone (an
  # earlier copy) becomes one in place: once the fetch has worked, the entries the fetched
  # tree has at its top are cleared as above for the checkout's.
  REMOTE="if test -d $LAB_DIR/.git; then git -C $LAB_DIR remote set-url origin $url;"
  REMOTE+=" else { test ! -e $LAB_DIR || echo '~/$LAB_DIR is not a git clone: its files are"
  REMOTE+=" replaced by the clone (.venv, runs/, results/ and your own files kept)' >&2; }"
  REMOTE+=" && mkdir -p $LAB_DIR && git init --quiet $LAB_DIR"
  REMOTE+=" && git -C $LAB_DIR remote add origin $url; fi"
  REMOTE+=" && git -C $LAB_DIR fetch --quiet origin $ref"
  REMOTE+=" && { git -C $LAB_DIR rev-parse --quiet --verify HEAD >/dev/null"
  REMOTE+=" || git -C $LAB_DIR ls-tree --name-only FETCH_HEAD | $CLEAR; }"
  REMOTE+=" && git -C $LAB_DIR checkout --quiet --force --detach FETCH_HEAD && $INSTALL"
else
  REF=${REF:-HEAD}
  git -C "$ROOT" rev-parse --git-dir >/dev/null 2>&1 ||
    die "$ROOT is not a git checkout; use --repo URL"
  git -C "$ROOT" rev-parse --quiet --verify "$REF^{commit}" >/dev/null ||
    die "--ref '$REF' is not a commit in $ROOT"
  if [[ -n $(git -C "$ROOT" status --porcelain --untracked-files=no) ]]; then
    note "uncommitted changes in $ROOT are not copied (it copies $REF)"
  fi
  # named after the machines it goes to: setups of two machines at once keep their own
  LOCAL_ARCHIVE="$TMP/lab-src-${NAME:-${HOSTS[0]#*@}}.tar.gz"
  REMOTE="mkdir -p $LAB_DIR && { tar -tzf $ARCHIVE | cut -d/ -f1 | sort -u | $CLEAR; }"
  REMOTE+=" && tar -xzf $ARCHIVE -C $LAB_DIR && rm $ARCHIVE && $INSTALL"
  # the local archive goes however this ends (copied everywhere, a copy failed, Ctrl-C)
  ((DRY_RUN)) || trap 'rm -f "$LOCAL_ARCHIVE"' EXIT
  run git -C "$ROOT" archive --format=tar.gz "--output=$LOCAL_ARCHIVE" "$REF"
fi

if [[ -z $HOSTS_CSV ]]; then
  [[ -n $REPO ]] || tpu_scp all "$LOCAL_ARCHIVE" "$NAME:$ARCHIVE"
  tpu_ssh all "$REMOTE"
else
  if [[ -z $REPO ]]; then
    for host in "${HOSTS[@]}"; do
      run scp "$LOCAL_ARCHIVE" "$host:$ARCHIVE" ||
        { note "error: copying the source to $host failed (scp's message is above): nothing was installed"; exit 1; }
    done
  fi
  trap kill_bg INT TERM
  for host in "${HOSTS[@]}"; do
    BG_TAG=$host run_bg ssh "$host" "$REMOTE" # each line of a host's output carries its name
  done
  wait_bg
fi
# the copy is on every host now: the local archive goes (a --repo install made none)
[[ -n $REPO ]] || run rm -f "$LOCAL_ARCHIVE"
((DRY_RUN)) || note "done; next: tpu/run.sh with the same --name/--zone or --hosts"
