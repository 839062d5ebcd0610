"""`python -m lab.tune_step [remats=none,dots,full] [batches=8,16,32] key=value ...`.

Which remat policy and batch size give the training step its highest MFU on this device?
Memory decides what can run (remat trades recomputation for activations, a bigger batch
amortises the weights' traffic), so the answer is measured, not guessed: for every
(remat, batch_size) pair this builds lab.run's real sharded step with the other keys as given,
compiles it, refuses it where the compiled memory does not fit the device (the check lab.run
makes before training), times the others (`lab.measure.timing.bench`: warm-up and compile
apart, the donated state threaded through, blocked on every leaf), and reports tokens/s and
MFU in lab.run's convention (model FLOPs per token from 6·N + attention; the spec-table peak
of the devices the mesh uses, or this CPU's measured matmul peak). It prints the table, the
winner, and the `python -m lab.run` command that trains with it; records go to results/.
"""

import sys
import time
from pathlib import Path

import jax

from lab import summary
from lab.bench_step import _stepper
from lab.config import ConfigError, parse_args
from lab.data import host_batch, to_global
from lab.errors import RunError
from lab.measure import records as rec
from lab.measure.timing import bench
from lab.run import setup

REMATS = ("none", "dots", "full")
BATCHES = (8, 16, 32)
OWN_KEYS = ("remats", "batches", "budget")


def _split(argv: list[str]) -> tuple[dict, list[str]]:
    """This command's own keys apart from lab.run's."""
    own, rest = {}, []
    for a in argv:
        key, eq, value = a.partition("=")
        if key in OWN_KEYS and eq:
            own[key] = value
        else:
            rest.append(a)
    remats = tuple(own.get("remats", ",".join(REMATS)).split(","))
    bad = [r for r in remats if r not in REMATS]
    if bad:
        raise ConfigError(f"remats={','.join(remats)}: each must be one of {', '.join(REMATS)}")
    try:
        batches = tuple(int(b) for b in own.get("batches", ",".join(map(str, BATCHES))).split(","))
        budget = float(own.get("budget", "5"))
    except ValueError:
        raise ConfigError("batches=8,16,... takes integers; budget=SECONDS a number") from None
    if min(batches) < 1 or budget <= 0:
        raise ConfigError(f"batches={own.get('batches')} budget={budget}: must be positive")
    for key in ("remat", "batch_size", "steps"):
        if any(a.startswith(f"{key}=") for a in rest):
            raise ConfigError(f"{key}= is what tune_step varies or sets; use remats=/batches=")
    parse_args(rest)  # lab.run's own keys: a typo is one line before anything compiles
    return {"remats": remats, "batches": batches, "budget": budget}, rest


def measure(argv: list[str], remat: str, batch: int, budget_s: float) -> dict:
    """One candidate: compiled memory, and (if it fits) step time, tokens/s and MFU."""
    keys = [*argv, f"remat={remat}", f"batch_size={batch}", "steps=1000"]
    cfg, info, trainer = setup(parse_args(keys), keys)
    t0 = time.perf_counter()
    compiled = trainer.lower().compile()
    compile_s = time.perf_counter() - t0
    analysis = summary.analyse(compiled, cfg, info, trainer)
    mem = analysis["compiled_memory_per_device"] or {}
    row = dict(remat=remat, batch=batch, compile_s=compile_s, memory_bytes=mem.get("total_bytes"))
    problem = summary.memory_problem(analysis, info)
    if problem:
        return {**row, "skipped": problem.split(":")[0]}
    tokens = to_global(
        host_batch(cfg.data, cfg.seed, 0, batch, cfg.seq_len, cfg.model.vocab_size),
        trainer.batch_sharding,
    )
    call = _stepper(lambda s: compiled(s, tokens)[0], trainer.init(jax.random.key(cfg.seed)))
    timed = bench(call, warmup=2, min_runs=3, budget_s=budget_s)
    tokens_per_s = batch * cfg.seq_len / timed.median_s
    peak, source = summary.mesh_peak(cfg, info, analysis["devices"])
    achieved = analysis["model_flops_per_token"] * tokens_per_s
    return {
        **row,
        "step_s": timed.median_s,
        "runs": timed.runs,
        "tokens_per_s": tokens_per_s,
        "mfu": achieved / peak if peak else None,
        "peak_source": source,
        "convention": analysis["flops_convention"],
        "device": f"{info.device_kind} × {analysis['devices']}",
    }


def search(argv: list[str], remats, batches, budget_s: float, log=print) -> list[dict]:
    rows = []
    for remat in remats:
        for batch in batches:
            log(f"remat={remat} batch_size={batch}")
            try:
                rows.append(measure(argv, remat, batch, budget_s))
            except ConfigError as e:  # e.g. a batch the mesh's data axes do not divide
                rows.append(dict(remat=remat, batch=batch, skipped=str(e)))
            except RuntimeError as e:  # the allocator ran out where the compiled figure fit
                if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
                    raise
                rows.append(dict(remat=remat, batch=batch, skipped="out of memory when run"))
    return rows


def best(rows: list[dict]) -> dict | None:
    ran = [r for r in rows if "tokens_per_s" in r]
    return max(ran, key=lambda r: r["tokens_per_s"]) if ran else None


def table(rows: list[dict], title: str):
    from rich.table import Table

    t = Table(title=title)
    for col in ("remat", "batch", "compiled MiB/device", "step", "tokens/s", "MFU", ""):
        t.add_column(col, justify="right")
    top = best(rows)
    for r in rows:
        mib = f"{r['memory_bytes'] / 2**20:,.0f}" if r.get("memory_bytes") else "–"
        ran = "tokens_per_s" in r
        t.add_row(
            r["remat"],
            str(r["batch"]),
            mib,
            f"{r['step_s'] * 1e3:,.1f} ms" if ran else f"skipped: {r['skipped']}",
            f"{r['tokens_per_s']:,.0f}" if ran else "",
            f"{r['mfu']:.1%}" if ran and r["mfu"] is not None else "",
            "← best" if r is top else "",
        )
    return t


def records(rows: list[dict], argv: list[str]) -> list[dict]:
    out = []
    for r in rows:
        config = dict(experiment="tune_step", keys=argv, remat=r["remat"], batch=r["batch"])
        if "tokens_per_s" not in r:
            out.append(rec.make_record("tune_step skipped", r["skipped"], "reason", **config))
            continue
        extra = dict(step_s=r["step_s"], runs=r["runs"], memory_bytes=r["memory_bytes"])
        out.append(
            rec.make_record("training tokens/s", r["tokens_per_s"], "tokens/s", **config, **extra)
        )
        if r["mfu"] is not None:
            out.append(
                rec.make_record(
                    "training MFU",
                    r["mfu"],
                    "fraction",
                    label="derived",
                    peak_source=r["peak_source"],
                    convention=r["convention"],
                    **config,
                )
            )
    return out


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help", "help") for a in argv):
        print(__doc__.strip())
        print(
            f"\nown keys: remats= (default {','.join(REMATS)}), batches= (default "
            f"{','.join(map(str, BATCHES))}), budget= (seconds of timed steps, default 5); "
            "every other key is lab.run's (python -m lab.run --help)"
        )
        return 0
    console = Console(width=150)
    try:
        own, rest = _split(argv)
        rows = search(rest, own["remats"], own["batches"], own["budget"], log=console.log)
    except (ConfigError, RunError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    top = best(rows)
    title = f"remat × batch · {' '.join(rest) or 'defaults'}"
    if top:
        title += f" · {top['device']} · MFU: {top['convention']}"
    console.print(table(rows, title))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = rec.write_records(Path("results") / f"tune_step-{stamp}.jsonl", records(rows, rest))
    if top is None:
        console.print("no candidate fits this device: try more devices or a smaller model")
        return 1
    keys = " ".join([*rest, f"remat={top['remat']}", f"batch_size={top['batch']}"])
    console.print(f"best: python -m lab.run {keys}")
    console.print(f"records → {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
