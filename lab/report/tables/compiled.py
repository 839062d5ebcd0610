"""The kernels of a compiled GPU program (registers, spills, shared memory, occupancy) and the
toolchain that compiled them: lab.run plans and lab.tools.attention_plan, compiled, not run.
Each renderer takes the types (lab.measure.gpu_kernels.Kernel, lab.measure.toolchain.Toolchain,
lab.measure.attention.PlanPoint), whose fields say what every figure is.
"""

import dataclasses
import re

from rich.table import Table

from lab.measure.attention import PlanPoint
from lab.measure.gpu_kernels import Kernel
from lab.measure.toolchain import Toolchain
from lab.report.format import percent, size

_XLA_KERNEL = re.compile(
    r"^(loop_|input_|wrapped_|gemm_|fusion|triton_gemm|triton_softmax|copy|transpose|"
    r"reduce|concatenate|dynamic|bitcast|convert|slice|cutlass|rng|select|scatter|gather)"
)


def kernels(rows: list[Kernel], title: str, toolchain: Toolchain | None = None) -> Table:
    """The custom (Pallas, Mosaic) kernels of a compiled program one by one, XLA's own in one
    summary row (every one is in summary.json): lab/plans/resources.py, compiled, not run.
    Launches are per call, a kernel in a loop body counted once per trip ('≥' where a loop's
    trip count is unknown), as the compiled FLOPs count loops.
    `toolchain` (lab.measure.toolchain.probe()) is the caption: registers and spills
    are ptxas's, so the table names the ptxas and plugin it came from."""
    t = Table(title=title, caption=toolchain_line(toolchain) if toolchain else None)
    cols = ("kernel", "launches", "grid", "threads", "registers", "spills (st/ld)", "smem")
    for col in (*cols, "blocks/SM", "limit", "occupancy"):
        left = col == "kernel"
        t.add_column(
            col, justify="left" if left else "right", no_wrap=left, min_width=20 if left else None
        )
    xla = [k for k in rows if _XLA_KERNEL.match(k.name)]
    custom = [k for k in rows if not _XLA_KERNEL.match(k.name)]
    for k in custom:
        spill = f"{k.spill_store_bytes}/{k.spill_load_bytes} B"
        t.add_row(
            k.name[:48],
            _launches([k]) if k.launches is not None else "–",
            "×".join(map(str, k.grid)) if k.grid else "?",
            str(k.threads),
            str(k.registers),
            f"[red]{spill}" if k.spill_bytes else spill,
            size(k.smem),
            str(k.blocks_per_sm),
            k.limiter,
            percent(k.occupancy, 0),
        )
    if xla:
        spills = sum(k.spill_bytes for k in xla)
        t.add_row(
            f"[dim]{len(xla)} XLA kernels",
            _launches(xla),
            "",
            "",
            f"≤ {max(k.registers for k in xla)}",
            f"[red]{spills} B" if spills else "0 B",
            f"≤ {size(max(k.smem for k in xla))}",
            f"≥ {min(k.blocks_per_sm for k in xla)}",
            "",
            "",
        )
    return t


def _launches(rows: list[Kernel]) -> str:
    """Launches per call, each × the trips of the loops around it; '≥ N' where a loop's trip
    count is unknown (that loop counted once)."""
    n = f"{sum(k.launches for k in rows):,}"
    return f"≥ {n}" if any(k.launches_unknown_loop for k in rows) else n


def toolchain_line(tc: Toolchain) -> str:
    """'compiled by ptxas 13.5.37 · jax-cuda13-plugin 0.10.2 · CUDA runtime 13.5'."""
    parts = [f"ptxas {tc.ptxas}" if tc.ptxas else "no ptxas found"]
    if tc.nvjitlink:
        parts.append(f"nvJitLink {tc.nvjitlink}")
    if tc.cuda_plugin:
        parts.append(tc.cuda_plugin)
    if tc.cuda_runtime:
        parts.append(f"CUDA runtime {tc.cuda_runtime}")
    return "compiled by " + " · ".join(parts)


def kernel_grid(rows: list[PlanPoint], title: str, toolchain: Toolchain | None = None) -> Table:
    """One kernel table for a grid of attention plans (lab.studies.plan.grid): every point's
    forward + backward kernels, each named by its L=S and K (and its mask where the grid
    compares masks); XLA's kernels in one row."""
    named = []
    for r in rows:
        if r.mode != "fwd+bwd":
            continue
        for k in r.kernels:
            name = k.name.removesuffix("_mosaic_gpu_kernel").removeprefix("flash_attention_")
            custom = not _XLA_KERNEL.match(k.name)
            masks = len({x.mask for x in rows}) > 1  # a comparison of masks: name each
            point = f"L={r.seq} K={r.head_dim}{f' {r.mask}' if masks else ''} {name}"
            named.append(dataclasses.replace(k, name=point) if custom else k)
    return kernels(named, title, toolchain)
