"""The GPU runbook as data: its steps in priority order, each a subprocess under its own budget.

An accelerator is lent rarely, often for under an hour, in commands that must each end within
ten minutes. So every step of BENCHMARKS.md's runbook is one existing command run as a
subprocess with a time budget (killed past it, recorded as cut short), the whole bounded by one
budget, and every outcome is written to a state file as soon as it is known: a rerun skips what
finished and starts where the last one stopped. Steps write their records into a folder of
their own (`<root>/steps/<step>/try-<n>/`); `lab.report.runbook` turns them into Markdown rows.

The parent process never initialises a JAX backend: on a GPU that would take the device's
memory from the steps. What the steps will see is found by a probe subprocess.
"""

import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from lab.errors import ConfigError

STATE = "state.json"
ROWS = "BENCHMARKS-rows.md"
FINISHED = ("done", "failed")  # ran to its end: a rerun skips it unless redo= names it
MAX_STEP_S = 570.0  # under the ten minutes a lent machine gives one command
KILL_GRACE_S = 5.0  # SIGTERM, then this long before SIGKILL
GPU_REASON = "needs an NVIDIA GPU; this machine's backend is {backend}"
KERNELS_ON_CPU = (
    " (on CPU the kernels are checked in JAX's interpreter: "
    "pytest tests/test_pallas_mgpu.py tests/test_attention.py)"
)


@dataclasses.dataclass(frozen=True)
class Step:
    """One command of the runbook. `args` follow `python`; `{out}` is the step's folder and
    `{tuned}` the remat and batch size the `tune-step-*` steps found best (else `fallback`)."""

    name: str  # its key in the state file, steps= and redo=
    what: str  # one line: what it measures
    args: tuple  # after `python`, e.g. ("-m", "lab.tools.ceilings", "out_dir={out}")
    budget_s: float = 300.0  # killed past this (and past the run's budget=)
    needs_gpu: bool = False  # skipped, with its reason, on any other backend
    kind: str = ""  # how its records read as a headline (lab.report.runbook)
    skip_reason: str = ""  # added to the GPU reason where one applies
    fallback: tuple = ()  # `{tuned}` before the tune-step-* steps have a best point


def _bench(name, what, extra, budget, kind="attention", needs_gpu=False, skip=""):
    args = ("-m", "lab.tools.attention_bench", *extra, "plot=false", "out_dir={out}")
    return Step(name, what, args, budget, needs_gpu, kind, skip)


def _mfu(name, attention, size):
    if size == "tiny":
        args = ("model=tiny", "steps=6", f"attention={attention}", "{tuned}")
    else:
        args = ("model=1b", "seq_len=2048", "steps=60", f"attention={attention}", "{tuned}")
    return Step(
        name,
        f"the training step, attention={attention}: step time, tokens/s, MFU",
        ("-m", "lab.run", *args, f"name={name}", "out_dir={out}"),
        540,
        kind="train",
        fallback=("remat=full", "batch_size=8"),
    )


def plan(size: str) -> list[Step]:
    """The runbook in priority order: the kernels' correctness on the device, ceilings,
    attention against cuDNN, the step's MFU, serving, the ledger, then tuning."""
    tiny = size == "tiny"
    gpu_kernels = "impls=pallas_mgpu,pallas_gpu,cudnn", "heads=8", "kv_heads=2", "quick=true"
    steps = [
        _bench(
            f"kernels-k{k}",
            f"Mosaic GPU and Triton kernels vs float64 (and cuDNN), K={k}",
            (*gpu_kernels, f"head_dim={k}"),
            300,
            "correctness",
            True,
            KERNELS_ON_CPU,
        )
        for k in (64, 128)
    ]
    ceilings = ("quick=true", "plot=false") if tiny else ()
    steps.append(
        Step(
            "ceilings",
            "matmul peaks per dtype, copy bandwidth, roofline",
            ("-m", "lab.tools.ceilings", *ceilings, "out_dir={out}"),
            240,
            kind="ceilings",
        )
    )
    steps.append(
        Step(
            "prediction",
            "the step-time model against this GPU: single ops and lab.run steps timed and "
            "predicted, held out (none started after 360 s: the tables are printed in budget)",
            ("-m", "lab.tools.prediction", "here=true", "stop_after=360", "out_dir={out}"),
            540,
            needs_gpu=True,
            kind="prediction",
        )
    )
    steps += [
        Step(
            f"targets-k{k}",
            f"the GPU-speed grid against cuDNN, judged, K={k}",
            ("-m", "lab.tools.attention_targets", f"head_dims={k}", "out_dir={out}"),
            540,
            needs_gpu=True,
            kind="targets",
        )
        for k in (64, 128)
    ]
    for mode in ("fwd", "fwd+bwd"):  # four steps: one full sweep may outlast ten minutes
        for causal in ("yes", "no"):
            name = f"attention-{mode.replace('+', '-')}-{'causal' if causal == 'yes' else 'full'}"
            what = f"every impl and peer, {mode}, causal={causal}: TFLOP/s, memory"
            extra = ("quick=true", "seqs=128", "impls=blockwise,xla", "budget=0.05") if tiny else ()
            steps.append(_bench(name, what, (*extra, f"modes={mode}", f"causal={causal}"), 540))
    # one step per remat policy: each compiles lab.run's real step for every batch size
    remats = ("none",) if tiny else ("none", "dots", "full")
    batches = "batches=2" if tiny else "batches=4,8,16"
    model = (
        ("model=tiny", "budget=0.2") if tiny else ("model=1b", "attention=pallas", "seq_len=2048")
    )
    steps += [
        Step(
            f"tune-step-{remat}",
            f"batch sizes by MFU at remat={remat}",
            ("-m", "lab.tools.tune_step", *model, f"remats={remat}", batches, "out_dir={out}"),
            540,
            kind="tune-step",
        )
        for remat in remats
    ]
    steps += [
        _mfu("mfu-kernel", "blockwise" if tiny else "pallas", size),
        _mfu("mfu-xla", "xla", size),
    ]
    bench = ("model=tiny", "budget=0.5") if tiny else ()
    steps.append(
        Step(
            "bench-step",
            "the lab's step against a bare flax + optax step",
            ("-m", "lab.tools.bench_step", *bench, "out_dir={out}"),
            300,
            kind="bench-step",
        )
    )
    serve = (
        (
            "model=tiny",
            "batches=1,2",
            "prefill_batches=1",
            "prompt_len=8",
            "decode_steps=2",
            "int8=false",
            "budget=0.05",
        )
        if tiny
        else ()
    )
    steps.append(
        Step(
            "serve",
            "prefill, decode over batch vs HBM bandwidth, int8",
            (
                "-m",
                "lab.serve",
                *serve,
                "plot=false",
                "results={out}",  # lab.serve's records; its out_dir= is where runs are
            ),
            540,
            kind="serve",
        )
    )
    steps.append(
        Step(
            "serve-1b",
            "a bigger model, where decode meets the ridge",
            (
                "-m",
                "lab.serve",
                "model=1b",
                "batches=1,4,16,64,256",
                "prompt_len=512",
                "plot=false",
                "results={out}",
            ),
            540,
            needs_gpu=True,
            kind="serve",
        )
    )
    groups = {
        "compute": "C01,C03,C05,C06,C07,C19,C20",
        "training": "C02,C04,C08,C15,C17",
        "memory": "C09,C10,C11,C12,C13,C14",
        "inference": "C16,C18,C21,C22",
    }
    steps += [
        Step(
            f"ledger-{g}",
            f"the claims ledger: {claims}",
            # one cache of compiled programs for every group and retry: cold, the inference
            # group's H100 decode compiles alone take minutes of its budget
            (
                "-m",
                "experiments",
                f"size={size}",
                f"only={claims}",
                "out_dir={out}",
                "cache_dir={root}/prediction-cache",
            ),
            570,
            kind="ledger",
        )
        for g, claims in groups.items()
    ]
    steps += [
        Step(
            f"tune-{kernel}-k{k}",
            f"{kernel} block sizes against cuDNN, K={k} (records only)",
            (
                "-m",
                "lab.tools.attention_tune",
                f"kernel={kernel}",
                f"head_dims={k}",
                *(("space=quick",) if kernel == "pallas_mgpu" else ()),
                "out_dir={out}",
            ),
            570,
            needs_gpu=True,
            kind="log",
        )
        for kernel in ("pallas_gpu", "pallas_mgpu")
        for k in (64, 128)
    ]
    return steps


# ------------------------------------------------------------------------------ the platform


PROBE = (
    "import json, jax; d = jax.devices(); print(json.dumps({'backend': jax.default_backend(), "
    "'device_kind': d[0].device_kind, 'device_count': len(d), 'jax_version': jax.__version__}))"
)


def probe_platform(timeout_s: float = 180.0) -> dict:
    """Backend, device kind and count and jax version, as the steps' subprocesses see them."""
    # without preallocation: a probe beside a live step (another runbook's) must not take
    # 75% of the GPU's memory from it
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=timeout_s, env=env
    )
    if out.returncode:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return {"backend": "unknown", "device_kind": "unknown", "error": tail}
    return json.loads(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------- the state


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def load_state(root: Path, platform: dict, size: str, say=print) -> dict:
    """The state file for this machine and size; one for another is kept beside it and a fresh
    one begins (a CPU outcome says nothing about a GPU). A step left `running` was stopped with
    the runbook itself (killed, or the machine went away): it is cut short."""
    path = root / STATE
    fresh = {"platform": platform, "size": size, "steps": {}}
    if not path.exists():
        return fresh
    try:
        state = checked_state(json.loads(path.read_text()))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        stamp, n = int(time.time()), 1
        keep = root / f"state-damaged-{stamp}.json"
        while keep.exists():  # never over an earlier one of the same second
            n += 1
            keep = root / f"state-damaged-{stamp}-{n}.json"
        try:
            path.rename(keep)
        except OSError as moved:  # left in place, a save would write over it: stop instead
            raise ConfigError(
                f"{path} could not be read ({e}) nor moved aside ({moved.strerror or moved}): "
                "move it away yourself, then run again"
            ) from None
        found = _recovered(root, platform, size)
        if found:
            fresh["steps"] = found
            save_state(root, fresh)  # kept now: a run refused before its first step keeps it
            names = ", ".join(found)
            say(
                f"{path} could not be read ({e}): kept as {keep.name}; {len(found)} finished "
                f"step{'s' * (len(found) > 1)} recovered from {OUTCOME} in their folders "
                f"({names}); the rest run again"
            )
        else:
            say(f"{path} could not be read ({e}): kept as {keep.name}; starting afresh")
        return fresh
    same = state.get("size") == size and all(
        state.get("platform", {}).get(k) == platform.get(k) for k in ("backend", "device_kind")
    )
    if not same:
        old = state.get("platform", {})
        keep = (
            root
            / f"state-{old.get('backend', 'unknown')}-{state.get('size')}-{int(time.time())}.json"
        )
        path.rename(keep)
        say(f"{path} was for {old.get('device_kind')} size={state.get('size')}: kept as {keep}")
        return fresh
    in_folder(root, state)
    for name, entry in state["steps"].items():
        if entry.get("status") == "running":
            why = "the runbook itself was stopped mid-step"
            state["steps"][name] = _kept_or_cut(entry, why, None)
    return state


_PATH_KEYS = ("folder", "log")  # a step's files: kept relative to the runbook's folder


def checked_state(state) -> dict:
    """`state` as read from a state file, or ValueError where it has not a runbook state's
    shape (an object whose steps are objects, each outcome kept for a redo one too, their
    files text; the platform an object, the size text)."""

    def entry_ok(e) -> bool:
        return isinstance(e, dict) and all(
            isinstance(e.get(k), str) for k in _PATH_KEYS if e.get(k) is not None
        )

    ok = isinstance(state, dict) and isinstance(state.get("steps"), dict)
    ok = ok and isinstance(state.get("platform", {}), dict)
    ok = ok and isinstance(state.get("size", ""), str)
    for entry in state["steps"].values() if ok else ():
        previous = entry.get("previous") if isinstance(entry, dict) else None
        ok = ok and entry_ok(entry) and (previous is None or entry_ok(previous))
    if not ok:
        raise ValueError("not a runbook's state")
    return state


def in_folder(root: Path, state: dict) -> dict:
    """`state` (as read from `root`'s state file) with each step's files found in `root`: the
    file keeps them relative to it, so the folder may be moved or copied and read from
    anywhere."""
    for entry in state["steps"].values():
        _paths(entry, lambda p: _here(root, p))
    return state


def _paths(entry: dict, change) -> None:
    """`change` every file path of a step's entry, and of the outcome a redo keeps."""
    for e in (entry, entry.get("previous") or {}):
        for key in _PATH_KEYS:
            if e.get(key):
                e[key] = str(change(e[key]))


def _here(root: Path, stored: str) -> Path:
    """A step's stored path in this runbook folder: relative ones (as saved) under `root`; an
    absolute one from an older state file, if it is gone (the folder was moved or copied), by
    its part from `steps/` on."""
    path = Path(stored)
    if not path.is_absolute():
        return root / path
    if "steps" not in path.parts:
        return path
    at = len(path.parts) - 1 - path.parts[::-1].index("steps")
    here = root.joinpath(*path.parts[at:])  # a copy's own files first, not the original's
    return here if here.exists() or not path.exists() else path


def _relative(root: Path, path: str) -> str:
    try:
        return str(Path(path).relative_to(root))
    except ValueError:
        return path


def _kept_or_cut(entry: dict, why: str, ended) -> dict:
    """A step cut short: a redo gives back the finished outcome it was to replace (with a note
    of the attempt), anything else is recorded as cut short."""
    previous = entry.get("previous")
    if previous:
        note = f"try-{entry.get('attempt')} (a redo) was cut short: {why}"
        return {**previous, "attempt": entry.get("attempt"), "redo_cut_short": note}
    cut = {k: v for k, v in entry.items() if k != "previous"}
    return {**cut, "status": "cut short", "reason": why, **({"ended": ended} if ended else {})}


def save_state(root: Path, state: dict) -> None:
    """Written whole and renamed into place: a kill mid-write leaves the previous state. Each
    finished step's outcome is also kept in its own folder (OUTCOME), from which a state file
    damaged later (a hand edit, a bad disk) is rebuilt: finished steps are not run again."""
    tmp = root / f".{STATE}.{os.getpid()}.tmp"
    state = json.loads(json.dumps(state, default=str))  # a copy whose paths are made relative
    for entry in state["steps"].values():
        _paths(entry, lambda p: _relative(root, p))  # the folder may be moved or copied
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, root / STATE)
    for name, entry in state["steps"].items():
        if entry.get("status") in FINISHED and entry.get("folder"):
            _keep_outcome(root / entry["folder"], name, entry, state)


OUTCOME = "outcome.json"  # a finished step's entry in the state, kept in the step's folder


def _keep_outcome(folder: Path, name: str, entry: dict, state: dict) -> None:
    kept = {"step": name, "platform": state.get("platform"), "size": state.get("size")}
    text = json.dumps({**kept, "entry": entry}, indent=2)
    path = folder / OUTCOME
    try:
        if not folder.is_dir() or (path.exists() and path.read_text() == text):
            return
        tmp = folder / f".{OUTCOME}.{os.getpid()}.tmp"
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:  # the state file is what counts; this copy only helps a damaged one
        pass


def _recovered(root: Path, platform: dict, size: str) -> dict:
    """{step: entry} of the finished steps whose folders keep their outcome (OUTCOME) for this
    machine and size, the latest try of each: what a damaged state file held of them."""
    found: dict[str, tuple[int, dict]] = {}
    for path in sorted(root.glob(f"steps/*/try-*/{OUTCOME}")):
        try:
            kept = json.loads(path.read_text())
            entry, name = kept["entry"], kept["step"]
            mine = kept["size"] == size and all(
                (kept["platform"] or {}).get(k) == platform.get(k)
                for k in ("backend", "device_kind")
            )
            attempt = int(entry.get("attempt", 0))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
            continue  # damaged too: that step runs again
        if mine and entry.get("status") in FINISHED and attempt >= found.get(name, (0,))[0]:
            _paths(entry, lambda p: _here(root, p))
            found[name] = (attempt, entry)
    return {name: entry for name, (_, entry) in sorted(found.items())}


# ------------------------------------------------------------------------------- the command


_NOTED: set = set()  # (file, size) whose cut-short last line was said: said once a process


def read_records(folder: Path, say=print) -> list[dict]:
    """Every record under `folder` (lines of any *.jsonl with a `what`); a torn last line, as a
    killed step may leave (no newline after it), is passed over with a note (`say`, once for
    each file). Any other line that is not JSON is a ConfigError naming the file and the line:
    a line damaged mid-file is not a write a kill left, and silently passed over it would
    drop a measurement from the rows."""
    out = []
    for path in sorted(folder.rglob("*.jsonl")) if folder.is_dir() else []:
        text = path.read_text(errors="replace")
        lines = text.split("\n")  # the last is "" where the file ends with its newline
        found = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                if n == len(lines):  # no newline after it: a write cut short
                    if (str(path), len(text)) not in _NOTED:
                        _NOTED.add((str(path), len(text)))
                        k = len(found)
                        kept = "record before it is" if k == 1 else f"{k} records before it are"
                        say(
                            f"note: {path}, line {n} is cut short (a step stopped mid-write): "
                            f"passed over; the {kept} read"
                        )
                    break
                raise ConfigError(
                    f"{path}, line {n}: not a record ({e.msg}), and not a last line cut short "
                    "by a kill: fix or remove the line, then run again (the runbook's state "
                    "and the step's other records are kept)"
                ) from None
            if isinstance(r, dict) and "what" in r and "value" in r:
                found.append({**r, "_file": str(path)})
        out += found
    return out


def _tuned_rows(state: dict) -> dict[str, list[dict]]:
    """Per tune-step-* step with any, its tokens/s records (any attempt's)."""
    out = {}
    for name, entry in state["steps"].items():
        if name.startswith("tune-step") and entry.get("folder"):
            recs = read_records(Path(entry["folder"]))
            recs = [r for r in recs if r["what"] == "training tokens/s"]
            if recs:
                out[name] = recs
    return out


def tuned_args(root: Path, state: dict, fallback: tuple) -> tuple:
    """remat= and batch_size= of the best point by tokens/s the tune-step-* steps found (any
    attempt's records), else `fallback`."""
    rows = [r for recs in _tuned_rows(state).values() for r in recs]
    if not rows:
        return fallback
    best = max(rows, key=lambda r: r["value"])["config"]
    return (f"remat={best['remat']}", f"batch_size={best['batch']}")


def tuned_note(state: dict, fallback: tuple) -> str:
    """Where the remat × batch of a `{tuned}` step came from, for its log line and its row:
    the tune-step-* steps each time in a process of their own, minutes apart, so a pick
    across them compares figures that were not timed side by side."""
    found = _tuned_rows(state)
    args = " ".join(tuned_args(Path(), state, fallback))
    if not found:
        return f"{args}: a placeholder (no tune-step step has records)"
    if len(found) == 1:
        return f"{args}: {next(iter(found))}'s best by tokens/s"
    return (
        f"{args}: the most tokens/s over {len(found)} tune-step steps, each timed in its own "
        "process (not one run's peers: a gap within the machine's drift may name either)"
    )


def command(step: Step, out: Path, root: Path, state: dict) -> list[str]:
    argv = [sys.executable]
    for a in step.args:
        if a == "{tuned}":
            argv += tuned_args(root, state, step.fallback)
        else:
            argv.append(a.replace("{out}", str(out)).replace("{root}", str(root)))
    return argv


def shown(argv: list[str]) -> str:
    return " ".join(["python", *argv[1:]])


@dataclasses.dataclass
class Outcome:
    status: str  # done | failed | cut short
    reason: str
    seconds: float
    returncode: int | None


def run_bounded(
    argv: list[str], log: Path, limit_s: float, why: str, ended: list | None = None
) -> Outcome:
    """`argv` in its own process group, output to `log`, killed past `limit_s` (SIGTERM, then
    SIGKILL). Ctrl-C or SIGTERM to the runbook stops the step the same way, then goes on up;
    a step that had already exited 0 when the stop came is appended to `ended` as done (its
    work is complete, only the runbook's wait for it was cut)."""
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "1"}
    with log.open("w") as f:
        p = subprocess.Popen(
            argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            rc = p.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            _stop(p)
            return Outcome("cut short", why, time.perf_counter() - t0, None)
        except BaseException:
            _stop(p)
            if p.returncode == 0 and ended is not None:
                ended.append(Outcome("done", "", time.perf_counter() - t0, 0))
            raise
    seconds = time.perf_counter() - t0
    if rc:
        return Outcome("failed", f"exit code {rc}: {_last_line(log)}", seconds, rc)
    return Outcome("done", "", seconds, 0)


def _stop(p: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _last_line(log: Path) -> str:
    lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    return lines[-1][:200] if lines else "no output"


# ---------------------------------------------------------------------------------- the run


@dataclasses.dataclass(frozen=True)
class Request:
    budget_s: float  # the whole invocation's wall time
    spent_s: float  # of it, before the first step (the platform probe)
    min_step_s: float  # a step starts only with this much budget left
    redo: tuple = ()  # step names, "failed" or "all": run again though finished
    only: tuple = ()  # step names to consider; () = all


def wants_redo(name: str, entry: dict, redo: tuple) -> bool:
    return "all" in redo or name in redo or ("failed" in redo and entry.get("status") == "failed")


def fit(
    steps: list[Step], state: dict, budget_s: float, min_step_s: float, redo=(), gpu: bool = True
) -> list:
    """What one call with `budget_s` does with each step if every step takes its whole budget
    (the most it may take; a step that ends early leaves its time to the next), as `execute`
    would run them: (step, verdict, seconds left when it starts), the verdict "finished" (a
    rerun skips it), "fits", "cut" (started with less than its budget left, cut short if it
    needs more), "later" (not started: min_step_s or less left) or, without a GPU (`gpu`
    false), "skipped" for a step that needs one (it takes none of the budget)."""
    left, out = budget_s, []
    for step in steps:
        entry = state["steps"].get(step.name, {})
        if entry.get("status") in FINISHED and not wants_redo(step.name, entry, redo):
            out.append((step, "finished", left))
        elif step.needs_gpu and not gpu:
            out.append((step, "skipped", left))
        elif left < min_step_s:
            out.append((step, "later", left))
        else:
            out.append((step, "fits" if step.budget_s <= left else "cut", left))
            left -= min(step.budget_s, left)
    return out


def execute(
    steps: list[Step],
    root: Path,
    platform: dict,
    state: dict,
    req: Request,
    *,
    judge: Callable[[Step, dict], tuple[str, str] | None] = lambda step, entry: None,
    after_step: Callable[[dict], None] = lambda state: None,
    say=print,
    clock=time.perf_counter,
) -> dict:
    """Run the steps in order under `req`, saving `state` after each. `judge(step, entry)` may
    turn a finished step into a failure: (status, reason), e.g. a kernel's error over its
    tolerance. `after_step(state)` runs after every step (the Markdown rows)."""
    t0 = clock() - req.spent_s
    backend = platform.get("backend", "unknown")
    chosen = [s for s in steps if not req.only or s.name in req.only]
    for i, step in enumerate(chosen, 1):
        entry = state["steps"].get(step.name, {})
        head = f"[{i}/{len(chosen)}] {step.name}"
        if entry.get("status") in FINISHED and not wants_redo(step.name, entry, req.redo):
            say(f"{head}: {entry['status']} before ({entry.get('seconds', 0):.0f} s), skipped")
            continue
        if step.needs_gpu and backend != "gpu":
            reason = GPU_REASON.format(backend=backend) + step.skip_reason
            state["steps"][step.name] = {"status": "skipped", "reason": reason}
            say(f"{head}: skipped: {reason}")
            save_state(root, state)
            continue
        left = req.budget_s - (clock() - t0)
        if left < req.min_step_s:
            reason = (
                f"{max(left, 0):.1f} s of the run's budget={req.budget_s:g} left, less than "
                f"min_step={req.min_step_s:g}"
            )
            if entry.get("status") in FINISHED:
                say(f"{head}: not started: {reason} (the previous outcome stands)")
                continue
            state["steps"][step.name] = {**entry, "status": "not started", "reason": reason}
            say(f"{head}: not started: {reason}")
            save_state(root, state)
            continue
        limit = min(step.budget_s, left)
        why = (
            f"past its budget of {limit:g} s"
            if limit == step.budget_s
            else f"the run's budget={req.budget_s:g} ran out ({limit:.0f} s were left for it)"
        )
        attempt = int(entry.get("attempt", 0)) + 1
        out = root / "steps" / step.name / f"try-{attempt}"
        # a fresh state (the old one damaged, or another machine's) counts from 1 again: a
        # folder an earlier try left is never reused, or its records would join this row
        while out.exists():
            attempt += 1
            out = out.with_name(f"try-{attempt}")
        out.mkdir(parents=True)
        argv = command(step, out, root, state)
        log = out / "output.log"
        previous = {k: v for k, v in entry.items() if k not in ("previous", "redo_cut_short")}
        entry = {
            "status": "running",
            "previous": previous if previous.get("status") in FINISHED else None,
            "attempt": attempt,
            "folder": str(out),
            "log": str(log),
            "command": shown(argv),
            "budget_s": round(limit, 1),
            "started": _now(),
        }
        if "{tuned}" in step.args:  # the row and the log say where its remat × batch came from
            entry["tuned"] = tuned_note(state, step.fallback)
        state["steps"][step.name] = entry
        save_state(root, state)
        say(f"{head}: {shown(argv)}  (at most {limit:.0f} s)")
        if entry.get("tuned"):
            say(f"{head}: {entry['tuned']}")
        ended = []  # the step's outcome where it had exited 0 before the runbook was stopped
        try:
            result = run_bounded(argv, log, limit, why, ended)
        except BaseException:
            if ended:
                _record(step, entry, ended[0], judge)
                say(f"{head}: {entry['status']} (it had exited before the runbook was stopped)")
            else:
                why = "the runbook was interrupted"
                state["steps"][step.name] = _kept_or_cut(entry, why, _now())
            save_state(root, state)
            raise
        if result.status == "cut short" and entry["previous"]:  # a redo that did not finish
            state["steps"][step.name] = _kept_or_cut(entry, result.reason, _now())
            say(f"{head}: cut short: {result.reason} (the previous outcome stands)")
            save_state(root, state)
            after_step(state)
            continue
        _record(step, entry, result, judge)
        tail = f": {entry['reason']}" if entry["reason"] else ""
        say(f"{head}: {entry['status']} in {result.seconds:.1f} s{tail}  (log {log})")
        save_state(root, state)
        after_step(state)
    return state


def _record(step: Step, entry: dict, result: Outcome, judge) -> None:
    """`entry` (the state's, updated in place) as the step ended: its outcome, judged."""
    entry.pop("previous", None)
    entry.update(
        status=result.status,
        reason=result.reason,
        seconds=round(result.seconds, 1),
        returncode=result.returncode,
        ended=_now(),
    )
    verdict = judge(step, entry) if result.status == "done" else None
    if verdict:
        entry["status"], entry["reason"] = verdict


# ------------------------------------------------------------------------------- the verdict

KERNELS = ("pallas_mgpu", "pallas_gpu")  # what the correctness steps are for (cuDNN is a peer)


def judge(step: Step, entry: dict) -> tuple[str, str] | None:
    """A correctness step that ran is failed when a kernel under test did not run or its error
    against float64 is over the tuner's tolerance for the dtype; None otherwise."""
    if step.kind != "correctness":
        return None
    from lab.studies.tune import TOL  # jax is imported, no backend started

    records = read_records(Path(entry["folder"]))
    problems = []
    for impl in KERNELS:
        errors = [
            r for r in records if r["what"] == "attention max error" and r["config"]["impl"] == impl
        ]
        if not errors:
            why = [
                r["value"]
                for r in records
                if r["what"] == "attention skipped" and r["config"]["impl"] == impl
            ]
            problems.append(f"{impl} did not run" + (f" ({why[0]})" if why else ""))
            continue
        worst = max(errors, key=lambda r: r["value"])
        dtype = str(worst["config"].get("dtype", ""))
        name = max((n for n in TOL if n in dtype), key=len, default=None)  # not float16 in bf16
        tol = TOL.get(name)
        if tol is not None and not worst["value"] <= tol:
            problems.append(f"{impl} max error {worst['value']:.2g} > {tol:g} ({dtype})")
    return ("failed", "; ".join(problems)) if problems else None
