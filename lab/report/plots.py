"""PNG plots from records only: roofline, matmul by precision, attention time and memory
against sequence length, memory breakdown, scaling, batch size, inference, loss curves.

Each plot reads the records whose config carries its `series` and returns None when there
are none, so a partial run (only=C08) plots what it has.
"""

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def series(records: Sequence[dict], name: str) -> list[dict]:
    return [r for r in records if r.get("config", {}).get("series") == name]


def _label(r: dict) -> str:
    return f"{r['backend']} · {r['device_kind']}"


def roofline(records, path) -> Path | None:
    """Measured points under the measured roofs (lab.measure.roofline.plot)."""
    from lab.measure.roofline import Point, plot

    pts = series(records, "roofline")
    roofs = {r["config"]["roof"]: r["value"] for r in series(records, "roof")}
    if not pts or "peak" not in roofs or "bandwidth" not in roofs:
        return None
    points = [
        Point(
            r["config"]["name"], r["config"]["flops"], r["config"]["bytes"], r["config"]["median_s"]
        )
        for r in pts
    ]
    title = f"roofline · {_label(pts[0])} (measured roofs and points)"
    return plot(
        points, peak_flops=roofs["peak"], bandwidth=roofs["bandwidth"], path=path, title=title
    )


def matmul(records, path) -> Path | None:
    rows = series(records, "matmul_precision")
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    names = [f"{r['config']['dtype']}\n{r['config']['precision']}\n{r['backend']}" for r in rows]
    ax.bar(range(len(rows)), [r["value"] / 1e9 for r in rows], color="tab:blue")
    ax.set_xticks(range(len(rows)), names, fontsize=7)
    ax.set_ylabel("GFLOP/s (measured)")
    ax.set_title(
        f"matmul n={rows[0]['config'].get('n')} by precision · {_label(rows[0])}", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def attention(records, path) -> Path | None:
    rows = series(records, "attention")
    if not rows:
        return None
    plt = _plt()
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
    lines = defaultdict(list)
    for r in rows:
        c = r["config"]
        lines[(c["impl"], c["mode"])].append((c["seq_len"], c["median_s"], c.get("temp_bytes")))
    for (impl, mode), pts in sorted(lines.items()):
        pts.sort()
        style = "-" if mode == "fwd+bwd" else "--"
        ax_t.loglog(
            [p[0] for p in pts],
            [p[1] * 1e3 for p in pts],
            style,
            marker="o",
            label=f"{impl} {mode}",
        )
        mem = [(p[0], p[2]) for p in pts if p[2]]
        if mem:
            ax_m.loglog(
                [p[0] for p in mem],
                [p[1] / 2**20 for p in mem],
                style,
                marker="o",
                label=f"{impl} {mode}",
            )
    ax_t.set(xlabel="sequence length", ylabel="ms per call (median)", title="time")
    ax_m.set(xlabel="sequence length", ylabel="MiB temporaries (compiled)", title="memory")
    for ax in (ax_t, ax_m):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"attention · {_label(rows[0])}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


COMPONENTS = ("params", "grads", "optimizer", "activations", "workspace")


def memory(records, path) -> Path | None:
    """Stacked predicted components beside the compiled total, per case."""
    rows = series(records, "memory_breakdown")
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows)), 4))
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    for comp in COMPONENTS:
        vals = [r["config"]["predicted"].get(comp, 0) / 2**20 for r in rows]
        ax.bar([i - 0.2 for i in x], vals, width=0.38, bottom=bottom, label=f"predicted {comp}")
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.bar(
        [i + 0.2 for i in x],
        [r["value"] / 2**20 for r in rows],
        width=0.38,
        color="k",
        alpha=0.7,
        label="compiled (measured)",
    )
    ax.set_xticks(list(x), [r["config"]["case"] for r in rows], fontsize=7, rotation=20)
    ax.set_ylabel("MiB per device")
    ax.set_title(f"training memory: calculator vs compiler · {_label(rows[0])}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _measured_split(ax, rows) -> None:
    """Measured data-parallel step over the devices present: step, collective, compute."""
    for what, style in (("step time", "o-"), ("collective time", "s--"), ("compute time", "^:")):
        pts = sorted(
            (r["config"]["devices"], r["value"]) for r in rows if r["what"].startswith(what)
        )
        if pts:
            ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], style, label=what)
    ax.set(xlabel="devices (data parallel)", ylabel="ms (measured / derived)")
    ax.set_title(
        "measured here" + (" (simulated CPU devices)" if rows[0]["backend"] == "cpu" else ""),
        fontsize=9,
    )
    ax.legend(fontsize=7)


def scaling(records, path) -> Path | None:
    """Data-parallel efficiency against device count (predicted), per-strategy memory, and the
    measured step split where lab.parallel.scaling ran."""
    eff = series(records, "dp_scaling")
    mem = series(records, "strategy_memory")
    measured = [
        r for r in series(records, "dp_measured") if r["config"].get("experiment") == "scaling"
    ]
    if not eff and not mem:
        return None
    plt = _plt()
    panels = 3 if measured else 2
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4))
    ax_e, ax_m = axes[0], axes[1]
    by_target = defaultdict(list)
    for r in eff:
        by_target[r["config"].get("target", "")].append((r["config"]["devices"], r["value"]))
    for target, pts in sorted(by_target.items()):
        pts.sort()
        ax_e.semilogx(
            [p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{target} (predicted)"
        )
    ax_e.axhline(0.5, ls=":", color="gray")
    ax_e.set(
        xlabel="data-parallel devices",
        ylabel="compute / (compute + all-reduce)",
        title="data-parallel efficiency",
        ylim=(0, 1.05),
    )
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
    fig.suptitle(f"scaling · {_label((eff or mem)[0])}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def batch_sweep(records, path) -> Path | None:
    rows = sorted(series(records, "batch_sweep"), key=lambda r: r["config"]["batch"])
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    b = [r["config"]["batch"] for r in rows]
    ax.semilogx(b, [r["value"] for r in rows], "o-", color="tab:blue", base=2)
    ax.set(xlabel="batch size", ylabel="tokens/s (measured)")
    ax2 = ax.twinx()
    ax2.semilogx(
        b, [r["config"]["memory_bytes"] / 2**20 for r in rows], "s--", color="tab:red", base=2
    )
    ax2.set_ylabel("MiB compiled", color="tab:red")
    ax.set_title(f"batch size: throughput and memory · {_label(rows[0])}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def losses(records, path) -> Path | None:
    rows = series(records, "loss_curve")
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for r in rows:
        ys = r["config"]["losses"]
        ax.plot(range(1, len(ys) + 1), ys, label=r["config"]["dtype"])
    ax.set(xlabel="step", ylabel="loss", title="the same steps in float32 and bf16 compute")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def inference(records, path) -> Path | None:
    rows = sorted(series(records, "inference_batch"), key=lambda r: r["config"]["batch"])
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    b = [r["config"]["batch"] for r in rows]
    ax.semilogx(b, [r["value"] for r in rows], "o-", base=2, label="requests/s")
    ax2 = ax.twinx()
    ax2.semilogx(b, [r["config"]["median_s"] * 1e3 for r in rows], "s--", color="tab:red", base=2)
    ax2.set_ylabel("latency per batch (ms)", color="tab:red")
    ax.set(xlabel="batch size", ylabel="requests/s (measured)")
    ax.set_title(f"classifier inference · {_label(rows[0])}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# topic → [(file name, plot function)], in the order the report shows them.
PLOTS = {
    "matmul": [("matmul.png", matmul)],
    "roofline": [("roofline.png", roofline)],
    "attention": [("attention.png", attention)],
    "memory": [("memory.png", memory), ("batch.png", batch_sweep)],
    "parallel": [("scaling.png", scaling)],
    "training": [("losses.png", losses)],
    "inference": [("inference.png", inference)],
}


def make_all(records: Sequence[dict], out_dir) -> dict[str, list[str]]:
    """Every plot the records allow, written into out_dir; topic → file names."""
    out = {}
    for topic, entries in PLOTS.items():
        for name, fn in entries:
            if fn(records, Path(out_dir) / name) is not None:
                out.setdefault(topic, []).append(name)
    return out
