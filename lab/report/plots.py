"""Every PNG the lab draws (matplotlib lives here and nowhere else).

The ledger's plots read records only: roofline, matmul by precision, attention time and memory
against sequence length, memory breakdown, scaling, batch size, inference, loss curves. Each
reads the records whose config carries its `series` and returns None when there are none, so
a partial run (only=C08) plots what it has. A merge of several folders (experiments/compare.py)
stamps each record with `machine`, its folder's column name: every plot then draws one series
per machine, labelled by it, or one panel per machine where a machine's figures need their own
axes (its roofs, its attention lengths); a single folder's records draw as before. The
commands' plots (the measured roofline, the attention sweep, collectives, the scaling study)
take what their study returns.
"""

import contextlib
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from lab.errors import RunError
from lab.measure import cost
from lab.measure.attention import SweepRow
from lab.measure.scaling import ScalingStudy
from lab.report.format import rough


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _wrap_titles(fig) -> None:
    """Titles wrapped to their axes' width (a long one was cut off at the figure's edge)."""
    import textwrap

    def fill(text: str, inches: float, size: float) -> str:
        chars = max(20, int(inches * 144 / size))  # ~0.5 em a character
        return "\n".join(textwrap.fill(line, chars) for line in text.split("\n"))

    width = fig.get_size_inches()[0]
    for ax in fig.axes:
        title = ax.title
        if title.get_text():
            inches = ax.get_position().width * width
            title.set_text(fill(title.get_text(), inches, title.get_fontsize()))
    sup = getattr(fig, "_suptitle", None)
    if sup is not None and sup.get_text():
        sup.set_text(fill(sup.get_text(), width, sup.get_fontsize()))


def _save(fig, path, **kw) -> Path:
    plt = _plt()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _wrap_titles(fig)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=kw.get("dpi", 110))
    except OSError as e:  # a full disk: the picture is lost, not the records beside it
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)  # no half-written PNG
        raise RunError(f"cannot write the plot {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return path


def series(records: Sequence[dict], name: str) -> list[dict]:
    return [r for r in records if r.get("config", {}).get("series") == name]


def device_name(backend: str, kind: str) -> str:
    """`backend · device kind`, once where the two are the same word (a CPU's is "cpu")."""
    return backend if str(kind).lower() == str(backend).lower() else f"{backend} · {kind}"


def allocator_note(env: dict) -> str:
    """ " · allocator in huge pages" where a record's environment says a CPU's allocator was
    (lab.startup): a CPU figure depends on it, as the run header says; else ""."""
    return " · allocator in huge pages" if env.get("allocator") == "huge pages" else ""


def host_name(env: dict) -> str:
    """`device_name` of a record's environment, with its `allocator_note`."""
    return device_name(env["backend"], env["device_kind"]) + allocator_note(env)


def _label(r: dict) -> str:
    return device_name(r["backend"], r["device_kind"])


def machine_of(r: dict) -> str:
    """The machine a record came from: its merge column (`machine`, set by compare, which
    tells two folders of one device kind apart), else its backend · device kind."""
    return r.get("machine") or _label(r)


def by_machine(rows: Sequence[dict]) -> dict[str, list[dict]]:
    """machine → its rows, in the order the machines first appear."""
    out = {}
    for r in rows:
        out.setdefault(machine_of(r), []).append(r)
    return out


def _legend_below(ax, **kw):
    """A legend under the axes, below the x axis' tick labels and label at any axes height.

    Anchored in axes fraction (0.5, -0.16) it sat a share of the axes' height below them, and
    a tall legend (a merge's machine names, one a line) shrank the axes under tight_layout
    until the legend covered the x label: the offset is fixed in inches, measured from the
    drawn labels, and moves with the axes."""
    from matplotlib.transforms import ScaledTranslation

    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    below = ax.bbox.y0 - ax.xaxis.get_tightbbox(renderer).y0  # pixels the labels take
    shift = ScaledTranslation(0, -(below + 4) / fig.dpi, fig.dpi_scale_trans)
    return ax.legend(
        loc="upper center", bbox_to_anchor=(0.5, 0.0), bbox_transform=ax.transAxes + shift, **kw
    )


def _spread(values) -> bool:
    """Whether magnitudes span more than 30× (a CPU beside a GPU): a log axis keeps both
    readable where a linear one from 0 flattens the smaller to the floor."""
    vals = [v for v in values if v is not None and v > 0]
    return bool(vals) and max(vals) > 30 * min(vals)


def _number(v: float, _pos=None) -> str:
    """A tick as a plain number: 2, 16, 0.5, 20,000 (not 2¹, 1.6×10¹ or 2.0)."""
    return format(v, ",.12g" if abs(v) >= 1e4 else ".12g")


def _size(v: float, _pos=None) -> str:
    """A tick of bytes in powers of two: 512, 4K, 64K, 1M, 1.5G."""
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if v >= scale:
            return f"{v / scale:g}{unit}"
    return f"{v:g}"


def _log2_axis(ax, values, *, which: str = "x", fmt=_number, most: int = 9) -> None:
    """A base-2 log axis ticked at the values measured (every other one, or fewer, past
    `most`) and written as plain numbers; one value alone sits in an octave either side."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    (ax.set_xscale if which == "x" else ax.set_yscale)("log", base=2)
    axis = ax.xaxis if which == "x" else ax.yaxis
    ticks = sorted({v for v in values if v is not None and v > 0})
    if len(ticks) > most:
        ticks = ticks[:: -(-len(ticks) // most)]
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(FuncFormatter(fmt))
    axis.set_minor_locator(NullLocator())
    if len(ticks) == 1:
        (ax.set_xlim if which == "x" else ax.set_ylim)(ticks[0] / 2, ticks[0] * 2)


def _from_zero(ax) -> None:
    """A linear y axis of magnitudes (time, memory) from 0, with room above the largest: a
    noise-sized difference drawn on a range that starts near it looks like a large one."""
    top = ax.dataLim.y1 if ax.has_data() else 0
    if top > 0:
        ax.set_ylim(0, top * 1.12)


def _plain_log(ax, values, *, which: str = "y") -> None:
    """A log axis of magnitudes written as plain numbers: 1-2-5 ticks a decade where the
    values span one or more, 1-1.5-2-3-5-7 where they span less (one tick alone says little)."""
    import math

    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    (ax.set_xscale if which == "x" else ax.set_yscale)("log")
    axis = ax.xaxis if which == "x" else ax.yaxis
    vals = [v for v in values if v is not None and v > 0]
    span = math.log10(max(vals) / min(vals)) if vals else 2
    subs = (1.0,) if span > 4 else (1.0, 2.0, 5.0) if span > 0.8 else (1.0, 1.5, 2.0, 3.0, 5.0, 7.0)
    axis.set_major_locator(LogLocator(base=10, subs=subs))
    axis.set_major_formatter(FuncFormatter(_number))
    axis.set_minor_formatter(NullFormatter())


def _si(value: float, unit: str) -> str:
    """65.2 GFLOP/s, 989 TFLOP/s, 16 GB/s: a rate with its decimal prefix."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def roofline_points(points, *, peak_flops: float, bandwidth: float, path, title: str) -> Path:
    """Log-log roofline: measured points (lab.measure.roofline.Point), the measured roofs
    with their values, the ridge point. The axes run a little past the points and the ridge
    (they ran to 10⁴ FLOP/B with the last point at ~341); every label sits above a roof,
    where no point is (the ridge's sat on one)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.9))
    _roofline_axes(ax, points, peak_flops=peak_flops, bandwidth=bandwidth, title=title)
    return _save(fig, path, dpi=120)


def _roofline_axes(ax, points, *, peak_flops: float, bandwidth: float, title: str) -> None:
    """One machine's roofline (`roofline_points`) drawn into `ax`."""
    import numpy as np

    ridge = peak_flops / bandwidth
    at = [p.intensity for p in points] or [ridge]
    lo, hi = min(min(at), ridge) / 3, max(max(at) * 3, ridge * 8)
    ai = np.logspace(np.log10(lo), np.log10(hi), 200)
    ax.loglog(ai, np.minimum(peak_flops, ai * bandwidth), "k-", label="attainable (measured roofs)")
    ax.axvline(ridge, ls="--", lw=1, color="tab:red")
    above = dict(textcoords="offset points", va="bottom", fontsize=8)
    ax.annotate(f"ridge {ridge:.1f} FLOP/B", (ridge, peak_flops), (-4, 4), ha="right",
                color="tab:red", **above)  # fmt: skip
    ax.annotate(f"peak {_si(peak_flops, 'FLOP/s')}", (ridge, peak_flops), (4, 4), ha="left",
                **above)  # fmt: skip
    x = (lo * ridge) ** 0.5  # halfway up the memory roof; above-left of it is above the line
    ax.annotate(_si(bandwidth, "B/s"), (x, x * bandwidth), (-6, 6), ha="right", **above)
    for family, marker in (("poly", "o"), ("mm", "s")):
        pts = [p for p in points if p.name.startswith(family)]
        if pts:
            ax.loglog(
                [p.intensity for p in pts],
                [p.flops_per_s for p in pts],
                marker,
                label={"poly": "elementwise polynomial", "mm": "x(m×n)·w(n×n)"}[family],
            )
    ax.set_xlim(lo, hi)
    ax.set_ylim(top=peak_flops * 3)  # room for the labels above the roof
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("FLOP/s")
    ax.set_title(title, fontsize=9)
    # below the axes: inside, no corner is empty for every device (the ridge moves)
    _legend_below(ax, fontsize=8, ncol=3)
    ax.grid(True, which="both", alpha=0.3)


def roofline(records, path) -> Path | None:
    """Measured points under the measured roofs: one panel per machine, each with its own
    roofs and its own points (a merge drew the last folder's roofs over every folder's
    points, titled by the first's)."""
    from lab.measure.roofline import Point

    panels = []
    for machine, rows in by_machine(series(records, "roofline") + series(records, "roof")).items():
        pts = [r["config"] for r in rows if r["config"]["series"] == "roofline"]
        roofs = {r["config"]["roof"]: r["value"] for r in rows if r["config"]["series"] == "roof"}
        if pts and "peak" in roofs and "bandwidth" in roofs:
            points = [Point(c["name"], c["flops"], c["bytes"], c["median_s"]) for c in pts]
            panels.append((machine, points, roofs))
    if not panels:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.9), squeeze=False)
    for ax, (machine, points, roofs) in zip(axes[0], panels, strict=True):
        _roofline_axes(
            ax,
            points,
            peak_flops=roofs["peak"],
            bandwidth=roofs["bandwidth"],
            title=f"roofline · {machine} (measured roofs and points)",
        )
    return _save(fig, path, dpi=120)


def matmul(records, path) -> Path | None:
    rows = series(records, "matmul_precision")
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(7, 0.6 * len(rows)), 3.8))
    names = [f"{r['config']['dtype']}\n{r['config']['precision']}" for r in rows]
    devices = list(by_machine(rows))  # a merged ledger holds several
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, device in enumerate(devices):
        at = [i for i, r in enumerate(rows) if machine_of(r) == device]
        ax.bar(
            at,
            [rows[i]["value"] / 1e9 for i in at],
            color=colors[k % len(colors)],
            label=device,
        )
    ax.set_xticks(range(len(rows)), names, fontsize=7)
    ax.set_ylabel("GFLOP/s (measured)")
    values = [r["value"] for r in rows if r["value"] > 0]
    if values and max(values) > 30 * min(values):  # a CPU beside a GPU: both readable
        ax.set_yscale("log")
        ax.set_ylabel("GFLOP/s (measured, log scale)")
    sizes = sorted({r["config"].get("n") for r in rows}, key=str)
    ax.set_title(f"matmul n={'/'.join(map(str, sizes))} by dtype and precision", fontsize=9)
    ax.legend(fontsize=7, title="measured on", title_fontsize=7)
    return _save(fig, path)


def attention(records, path) -> Path | None:
    """ms per call and compiled temporaries against sequence length, one line per (impl, mode,
    mask): records of causal and full attention are two lines, not one. A merge draws a row
    of the two panels per machine (one line joined two folders' points at each length)."""
    rows = series(records, "attention")
    if not rows:
        return None
    plt = _plt()
    machines = by_machine(rows)
    fig, grid = plt.subplots(len(machines), 2, figsize=(11.5, 4 * len(machines)), squeeze=False)
    color = _colors(sorted({r["config"]["impl"] for r in rows}))
    for (ax_t, ax_m), (machine, mine) in zip(grid, machines.items(), strict=True):
        _attention_axes(ax_t, ax_m, mine, color)
        if len(machines) > 1:
            ax_t.set_title(f"time · {machine}")
            ax_m.set_title(f"memory · {machine}")
    fig.suptitle("attention" + (f" · {next(iter(machines))}" if len(machines) == 1 else ""),
                 fontsize=9)  # fmt: skip
    return _save(fig, path)


def _attention_axes(ax_t, ax_m, rows, color: dict) -> None:
    """One machine's attention records: time in ax_t, memory in ax_m, the legend beside."""
    lines = defaultdict(list)
    # a native kernel's memory is XLA's part of the program only: its own buffers are not in it
    partial = {r["config"]["impl"] for r in rows if r["config"].get("temp_excludes")}
    for r in rows:
        c = r["config"]
        mask = {True: "causal", False: "full"}.get(c.get("causal"), "")
        lines[(c["impl"], c["mode"], mask)].append(
            (c["seq_len"], c["median_s"], c.get("temp_bytes"), c.get("p10_s"), c.get("p90_s"))
        )
    for (impl, mode, mask), pts in sorted(lines.items()):
        pts.sort()
        style = dict(
            ls="-" if mode == "fwd+bwd" else "--",
            marker="s" if mask == "full" else "o",
            mfc="none" if mask == "full" else None,
            color=color[impl],
            label=" ".join(filter(None, (impl, mode, mask)))
            + (" (memory: XLA's part)" if impl in partial else ""),
        )
        ax_t.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], **style)
        if all(p[3] is not None and p[4] is not None for p in pts):  # the samples' spread
            ax_t.fill_between(
                [p[0] for p in pts],
                [p[3] * 1e3 for p in pts],
                [p[4] * 1e3 for p in pts],
                color=color[impl],
                alpha=0.12,
                lw=0,
            )
        mem = [(p[0], p[2]) for p in pts if p[2]]
        if mem:
            ax_m.plot([p[0] for p in mem], [p[1] / 2**20 for p in mem], **style)
    ax_t.set(xlabel="sequence length", ylabel="ms per call (median; band p10–p90)", title="time")
    ax_m.set(xlabel="sequence length", ylabel="MiB temporaries (compiled)", title="memory")
    for ax in (ax_t, ax_m):
        _log2_axis(ax, [r["config"]["seq_len"] for r in rows])
        _plain_log(ax, [y for line in ax.get_lines() for y in line.get_ydata()])
        ax.grid(True, which="both", alpha=0.3)
    # one legend for both panels (the time panel has every line), beside them: inside, up to
    # eight entries (impl × mode × mask) covered the lines
    ax_m.legend(
        *ax_t.get_legend_handles_labels(),
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.02, 1.0),
        borderaxespad=0,
    )


COMPONENTS = ("params", "grads", "optimizer", "activations", "workspace")


def memory(records, path) -> Path | None:
    """Stacked predicted components beside the compiled total, per case: a panel per machine
    on one scale (a merge set each case's bars twice along one axis, unnamed)."""
    rows = series(records, "memory_breakdown")
    if not rows:
        return None
    plt = _plt()
    machines = by_machine(rows)
    widths = [max(6, 1.3 * len(mine)) for mine in machines.values()]
    fig, axes = plt.subplots(1, len(machines), figsize=(sum(widths), 4), squeeze=False,
                             sharey=True, width_ratios=widths)  # fmt: skip
    for ax, (machine, mine) in zip(axes[0], machines.items(), strict=True):
        _memory_axes(ax, mine)
        ax.set_title(f"training memory: calculator vs compiler · {machine}", fontsize=9)
    # beside the last axes: inside, the legend covered the tallest case's bars
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return _save(fig, path)


def _memory_axes(ax, rows) -> None:
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    colors = _plt().rcParams["axes.prop_cycle"].by_key()["color"]
    for k, comp in enumerate(COMPONENTS):
        vals = [r["config"]["predicted"].get(comp, 0) / 2**20 for r in rows]
        ax.bar([i - 0.2 for i in x], vals, width=0.38, bottom=bottom, label=f"predicted {comp}",
               color=colors[k % len(colors)])  # fmt: skip
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.bar(
        [i + 0.2 for i in x],
        [r["value"] / 2**20 for r in rows],
        width=0.38,
        color="k",
        alpha=0.7,
        label="compiled (XLA's buffers)",
    )
    ax.set_xticks(list(x), [r["config"]["case"] for r in rows], fontsize=7, rotation=20)
    ax.set_ylabel("MiB per device")


def _measured_split(ax, rows) -> None:
    """Measured data-parallel step over the devices present: step, collective, compute."""
    for what, style in (("step time", "o-"), ("collective time", "s--"), ("compute time", "^:")):
        pts = sorted(
            (r["config"]["devices"], r["value"]) for r in rows if r["what"].startswith(what)
        )
        if pts:
            ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], style, label=what)
    ax.set(xlabel="devices (data parallel)", ylabel="ms (measured / derived)")
    ax.xaxis.get_major_locator().set_params(integer=True)  # devices are whole
    ax.set_title(
        "measured here" + (" (simulated CPU devices)" if rows[0]["backend"] == "cpu" else ""),
        fontsize=9,
    )
    ax.legend(fontsize=7)


def scaling(records, path) -> Path | None:
    """Data-parallel efficiency against device count (predicted), per-strategy memory, and the
    measured step split where lab.studies.scaling ran: a row of panels per machine."""
    machines = by_machine(
        series(records, "dp_scaling")
        + series(records, "strategy_memory")
        + [r for r in series(records, "dp_measured") if r["config"].get("experiment") == "scaling"]
    )
    rows = []
    for machine, mine in machines.items():
        eff = [r for r in mine if r["config"]["series"] == "dp_scaling"]
        mem = [r for r in mine if r["config"]["series"] == "strategy_memory"]
        measured = [r for r in mine if r["config"]["series"] == "dp_measured"]
        if eff or mem:
            rows.append((machine, eff, mem, measured))
    if not rows:
        return None
    plt = _plt()
    panels = 3 if any(measured for *_, measured in rows) else 2
    fig, grid = plt.subplots(len(rows), panels, figsize=(5 * panels, 4 * len(rows)), squeeze=False)
    for axes, (machine, eff, mem, measured) in zip(grid, rows, strict=True):
        _scaling_axes(axes, eff, mem, measured)
        if len(rows) > 1:
            for ax in axes:
                if ax.get_title():
                    ax.set_title(f"{ax.get_title()} · {machine}", fontsize=9)
        if not measured and panels == 3:
            axes[2].axis("off")
    fig.suptitle("scaling" + (f" · {rows[0][0]}" if len(rows) == 1 else ""), fontsize=9)
    return _save(fig, path)


def _scaling_axes(axes, eff, mem, measured) -> None:
    """One machine's scaling records in a row of panels."""
    ax_e, ax_m = axes[0], axes[1]
    by_target = defaultdict(list)
    for r in eff:
        by_target[r["config"].get("target", "")].append((r["config"]["devices"], r["value"]))
    for target, pts in sorted(by_target.items()):
        pts.sort()
        ax_e.plot(
            [p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{target} (predicted)"
        )
    _log2_axis(ax_e, [r["config"]["devices"] for r in eff])
    ax_e.axhline(0.5, ls=":", color="gray")
    ax_e.set(
        xlabel="data-parallel devices",
        ylabel="compute / (compute + all-reduce)",
        title="data-parallel efficiency",
        ylim=(0, 1.05),
    )
    if eff:  # a machine without the predictions has no line to name
        ax_e.legend(fontsize=7)
    if mem:
        ax_m.bar(range(len(mem)), [r["value"] / 2**20 for r in mem])
        ax_m.set_xticks(range(len(mem)), [r["config"]["strategy"] for r in mem])
        ax_m.set(
            ylabel="MiB per device (compiled)",
            title=f"same step, {mem[0]['config'].get('devices')} devices, per strategy",
        )
    if measured:
        _measured_split(axes[2], measured)


def _series_style(machines, k: int, single: str) -> dict:
    """The colour of machine k's lines: `single` where one machine drew (the plot as it
    always was), else one of the cycle's per machine."""
    if len(machines) == 1:
        return {"color": single}
    cycle = _plt().rcParams["axes.prop_cycle"].by_key()["color"]
    return {"color": cycle[k % len(cycle)]}


def _named(what: str, machine: str, machines) -> str:
    """A legend entry: the quantity, and the machine where several drew."""
    return what if len(machines) == 1 else f"{what} · {machine}"


def _magnitude_axis(ax, machines: dict, value) -> None:
    """From 0 (a noise-sized difference does not look like a drop), or log where the
    machines' largest figures span more than 30× (a CPU's tokens/s beside a GPU's: from 0, the
    CPU's line lies on the floor). One machine's axis is always from 0, as it always was."""
    tops = [max(value(r) for r in mine) for mine in machines.values()]
    if len(machines) > 1 and _spread(tops):
        _plain_log(ax, [value(r) for mine in machines.values() for r in mine])
    else:
        _from_zero(ax)


def batch_sweep(records, path) -> Path | None:
    """Tokens/s and compiled memory against batch: one pair of lines per machine (a merge
    joined the folders' points into one line that zigzagged at each batch)."""
    rows = sorted(series(records, "batch_sweep"), key=lambda r: r["config"]["batch"])
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax2 = ax.twinx()
    machines = by_machine(rows)
    handles = []
    for k, (machine, mine) in enumerate(machines.items()):
        b = [r["config"]["batch"] for r in mine]
        handles += ax.plot(b, [r["value"] for r in mine], "o-",
                           label=_named("tokens/s", machine, machines),
                           **_series_style(machines, k, "tab:blue"))  # fmt: skip
    for k, (machine, mine) in enumerate(machines.items()):
        b = [r["config"]["batch"] for r in mine]
        handles += ax2.plot(
            b,
            [r["config"]["memory_bytes"] / 2**20 for r in mine],
            "s--",
            label=_named("memory (compiled)", machine, machines),
            **_series_style(machines, k, "tab:red"),
        )
    ax.set(xlabel="batch size", ylabel="tokens/s (measured)")
    _log2_axis(ax, [r["config"]["batch"] for r in rows])  # 2, 4, 8 (not 2¹, 2², 2³), after
    # both axes drew: they share it
    _magnitude_axis(ax, machines, lambda r: r["value"])
    ax2.set_ylabel("MiB compiled" + (" (dashed)" if len(machines) > 1 else ""),
                   color="tab:red" if len(machines) == 1 else "black")  # fmt: skip
    _magnitude_axis(ax2, machines, lambda r: r["config"]["memory_bytes"] / 2**20)
    if len(machines) == 1:
        ax.legend(handles=handles, fontsize=8, loc="lower right")
    else:  # below the axes: four entries named by machine covered the lines inside
        _legend_below(ax, handles=handles, fontsize=8)
    where = f" · {next(iter(machines))}" if len(machines) == 1 else ""
    ax.set_title(f"batch size: throughput and memory{where}", fontsize=9)
    return _save(fig, path)


def losses(records, path) -> Path | None:
    """Loss per step in float32 and bf16 compute: a colour per machine and a line style per
    dtype where several machines drew (a merge named "float32, bfloat16" twice)."""
    rows = series(records, "loss_curve")
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    machines = by_machine(rows)
    dtypes = list(dict.fromkeys(r["config"]["dtype"] for r in rows))
    for k, (machine, mine) in enumerate(machines.items()):
        for r in mine:
            ys = r["config"]["losses"]
            dtype = r["config"]["dtype"]
            style = {} if len(machines) == 1 else {
                **_series_style(machines, k, ""),
                "ls": ("-", "--", ":", "-.")[dtypes.index(dtype) % 4],
            }  # fmt: skip
            ax.plot(range(1, len(ys) + 1), ys, label=_named(dtype, machine, machines), **style)
    ax.xaxis.get_major_locator().set_params(integer=True)  # steps are whole
    ax.set(xlabel="step", ylabel="loss", title="the same steps in float32 and bf16 compute")
    ax.legend(**({} if len(machines) == 1 else {"fontsize": 7}))
    return _save(fig, path)


def inference(records, path) -> Path | None:
    """Requests/s and the latency of a batch against batch size, a legend naming both (the
    latency was told apart only by its axis label's colour): a pair of lines per machine."""
    rows = sorted(series(records, "inference_batch"), key=lambda r: r["config"]["batch"])
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    ax2 = ax.twinx()
    machines = by_machine(rows)
    rps, lat = [], []
    for k, (machine, mine) in enumerate(machines.items()):
        b = [r["config"]["batch"] for r in mine]
        rps += ax.plot(b, [r["value"] for r in mine], "o-",
                       label=_named("requests/s", machine, machines),
                       **_series_style(machines, k, "tab:blue"))  # fmt: skip
        lat += ax2.plot(
            b,
            [r["config"]["median_s"] * 1e3 for r in mine],
            "s--",
            label=_named("latency per batch (ms)", machine, machines),
            **_series_style(machines, k, "tab:red"),
        )
    _log2_axis(ax, [r["config"]["batch"] for r in rows])  # after both axes drew: they share it
    _magnitude_axis(ax, machines, lambda r: r["value"])  # 4.78-4.88 requests/s drew a 2%
    _magnitude_axis(ax2, machines, lambda r: r["config"]["median_s"] * 1e3)  # as the height
    ax2.set_ylabel("latency per batch (ms" + (", dashed)" if len(machines) > 1 else ")"),
                   color="tab:red" if len(machines) == 1 else "black")  # fmt: skip
    ax.set(xlabel="batch size", ylabel="requests/s (measured)")
    # below the axes: with both from 0 no corner inside is sure to be empty
    _legend_below(
        ax,
        handles=rps + lat,
        fontsize=8,
        ncol=2 if len(machines) == 1 else 1,  # machines' names: one a line, not cut off
    )
    where = f" · {next(iter(machines))}" if len(machines) == 1 else ""
    ax.set_title(f"classifier inference{where}", fontsize=9)
    return _save(fig, path)


def decode(records, path) -> Path | None:
    """Decode tokens/s against batch (float and int8) and the share of the measured memory
    roof each reaches; the critical batch where one is recorded. The x axis spans the batches
    measured (a critical batch past them is named in the legend, not drawn out there), the
    legend sits below the axes and names every line, the dashed shares too. A panel per
    machine, each with its own critical batch."""
    rows = sorted(series(records, "decode_batch"), key=lambda r: r["config"]["batch"])
    if not rows:
        return None
    plt = _plt()
    machines = by_machine(rows)
    crit = by_machine(
        [r for r in records if r.get("config", {}).get("metric") == "decode_critical_batch"]
    )
    n = len(machines)
    fig, axes = plt.subplots(1, n, figsize=(6.4 * n, 4.3), squeeze=False)
    for ax, (machine, mine) in zip(axes[0], machines.items(), strict=True):
        # one machine: every critical batch recorded is its own, whatever its label
        _decode_axes(ax, mine, crit.get(machine, []) if n > 1 else sum(crit.values(), []))
        ax.set_title(f"{_decode_title(mine)} · {machine}", fontsize=9)
    return _save(fig, path)


def _decode_title(rows) -> str:
    """What bounds the float points' steps (their records' `bound`), by batch: "decode, float
    weights: overhead-bound at batch 1-64", or "memory-bound at batch 1-16, compute-bound at
    32-64" (int8's points have their own bounds in the table);
    plain "decode tokens/s by batch" where the records do not say."""
    pts = [r["config"] for r in rows if not r["config"].get("int8")]
    if not pts or any("bound" not in c for c in pts):
        return "decode tokens/s by batch"
    runs: list[list] = []  # [bound, first batch, last batch] in batch order
    for c in sorted(pts, key=lambda c: c["batch"]):
        if runs and runs[-1][0] == c["bound"]:
            runs[-1][2] = c["batch"]
        else:
            runs.append([c["bound"], c["batch"], c["batch"]])
    spans = [f"{b}-bound at batch {lo}" + (f"-{hi}" if hi != lo else "") for b, lo, hi in runs]
    return "decode, float weights: " + ", ".join(spans)


def _decode_axes(ax, rows, crit) -> None:
    """One machine's decode records (and its critical batch records, `crit`) in `ax`."""
    from matplotlib.lines import Line2D

    ax2 = ax.twinx()
    rates, shares = [], []
    for int8, style in ((False, "o-"), (True, "^-")):
        pts = [r for r in rows if bool(r["config"].get("int8")) == int8]
        if not pts:
            continue
        b = [r["config"]["batch"] for r in pts]
        name = "int8 weights + cache" if int8 else "float"
        rates += ax.plot(b, [r["value"] for r in pts], style, label=f"tokens/s, {name}")
        share = [100 * r["config"]["memory_roof_share"] for r in pts]
        shares += ax2.plot(
            b,
            share,
            style.replace("-", "--"),
            color="tab:red",
            alpha=0.7,
            label=f"% of memory roof, {name}",
        )
    handles = rates + shares
    batches = [r["config"]["batch"] for r in rows]
    if crit and crit[0]["value"] and crit[0]["value"] < 1e9:
        at = crit[0]["value"]
        k = crit[0]["config"].get("sensitivity")  # % per 1% of the ridge; older records: none
        if k is not None and k > cost.ILL_DETERMINED:  # an estimate: two figures, said so
            label = f"critical batch (ridge): ~{rough(at)}, not well determined"
        else:
            label = f"critical batch (ridge): {f'{at:.3g}' if at < 1000 else f'{at:,.0f}'}"
        if min(batches) <= at <= max(batches):
            handles.append(ax.axvline(at, color="gray", ls=":", label=label))
        else:
            out = Line2D([], [], color="gray", ls=":", label=f"{label}, past the batches measured")
            handles.append(out)
    _log2_axis(ax, batches)  # after both axes drew: they share it
    _plain_log(ax, [r["value"] for r in rows])
    ax.set(xlabel="batch (sequences decoded together)", ylabel="decode tokens/s (measured)")
    ax2.set_ylabel("% of the measured memory roof (dashed)", color="tab:red")
    _from_zero(ax2)
    # below the axes: inside, it covered the batch-2 points
    _legend_below(ax, handles=handles, fontsize=8, ncol=2)


# topic → [(file name, plot function)], in the order the report shows them.
PLOTS = {
    "matmul": [("matmul.png", matmul)],
    "roofline": [("roofline.png", roofline)],
    "attention": [("attention.png", attention)],
    "memory": [("memory.png", memory), ("batch.png", batch_sweep)],
    "parallel": [("scaling.png", scaling)],
    "training": [("losses.png", losses)],
    "inference": [("inference.png", inference), ("decode.png", decode)],
    "prediction": [("prediction.png", lambda records, path: prediction_records(records, path))],
}


def make_all(records: Sequence[dict], out_dir) -> dict[str, list[str]]:
    """Every plot the records allow, written into out_dir; topic → file names."""
    out = {}
    for topic, entries in PLOTS.items():
        for name, fn in entries:
            if fn(records, Path(out_dir) / name) is not None:
                out.setdefault(topic, []).append(name)
    return out


# ------------------------------------------------------------------------ the commands' plots


def _colors(names) -> dict:
    """One colour per name, the same in every panel of a figure."""
    cycle = _plt().rcParams["axes.prop_cycle"].by_key()["color"]
    return {name: cycle[i % len(cycle)] for i, name in enumerate(names)}


def attention_sweep(rows: list[SweepRow], path, title: str) -> Path:
    """`lab.studies.attention.rows_of(records)`: ms per call against sequence length per
    (causal, mode) measured, one line per impl, and the peak temporary memory of every
    (mode, mask) that has it. Only panels with figures are drawn (a sweep of modes=fwd,
    causal=yes drew three empty ones with made-up axes)."""
    plt = _plt()
    impls = sorted({r.impl for r in rows})
    color = _colors(impls)
    combos = [(c, m) for c in (True, False) for m in ("fwd", "fwd+bwd")]

    def mask(causal: bool) -> str:
        return "causal" if causal else "full"

    def pick(field, causal, mode):  # {impl: [(seq, a SweepRow field)]}, where a record gave it
        return {
            impl: pts
            for impl in impls
            if (
                pts := [
                    (r.seq, getattr(r, field))
                    for r in rows
                    if (r.impl, r.causal, r.mode) == (impl, causal, mode)
                    and getattr(r, field) is not None
                ]
            )
        }

    # a native kernel's own scratch is not in XLA's figure: its line says so
    native = {r.impl for r in rows if getattr(r, "memory_excludes", None)}
    timed = [(c, m, lines) for c, m in combos if (lines := pick("time_s", c, m))]
    memory = [(c, m, lines) for c, m in combos if (lines := pick("peak_temp_bytes", c, m))]
    drawn = len(timed) + bool(memory)  # panels with figures: one per line of 3 at most
    cols = min(3, max(1, drawn))
    lines_of = max(1, -(-drawn // cols))
    # the memory panel's legend (a line per impl, mode and mask: 16 for 4 impls) goes under
    # it, two columns of entries: the figure grows by its rows instead of the legend
    # covering the curves
    entries = sum(len(lines) for *_, lines in memory)
    below = 0.17 * -(-entries // 2) + 0.3 if entries > 4 else 0.0
    height = 4 * lines_of + below
    fig, grid = plt.subplots(lines_of, cols, figsize=(5 * cols, height), squeeze=False)
    axes = list(grid.flat)
    for ax in axes[drawn:]:
        ax.axis("off")
    seqs = [r.seq for r in rows]
    for ax, (c, m, lines) in zip(axes, timed, strict=False):
        for impl, pts in lines.items():
            pts.sort()
            ax.plot(
                [p[0] for p in pts], [p[1] * 1e3 for p in pts], "o-", color=color[impl], label=impl
            )
        ax.set(title=f"{m}, {mask(c)}", xlabel="L = S", ylabel="ms per call")
    if memory:
        ax = axes[len(timed)]
        for c, m, lines in memory:
            for impl, pts in lines.items():
                pts.sort()
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] / 2**20 for p in pts],
                    "-" if m == "fwd+bwd" else "--",
                    marker="o" if c else "s",
                    mfc=None if c else "none",
                    color=color[impl],
                    label=f"{impl} {m} {mask(c)}" + (" (XLA's part)" if impl in native else ""),
                )
        ax.set(title="peak temporary memory", xlabel="L = S", ylabel="MiB")
    for ax in axes[:drawn]:
        _log2_axis(ax, seqs)
        _plain_log(ax, [y for line in ax.get_lines() for y in line.get_ydata()])
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes[: len(timed)]:
        ax.legend(fontsize=7)  # one entry per impl
    if memory and below:
        fig.tight_layout()  # the axes where _save will lay them out, so the legend sits below
        _legend_below(axes[len(timed)], fontsize=7, ncol=2)
    elif memory:
        axes[len(timed)].legend(fontsize=7)
    if not drawn:
        axes[0].text(
            0.5, 0.5, "nothing timed or compiled", ha="center", transform=axes[0].transAxes
        )
    fig.suptitle(title)
    return _save(fig, path)


def collectives(points, path, title: str) -> Path:
    """busbw against message size, one line per (op, axis): a colour per op, a line style per
    axis (ten lines took ten unrelated colours from the cycle), sizes on log2 as 4K, 64K, 1M."""
    from lab.measure.collectives import OPS

    plt = _plt()
    fig, ax = plt.subplots(figsize=(9.5, 5))
    keys = list(dict.fromkeys((p.op, str(p.axis)) for p in points))
    color = _colors([*OPS, *sorted({op for op, _ in keys} - set(OPS))])
    axes = list(dict.fromkeys(axis for _, axis in keys))
    style = {
        a: (("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"))[i % 4] for i, a in enumerate(axes)
    }
    for op, axis in sorted(keys, key=lambda k: (list(color).index(k[0]), axes.index(k[1]))):
        pts = sorted(
            (p for p in points if (p.op, str(p.axis)) == (op, axis)), key=lambda p: p.size_bytes
        )
        ls, marker = style[axis]
        ax.plot(
            [p.size_bytes for p in pts],
            [p.busbw / 1e9 for p in pts],
            ls=ls,
            marker=marker,
            color=color[op],
            label=f"{op} @ {axis}",
        )
    _log2_axis(ax, [p.size_bytes for p in points], fmt=_size)
    _plain_log(ax, [p.busbw / 1e9 for p in points])
    ax.set(xlabel="message size S (bytes)", ylabel="busbw (GB/s)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    # beside the axes: ten entries inside covered the lines
    ax.legend(
        fontsize=7, title="op @ mesh axis", title_fontsize=7, loc="upper left",
        bbox_to_anchor=(1.01, 1.0), borderaxespad=0,
    )  # fmt: skip
    return _save(fig, path, dpi=120)


def scaling_study(study: ScalingStudy, path, title: str) -> Path:
    """Step time per strategy vs devices; extrapolated DP efficiency; memory per remat vs batch.
    Device counts and batches on log2 axes ticked at the ones measured; time and memory from 0
    (a 4% difference drawn on 2.04-2.12 MiB looked like a large one)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    steps = [p for p in study.strong if p.step_s is not None]
    for strategy in dict.fromkeys(p.strategy for p in steps):
        pts = [p for p in steps if p.strategy == strategy]
        xs, ys = [p.devices for p in pts], [p.step_s * 1e3 for p in pts]
        axes[0].plot(xs, ys, "o-", label=strategy)
    axes[0].set(xlabel="devices", ylabel="step time (ms)", title="measured step time")
    _log2_axis(axes[0], [p.devices for p in steps])
    _from_zero(axes[0])
    for what, field in (("no overlap", "efficiency"), ("perfect overlap", "efficiency_overlap")):
        pts = [p for p in study.extrapolated if getattr(p, field) is not None]
        xs, ys = [p.devices for p in pts], [getattr(p, field) for p in pts]
        axes[1].plot(xs, ys, "o-" if field == "efficiency" else "s--", label=what)
    axes[1].set(
        ylim=(0, 1.05), xlabel="devices", ylabel="efficiency", title="DP efficiency — EXTRAPOLATED"
    )
    _log2_axis(axes[1], [p.devices for p in study.extrapolated])
    mems = [p for p in study.remat if p.peak_bytes is not None]
    for remat in dict.fromkeys(p.remat for p in mems):
        pts = [p for p in mems if p.remat == remat]
        xs, ys = [p.batch for p in pts], [p.peak_bytes / 2**20 for p in pts]
        axes[2].plot(xs, ys, "o-", label=f"remat={remat}")
    axes[2].set(xlabel="batch", ylabel="peak MiB per device", title="remat × batch (compiled step)")
    _log2_axis(axes[2], [p.batch for p in mems])  # batches are whole: ticked where measured
    _from_zero(axes[2])
    for ax in axes:
        ax.grid(True, alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=8)
    simulated = " · devices simulated on one CPU host" if study.simulated else ""
    fig.suptitle(title + simulated, fontsize=9)
    return _save(fig, path)


def prediction(rows, path, title: str) -> Path | None:
    """Predicted against published, log-log, one marker per (vendor, role), with the ±15%
    band: the step-time model's error on the points it was not fitted on shows as distance
    from the diagonal (lab.studies.prediction)."""
    return _prediction_panels([(rows, title)], path)


def _prediction_panels(panels, path) -> Path | None:
    """One prediction panel per (rows, title); None where no row has both figures."""
    panels = [([r for r in rows if r.predicted and r.published], t) for rows, t in panels]
    panels = [(pts, t) for pts, t in panels if pts]
    if not panels:
        return None
    plt = _plt()
    n = len(panels)
    fig, axes = plt.subplots(1, n, figsize=(5.6 * n, 5.2), squeeze=False)
    for ax, (pts, title) in zip(axes[0], panels, strict=True):
        _prediction_axes(ax, pts, title)
    return _save(fig, path)


def _prediction_axes(ax, pts, title: str) -> None:
    lo = min(min(r.published, r.predicted) for r in pts) / 1.5
    hi = max(max(r.published, r.predicted) for r in pts) * 1.5
    xs = [lo, hi]
    ax.loglog(xs, xs, color="black", lw=0.8, label="predicted = published")
    ax.fill_between(xs, [x / 1.15 for x in xs], [x * 1.15 for x in xs], color="gray", alpha=0.2,
                    label="±15%")  # fmt: skip
    styles = {"calibration": "s", "held-out": "o"}
    for role, marker in styles.items():
        for vendor, color in (("tpu", "tab:blue"), ("gpu", "tab:green")):
            sel = [
                r
                for r in pts
                if r.role == role and r.hardware.startswith("tpu") == (vendor == "tpu")
            ]
            if sel:
                ax.loglog([r.published for r in sel], [r.predicted for r in sel], marker,
                          color=color, mfc="none" if role == "calibration" else color,
                          label=f"{vendor}, {role}")  # fmt: skip
    ax.set(xlabel="published (its own unit)", ylabel="predicted by the model (same unit)")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)


def prediction_records(records: Sequence[dict], path) -> Path | None:
    """The ledger's prediction plot, from the records of experiments/prediction.py.

    The model predicts from compiled programs, not from the machine that ran it, so a merge
    of folders that predicted the same figures draws them once (it drew each folder's copy
    over the last); folders whose predictions differ (another lab version) get a panel each,
    named by their compare column."""
    from types import SimpleNamespace

    machines = by_machine(series(records, "prediction_point"))
    held = by_machine(series(records, "prediction_error"))

    def rows_of(mine):
        return [
            SimpleNamespace(
                published=r["config"]["published"],
                predicted=r["value"],
                role=r["config"]["fit_role"],
                hardware=r["config"]["hardware"],
            )
            for r in mine
        ]

    def title_of(machine):
        # a folder's own error; another's only where one folder drew (its records unnamed)
        err = held.get(machine) or (sum(held.values(), []) if len(machines) == 1 else [])
        if not err:
            return "the step-time model against published figures"
        e = err[0]
        n = e["config"]["points"]
        return (
            f"held-out: {n} point{'s' * (n != 1)}, median |error| {e['value']:.0%}, "
            f"worst {e['config']['worst_ratio']:.2f}×"
        )

    def key(mine):
        return sorted((r["config"].get("point"), r["config"]["fit_role"], r["value"]) for r in mine)

    groups = list(machines.items())
    if not groups:
        return None
    if all(key(mine) == key(groups[0][1]) for _, mine in groups[1:]):
        where = "" if len(groups) == 1 else f" (the same in {len(groups)} folders)"
        return _prediction_panels([(rows_of(groups[0][1]), title_of(groups[0][0]) + where)], path)
    return _prediction_panels([(rows_of(mine), f"{title_of(m)} · {m}") for m, mine in groups], path)
