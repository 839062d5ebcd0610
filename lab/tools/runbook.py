"""`python -m lab.tools.runbook budget=SECONDS`: BENCHMARKS.md's GPU runbook as one command.

Each step (the kernels' correctness on the device first, then ceilings, attention against
cuDNN, the step's MFU, serving, the ledger, tuning) is the existing command run as a
subprocess under its own time budget, killed and recorded as cut short past it; the whole run
stops starting steps when budget= is spent. Outcomes go to <out_dir>/runbook/state.json as
they happen, so a rerun skips what finished (redo= names what to run again) and a job cut
short loses nothing. The records every step wrote become BENCHMARKS-ready Markdown rows in
<out_dir>/runbook/BENCHMARKS-rows.md, printed at the end. Steps that need a GPU are skipped on
any other backend, with the reason; without a GPU only size=tiny runs (the rest at tiny sizes,
minutes on CPU: a check of the machinery). dry_run=true prints the plan (steps, budgets,
commands) and runs nothing.
"""

import contextlib
import dataclasses
import glob
import json
import signal
import sys
import threading
import time
from pathlib import Path

from lab import checkpoint
from lab.config import cli, did_you_mean, field
from lab.errors import ConfigError, Terminated
from lab.measure import records as rec
from lab.report import runbook as rows
from lab.studies import runbook

SIZES = ("full", "tiny")


@dataclasses.dataclass(frozen=True)
class Options:
    budget: float = field(
        570.0, "seconds for the whole run (steps are killed when it is spent)", min=1.0
    )
    size: str = field(
        "full", "full (a GPU's sizes) | tiny (minutes on CPU: checks the machinery)", choices=SIZES
    )
    steps: tuple = field((), "only these steps, in the plan's order (default: all)", kind="names")
    redo: tuple = field(
        (), "run these again though finished: step names, failed, or all", kind="names"
    )
    min_step: float = field(
        20.0, "a step starts only with at least this many seconds of budget left", min=0.0
    )
    out_dir: str = field("results", "the runbook's folder is <out_dir>/runbook", kind="path")
    dry_run: bool = field(False, "print the plan (steps, budgets, commands) and run nothing")


def _check_names(key: str, given: tuple, known: list[str], extra: tuple = ()) -> None:
    for name in given:
        if name not in known and name not in extra:
            hint = did_you_mean(name, [*known, *extra])
            raise ConfigError(f"{key}={name!r}: no such step{hint}; steps: {', '.join(known)}")


def gpu_visible() -> bool:
    """Whether this machine shows an NVIDIA GPU (a device node /dev/nvidia0, …): what a dry
    run can tell without starting JAX (a run probes the platform itself)."""
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def _print_plan(steps, o: Options, root: Path, gpu: bool) -> None:
    """Each step's budget, command and, where a state file is there, its last outcome; `gpu`:
    whether this machine has one (without, the steps that need one are shown skipped)."""
    path = root / runbook.STATE
    try:
        state = runbook.in_folder(root, runbook.checked_state(json.loads(path.read_text())))
    except (OSError, ValueError):
        state = {"steps": {}}  # none yet, or unreadable (a run sets it aside): the plan alone
    print(f"runbook plan · size={o.size} · budget={o.budget:g} s · folder {root}")
    refused = not gpu and o.size == "full"
    if refused:
        print(
            "(no NVIDIA GPU found here: a run at size=full is refused on this machine; "
            "size=tiny rehearses it. The plan below is what a GPU machine would run)"
        )
        gpu = True  # a plan for the machine it is refused for, said as such
    if state["steps"] and state.get("size") != o.size:  # a run would set it aside (load_state)
        print(f"({path} is for size={state.get('size')}: a run at size={o.size} starts afresh)")
        state = {"steps": {}}
    if state["steps"]:
        where = state.get("platform", {}).get("device_kind")
        print(f"outcomes so far ({path}: {where}, size={state.get('size')}):")
    fitted = runbook.fit(steps, state, o.budget, o.min_step, o.redo, gpu=gpu)
    for i, (s, verdict, left) in enumerate(fitted, 1):
        argv = runbook.command(s, root / "steps" / s.name / "try-N", root, state)
        needs = " · needs a GPU" if s.needs_gpu else ""
        last = state["steps"].get(s.name, {}).get("status")
        first = "the first call there" if refused else "this call"
        when = {"cut": f" · {first}, {left:.0f} s left", "later": " · a later call"}
        when = when.get(verdict, " · skipped here" if verdict == "skipped" else "")
        print(
            f"{i:2}. {s.name} ({s.budget_s:.0f} s{needs}{when}): {s.what}"
            f"{f' [{last}]' if last else ''}"
        )
        print(f"    {runbook.shown(argv)}")
        if "{tuned}" in s.args and not runbook.tuned_args(root, state, ()):
            print(
                f"    ({' '.join(s.fallback)} is a placeholder until the tune-step-* steps "
                "finish: the run takes the remat × batch they found best)"
            )
    line = _fit_line(fitted, o, gpu, call="a call on a GPU machine" if refused else "this call")
    if refused:  # no footer that reads as if this call ran anything
        line = (
            "this machine runs none of it (size=full needs an NVIDIA GPU; size=tiny rehearses "
            f"it). {line}"
        )
    print(line)


def _spans(numbers: list[int]) -> str:
    """1, 2, 3, 5 → '1-3, 5'."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


PROBE_S = 60  # at most, for the platform probe a run starts with (jax's start on a GPU)


def _fit_line(fitted: list, o: Options, gpu: bool = True, call: str = "this call") -> str:
    """Which steps one call of budget= runs, at the most each may take, and which it leaves:
    on this machine, whose steps that need a GPU are skipped where it has none (`gpu`)."""
    numbered = [(i, s, v, left) for i, (s, v, left) in enumerate(fitted, 1) if v != "finished"]
    if not numbered:
        return "every step has finished: redo= names those to run again"
    runs = [i for i, _, v, _ in numbered if v in ("fits", "cut")]
    cut = [f"{s.name} starts with {left:.0f} s left" for _, s, v, left in numbered if v == "cut"]
    later = [(i, s) for i, s, v, _ in numbered if v == "later"]
    where = "on a GPU" if gpu else "here (no NVIDIA GPU found)"
    line = (
        f"budget={o.budget:g} s, {where}, each step taking at most its budget: {call} runs "
        f"step{'s' * (len(runs) != 1)} {_spans(runs) or 'none'}"
    )
    if cut:
        line += f" ({'; '.join(cut)} and is cut short if it needs more)"
    if later:
        need = sum(s.budget_s for _, s, v, _ in numbered if v not in ("finished", "skipped"))
        which = _spans([i for i, _ in later])
        line += (
            f"; step{'s' * (len(later) != 1)} {which} ({sum(s.budget_s for _, s in later):,.0f} s "
            "at most) are left for later calls of the same command (finished steps are "
            f"skipped), or give budget={need + PROBE_S:.0f} for all at once (their sum and "
            f"{PROBE_S} s for the platform probe, which the budget counts)"
        )
    gpu_only = sum(1 for _, s, _, _ in numbered if s.needs_gpu)
    if gpu_only and gpu and o.size != "full":  # size=full is refused off a GPU: not offered
        line += (
            f". Off a GPU the {gpu_only} step{'s' * (gpu_only != 1)} marked 'needs a GPU' "
            f"{'are' if gpu_only != 1 else 'is'} skipped, taking none of the budget, so more of "
            "the others fit"
        )
    elif gpu_only and not gpu:
        skipped = _spans([i for i, _, v, _ in numbered if v == "skipped"])
        line += (
            f". Step{'s' * (gpu_only != 1)} {skipped} need{'s' * (gpu_only == 1)} a GPU: "
            "skipped here, taking none of the budget (on a GPU "
            f"{'they run' if gpu_only != 1 else 'it runs'}, and fewer of the others fit)"
        )
    return line + "."


def _command_line(o: Options) -> str:
    """The command that asked for this run: its keys that differ from the defaults."""
    keys = []
    for f in dataclasses.fields(o):
        value = getattr(o, f.name)
        if value != f.default and f.name != "dry_run":
            text = (
                ",".join(value)
                if isinstance(value, tuple)
                else f"{value:g}"
                if isinstance(value, float)
                else str(value)
            )
            keys.append(f"{f.name}={text}")
    return " ".join(["python -m lab.tools.runbook", *keys])


@contextlib.contextmanager
def _sigterm_stops_the_step():
    """SIGTERM (a job scheduler's stop) is handled as Ctrl-C is (the step in flight is stopped
    and the state saved), and exits 143. Only the main thread may set a handler; elsewhere
    nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise Terminated

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(o: Options, *, steps=None, probe=None, gpu=None) -> int:
    """`steps`, `probe` and `gpu` (whether a dry run finds a GPU here) replace the plan, the
    platform probe and the dry run's look for a GPU (the tests' seam)."""
    steps = runbook.plan(o.size) if steps is None else steps
    names = [s.name for s in steps]
    _check_names("steps", o.steps, names)
    _check_names("redo", o.redo, names, extra=("failed", "all"))
    if o.min_step >= o.budget:  # every call of it would start nothing, however often made
        raise ConfigError(
            f"min_step={o.min_step:g} is not below budget={o.budget:g}: a step starts only with "
            "min_step seconds of the budget left, and the platform probe takes some of it "
            "first, so no step could ever start; give a larger budget= or a smaller min_step="
        )
    root = Path(o.out_dir) / "runbook"
    chosen = [s for s in steps if not o.steps or s.name in o.steps]
    if o.dry_run:
        _print_plan(chosen, o, root, gpu_visible() if gpu is None else gpu)
        return 0
    t0 = time.perf_counter()
    # the platform decides whether this size can run at all: a refusal leaves no folder and
    # no lock behind, so it is checked before either is made
    platform = (probe or runbook.probe_platform)()
    _check_platform(o, platform)
    rec.writable_dir(root)
    with contextlib.ExitStack() as held:
        try:  # one runbook per folder: two would run the same steps into one state file
            held.enter_context(checkpoint.Lock(root))
        except ConfigError:
            raise ConfigError(
                f"{root} is in use by another runbook: wait for it, or give another out_dir="
            ) from None
        return _run_held(o, steps, names, chosen, root, platform, t0)


def _check_platform(o: Options, platform: dict) -> None:
    """ConfigError where size= cannot run on the probed platform (full needs a GPU)."""
    if platform.get("backend") != "gpu" and o.size == "full":
        found = (
            f"the platform probe failed ({platform['error']})"
            if platform.get("error")
            else f"this machine has no GPU (backend {platform.get('backend')})"
        )
        raise ConfigError(
            f"size=full is the GPU runbook and {found}: its steps would skip or run at a GPU's "
            "sizes here. size=tiny rehearses it (minutes), dry_run=true prints its plan"
        )


def _run_held(o: Options, steps, names, chosen, root: Path, platform: dict, t0: float) -> int:
    if platform.get("error"):
        print(f"note: the platform probe failed ({platform['error']}); GPU steps are skipped")
    print(
        f"runbook · {platform.get('device_kind')} × {platform.get('device_count', '?')} "
        f"({platform.get('backend')}) · size={o.size} · budget={o.budget:g} s → {root}"
    )
    state = runbook.load_state(root, platform, o.size)
    # the rows read the records of every step this run does not run again: a line damaged
    # mid-file stops the run here, before a step takes any of the budget, and a last line cut
    # short is noted once, here
    again = {
        s.name
        for s in chosen
        if state["steps"].get(s.name, {}).get("status") not in runbook.FINISHED
        or runbook.wants_redo(s.name, state["steps"][s.name], o.redo)
    }
    for name, entry in state["steps"].items():
        if entry.get("folder") and name not in again:
            try:
                runbook.read_records(Path(entry["folder"]))
            except ConfigError as e:
                raise ConfigError(f"{e}; or redo={name} runs that step again") from None
    command = _command_line(o)
    date = time.strftime("%Y-%m-%d")

    def write_rows(state) -> str:
        # every step of the plan this run chose or an earlier run tried: a runbook run in
        # pieces (steps=…) keeps the rows of the pieces before
        shown = [s for s in steps if s in chosen or s.name in state["steps"]]
        table = rows.rows(shown, state, lambda f: runbook.read_records(Path(f)), root)
        text = rows.markdown(table, platform, command, date)
        (root / runbook.ROWS).write_text(text)
        return text

    request = runbook.Request(
        budget_s=o.budget,
        spent_s=time.perf_counter() - t0,
        min_step_s=o.min_step,
        redo=o.redo,
        only=o.steps,
    )
    with _sigterm_stops_the_step():
        try:
            state = runbook.execute(
                steps, root, platform, state, request, judge=runbook.judge, after_step=write_rows
            )
        except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: where the work is, how to go on
            raise type(e)(
                f"the outcomes so far are saved in {root} ({runbook.STATE}, {runbook.ROWS}); "
                f"rerunning the same command ({command}) resumes, skipping the finished steps"
            ) from None
        finally:
            write_rows(state)
    print()
    print(write_rows(state))
    print(f"rows → {root / runbook.ROWS} · state → {root / runbook.STATE}")
    bad = [n for n, e in state["steps"].items() if e.get("status") == "failed" and n in names]
    return 1 if bad else 0


def main(argv=None) -> int:
    return cli(Options, run, prog="python -m lab.tools.runbook", doc=__doc__, argv=argv)


if __name__ == "__main__":
    from lab.report.progress import survive_lost_output

    survive_lost_output()  # a reader gone (| head) loses no records or report
    sys.exit(main())
