"""`python -m experiments [size=tiny|quick|full] [only=C03,C08] [plans=auto|on|off]
[out_dir=results]`: the ledger.

Runs the experiment modules with a progress bar, appends every record to
results/<backend>-<device>-<timestamp>/records.jsonl as each module finishes, then renders
REPORT.md and the plots from those records and prints the verdict table. On CPU the process
simulates 8 devices (as the tests do) so the parallelism experiments have a mesh. Stopped by
Ctrl-C or SIGTERM (a time limit), it writes REPORT.md from the topics that finished, names the
one cut short, and exits with one line.

plans=on (or size=full) adds what is compiled for hardware that is not here (compiled, not
run, or predicted from the compiled program by the step-time model): C10's and C14's plans
(the Llama-2-7B step compiled for 1 H100, the 70B step for 8, 16 and 32 H100s under dp, fsdp
and tp, each with the compiler's memory per device beside the calculator's;
experiments/gpu_plans.py), C11's remat=offload step for one H100, and the predicted GPU and TPU
figures of C01, C02, C05, C15, C17 and C19 and the prediction topic's table (the GPU matmuls
and training steps compiled for their GPUs). Minutes on 2 cores: e.g.
`python -m experiments only=C10,C14 plans=on`.
"""

import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from experiments.common import SIZES
from lab import startup
from lab.config import cli, field


@dataclasses.dataclass(frozen=True)
class Options:
    size: str = field(
        "quick",
        "tiny (2 min on 2 cores at load 1-3, 8 at load 8-13) | quick | full (GPU/TPU VMs)",
        choices=SIZES,
    )
    only: tuple = field((), "claim ids to measure, e.g. C03,C08 (default: all)", kind="names")
    out_dir: str = field(
        "results", "where results/<backend>-<device>-<time>/ is written", kind="path"
    )
    cache_dir: str = field(
        "",
        "the compiled programs its predictions reuse (tens of seconds to minutes each to "
        "compile); empty = out_dir's prediction-cache",
        kind="path",
    )
    plans: str = field(
        "auto",
        "compile for hardware that is not here: the Llama-2 7B/70B steps for 1-32 H100s (C10,"
        " C14), and the programs behind the predicted GPU/TPU figures (C01, C02, C05, C11, C15,"
        " C17, C19, prediction); needs the gpu-plan extra, minutes on 2 cores (tens of minutes"
        " the first time: prediction compiles each published point once, then caches it): on,"
        " off, auto (on with size=full)",
        choices=("auto", "on", "off"),
    )


def _points_so_far(out_dir, module: str, size: str) -> int:
    """Append the records of the points the topic `module` finished before a stop (each a
    point's own figures, marked cut_short; the topic's verdicts need its whole sweep, so
    none of its evidence is among them); how many were kept."""
    from experiments.common import records_so_far
    from lab.measure import records as rec

    try:
        records = records_so_far()
        for r in records:
            r["config"].update(module=module, size=size, cut_short=True)
        if records:
            rec.write_records(out_dir / "records.jsonl", records)
        return len(records)
    except Exception:  # noqa: BLE001 - the stop's line and report must still come
        return 0


@contextlib.contextmanager
def _signals_keep_what_finished(out_dir, meta: dict, only, con, writing: threading.Lock):
    """Ctrl-C or SIGTERM (a scheduler's stop, `timeout`) while a topic runs: REPORT.md is
    written from the records of the topics that finished (each topic appends its records as
    it ends), the one in flight is named as cut short, and the process exits with one line
    (130 or 143), not a traceback out of a compile or a kernel.

    The work is done on a thread that the signal wakes at once (`signal.set_wakeup_fd`), not
    in a Python handler, which runs only when the main thread is back in Python: a compile or
    a device wait can take minutes, and a scheduler's SIGKILL follows soon after its SIGTERM.
    It waits on `writing`, so a topic's records are appended whole before it reads them.
    Main thread only; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from lab.report import markdown

    def stop(signum: int) -> None:
        name = signal.Signals(signum).name
        with writing:  # a topic's records are appended whole, then never again
            current = meta.get("current")
            if current:
                kept = _points_so_far(out_dir, current, meta["size"])
                meta["modules"][current] = {
                    "wall_s": time.perf_counter() - meta["current_start"],
                    "records": kept,
                    "error": f"cut short by {name}: "
                    + (f"the {kept} records of its finished points kept" if kept else "no records"),
                }
            meta["wall_s"] = time.perf_counter() - meta["start"]
            hidden = ("current", "current_start", "start")
            shown = {k: v for k, v in meta.items() if k not in hidden}
            try:
                path = markdown.write_report(out_dir, meta=shown, only=only)["path"]
                kept = f"the finished topics' records and {path.name} are in {out_dir}"
            except Exception as e:  # noqa: BLE001 - the line must still be printed
                kept = f"the finished topics' records are in {out_dir} (no report: {e})"
            try:
                con.show_cursor(True)  # the progress bar hid it; no exit handler will run
                sys.stdout.flush()
            except Exception:  # noqa: BLE001 - a closed pipe must not keep the process alive
                pass
            where = f" during {current}" if current else ""
            try:  # a closed stderr (2>&1 | head) must not keep the process from exiting
                os.write(2, f"{name}: stopped{where}; {kept}\n".encode())
            except OSError:
                pass
            os._exit(130 if signum == signal.SIGINT else 143)

    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)

    def watch() -> None:
        try:
            got = os.read(read_fd, 1)
        except OSError:  # the pipe was closed: the run ended
            return
        if got:
            stop(got[0])

    watcher = threading.Thread(target=watch, name="ledger-stop", daemon=True)
    watcher.start()
    handled = (signal.SIGINT, signal.SIGTERM)
    # the Python-level handler does nothing: the C-level one has already woken the watcher
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in handled}
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    # a topic may load a native library that takes SIGTERM over (Mosaic GPU: absl's handler)
    unwatch = startup.keep_python_handlers(handled)
    try:
        yield
    finally:
        unwatch()
        signal.set_wakeup_fd(previous_fd)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.close(write_fd)  # the watcher's read returns b"": it ends
        watcher.join()  # or a stop it heard is writing the report: it ends the process
        os.close(read_fd)


def _run_topics(o: Options, names, meta: dict, out_dir, con, writing, only) -> dict:
    """Each topic in turn, its records appended as it ends, then REPORT.md (and run.json)
    written under `writing`: a stop that comes while the report is being written waits for it,
    then writes it again whole, so no signal leaves a run folder without its report."""
    from experiments import load, plan_kwargs
    from experiments.common import keep_so_far, on_step
    from lab.measure import records as rec
    from lab.report import markdown, progress

    with progress.tasks(con) as bar, contextlib.ExitStack() as after:
        after.callback(on_step, None)  # however the loop ends, no topic's hook outlives it
        task = bar.add_task("starting", total=len(names))
        for name in names:
            module = load(name)
            claims = f" ({', '.join(module.CLAIMS)})" if module.CLAIMS else ""
            bar.update(task, description=f"{name}{claims}")
            start = time.perf_counter()
            keep_so_far(None)  # a topic that keeps its points says so as it starts

            def where(text, name=name, claims=claims):  # a topic's steps: a line each off a tty
                bar.update(task, description=progress.label(f"{name}{claims}: {text}", 90))

            on_step(where)
            meta["current"], meta["current_start"] = name, start
            try:
                records = module.run(o.size, **plan_kwargs(name, o.plans, o.size))
                for r in records:  # whose each is, and at what size: read without run.json
                    r["config"].update(module=name, size=o.size)
                error = None
            except Exception as e:  # noqa: BLE001 — one failed topic must not lose the others
                error = f"{type(e).__name__}: {e}"
                con.print(f"[red]{name} failed[/red]: {error}")
                con.print(traceback.format_exc(), markup=False, highlight=False)
                records = []
            with writing:  # appended whole before a stop reads them (not the topic's run)
                try:
                    if records:
                        rec.write_records(out_dir / "records.jsonl", records)
                except OSError as e:
                    error, records = f"its records could not be written: {e}", []
                    con.print(f"[red]{name} failed[/red]: {error}")
                meta["modules"][name] = {
                    "wall_s": time.perf_counter() - start,
                    "records": len(records),
                    "error": error,
                }
                meta["current"] = None
            on_step(None)
            bar.advance(task)
    with writing:
        meta["wall_s"] = time.perf_counter() - meta["start"]
        hidden = ("current", "current_start", "start")
        shown = {k: v for k, v in meta.items() if k not in hidden}
        return markdown.write_report(out_dir, meta=shown, only=only)


def run(o: Options) -> int:
    from experiments import parse_only, select
    from lab.errors import ConfigError

    try:
        only = parse_only(",".join(o.only)) if o.only else None
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if o.plans == "on":  # asked for: refused now, not skipped inside the report
        from lab.plans import gpu

        try:
            gpu.check_compiler()
        except ConfigError as e:
            raise ConfigError(f"plans=on compiles GPU plans, and {e} (or plans=off)") from None
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", 8)
    except RuntimeError:  # backends already up (e.g. under pytest): keep what is there
        pass
    from lab.measure import records as rec
    from lab.report import markdown, progress, tables

    rec.writable_dir(o.out_dir)
    if o.cache_dir:  # refused now, not after minutes of measuring when a plan writes to it
        try:
            rec.writable_dir(o.cache_dir)
        except ConfigError as e:
            raise ConfigError(f"cache_dir={o.cache_dir}: {e}") from None
    from lab.studies import prediction

    # the compiled points beside the results (or where cache_dir= says), never in ./
    prediction.use_cache(o.cache_dir or Path(o.out_dir) / "prediction-cache")
    con = progress.console()
    env = rec.environment()
    out_dir = markdown.results_dir(o.out_dir, env)
    names = select(only)
    t0 = time.perf_counter()
    meta = {"size": o.size, "only": only, "topics": names, "modules": {}, "argv": sys.argv[1:]}
    meta["start"] = t0
    con.print(
        f"experiments · {env['backend']} · {env['device_kind']} × "
        f"{env['device_count']} · size {o.size} → {out_dir}"
    )
    writing = threading.Lock()
    stopping = _signals_keep_what_finished(out_dir, meta, only, con, writing)
    with stopping:  # until the verdicts are printed: a stop leaves REPORT.md whole
        report = _run_topics(o, names, meta, out_dir, con, writing, only)
        caution = (
            "size=tiny checks that every study runs: its models, lengths and batches are too small "
            "for these verdicts to judge the claims (size=quick or full judges them)"
            if o.size == "tiny"
            else ""
        )
        busy = markdown.busy_caution(report["records"])
        caution = "; ".join(c for c in (caution, busy) if c)
        con.print(tables.verdicts(report["verdicts"], caution, judged=o.size != "tiny"))
        con.print(f"wall {meta['wall_s']:.0f} s · {report['path']}", markup=False)
    return 1 if any(m["error"] for m in meta["modules"].values()) else 0


def main(argv: list[str] | None = None) -> int:
    return cli(Options, run, prog="python -m experiments", doc=__doc__, argv=argv)


if __name__ == "__main__":
    from lab.report.progress import survive_lost_output

    survive_lost_output()  # a reader gone (| head) loses no records or report
    sys.exit(main())
