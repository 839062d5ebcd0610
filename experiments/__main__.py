"""`python -m experiments [size=tiny|quick|full] [only=C03,C08] [out=results]`.

Runs the experiment modules with a progress bar, appends every record to
results/<backend>-<device>-<timestamp>/records.jsonl as each module finishes, then renders
REPORT.md and the plots from those records and prints the verdict table. On CPU the process
simulates 8 devices (as the tests do) so the parallelism experiments have a mesh.
"""

import difflib
import os
import sys
import time
import traceback

SIZES = ("tiny", "quick", "full")
USAGE = "usage: python -m experiments [size=tiny|quick|full] [only=C03,C08] [out=results]"


def _unknown(arg: str) -> str:
    """One line for an argument that is not a key: the close key when there is one."""
    key = arg.split("=", 1)[0].lstrip("-")
    close = difflib.get_close_matches(key, ("size", "only", "out"), n=1)
    hint = f"did you mean {close[0]}=? " if close else ""
    return f"{arg!r}: unknown argument; {hint}{USAGE}"


def parse(argv: list[str]) -> dict:
    opts = {"size": "quick", "only": None, "out": "results"}
    for arg in argv:
        if arg in ("--quick", "--full", "--tiny"):
            opts["size"] = arg[2:]
        elif arg.startswith(("only=", "out=", "size=")):
            key, value = arg.split("=", 1)
            opts[key] = value
        else:
            raise ValueError(_unknown(arg))
    if opts["size"] not in SIZES:
        raise ValueError(f"size={opts['size']!r}: expected one of {', '.join(SIZES)}")
    return opts


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    try:
        opts = parse(argv)
        from experiments import parse_only

        only = parse_only(opts["only"])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", 8)
    except RuntimeError:  # backends already up (e.g. under pytest): keep what is there
        pass
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from experiments import load, select
    from lab.measure import records as rec
    from lab.report import markdown

    console = Console()
    env = rec.environment()
    out_dir = markdown.results_dir(opts["out"], env)
    names = select(only)
    t0 = time.perf_counter()
    meta = {"size": opts["size"], "only": only, "modules": {}, "argv": argv}
    columns = (
        TextColumn("{task.description:<28}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
    )
    console.print(
        f"experiments · {env['backend']} · {env['device_kind']} × "
        f"{env['device_count']} · size {opts['size']} → {out_dir}"
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("starting", total=len(names))
        for name in names:
            module = load(name)
            progress.update(task, description=f"{name} ({', '.join(module.CLAIMS)})")
            start = time.perf_counter()
            try:
                records = module.run(opts["size"])
                for r in records:
                    r["config"]["module"] = name
                rec.write_records(out_dir / "records.jsonl", records)
                error = None
            except Exception as e:  # noqa: BLE001 — one failed topic must not lose the others
                error = f"{type(e).__name__}: {e}"
                console.print(f"[red]{name} failed[/red]: {error}")
                console.print(traceback.format_exc(), markup=False, highlight=False)
                records = []
            meta["modules"][name] = {
                "wall_s": time.perf_counter() - start,
                "records": len(records),
                "error": error,
            }
            progress.advance(task)
    meta["wall_s"] = time.perf_counter() - t0
    report = markdown.write_report(out_dir, meta=meta, only=only)
    console.print(markdown.verdict_table(report["verdicts"]))
    console.print(f"wall {meta['wall_s']:.0f} s · {report['path']}")
    return 1 if any(m["error"] for m in meta["modules"].values()) else 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    sys.exit(main())
