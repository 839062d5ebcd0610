"""`python -m lab.tools.attention_plan target=tpu:v5e:2x2 seq=4096` (or target=gpu:h100
seq=1024,4096 head_dim=64,128 for a grid): the Pallas flash kernel compiled for hardware that
is not here — compiled, not run.

The kernel runs per device under shard_map (batch over `data`, heads over `model`), as in the
sharded training step; forward and forward + backward are compiled for the target. Per mode:
memory per device against the chip's HBM, compiled FLOPs beside the analytic count, the time
per call (predicted: the compiler's estimate floored by the roofline of the analytic FLOPs;
for packed documents, whose compiled cost is an upper bound, the floor of the analytic FLOPs
and the bytes read and written once), the TFLOP/s and share of peak that implies; on a GPU,
every kernel's registers, spills, shared memory and blocks per SM. `window=1024 docs=1024`
compile a sliding window and packed documents beside the plain mask and print the FLOPs of
each side by side: only the tiles the kernels' block maps leave are counted.
See lab/studies/plan.py.
"""

import dataclasses
import sys

from lab import plans
from lab.config import cli, field
from lab.measure import records as rec
from lab.report import progress, tables
from lab.studies import plan


@dataclasses.dataclass(frozen=True)
class Options:
    KEY_ALIASES = {"seqs": "seq", "head_dims": "head_dim"}  # the attention bench's names
    target: str = field("tpu:v5e:2x2", f"the slice, e.g. {plans.target_help()}")
    batch: int = field(4, "B", min=1)
    heads: int = field(8, "H, query heads", min=1)
    kv_heads: int = field(8, "G, key/value heads", min=1)
    seq: tuple = field((4096,), "L = S; several (1024,4096) make a grid", kind="ints", min=1)
    head_dim: tuple = field((128,), "K; several (64,128) make a grid", kind="ints", min=1)
    dtype: str = field("bfloat16", "compute dtype", choices=("bfloat16", "float32", "float16"))
    causal: bool = field(True, "causal mask")
    data: int = field(
        0,
        "mesh axis the batch splits over (the rest: heads); 0 = 2, or 1 where the target's "
        "devices do not split in two (one GPU)",
        min=0,
    )
    impl: str = field(
        "pallas",
        "the kernel: pallas = the target's (Mosaic on TPU; on a GPU Mosaic GPU where it takes "
        "the input on Hopper, else Triton), or one by name",
        choices=("pallas", "pallas_tpu", "pallas_gpu", "pallas_mgpu"),
    )
    window: tuple = field(
        (),
        "sliding windows to compile beside the plain mask (keys a query sees, itself "
        "included), e.g. 1024; causal, so with causal=true",
        kind="ints",
        min=1,
        max=2**31,  # the kernels count its W-1 keys in int32
    )
    docs: tuple = field(
        (),
        "packed-document lengths to compile beside the plain mask (segment ids restarting "
        "every N tokens, causal within; the last may be shorter), e.g. 1024; with causal=true",
        kind="ints",
        min=1,
    )
    out_dir: str = field("results", "folder for the records", kind="path")


def run(o: Options) -> int:
    stem = rec.output_stem(o.out_dir, "attention-plan", backend=o.target.split(":")[0])
    skip = ("target", "out_dir", "seq", "head_dim", "window", "docs")
    config = {k: v for k, v in dataclasses.asdict(o).items() if k not in skip}
    masks = plan.masks_of(o.causal, o.window, o.docs)
    n = len(o.seq) * len(o.head_dim) * len(masks)
    plan.check(o.target, seqs=o.seq, head_dims=o.head_dim, masks=masks, **config)  # before
    con = progress.console(width=150)  # the progress line: a bad request is one line
    with progress.tasks(con) as bar:
        task = bar.add_task("compiling", total=n)

        done = iter(range(n))

        def tick(label):  # called before each point: the ones before it are done
            bar.update(task, description=label, completed=next(done))

        rows = plan.grid(
            o.target, seqs=o.seq, head_dims=o.head_dim, masks=masks, progress=tick, **config
        )
        bar.update(task, completed=n)
    chosen = ", ".join(dict.fromkeys(r.impl for r in rows))  # per point of a grid
    chosen = o.impl if chosen == o.impl else f"{o.impl} → {chosen}"
    title = (
        f"flash attention plan ({chosen}) · {o.target} ({rows[0].device_kind} × "
        f"{rows[0].devices}) · B={o.batch} H={o.heads}/{o.kv_heads} {o.dtype} "
        f"causal={o.causal} · compiled, not run; times predicted"
    )
    con.print(tables.attention_plan(rows, title))
    if len(masks) > 1:
        con.print(tables.attention_plan_masks(rows, "FLOPs per device by mask, compiled, not run"))
        for source in dict.fromkeys(r.flops_source for r in rows):
            named = dict.fromkeys(r.mask for r in rows if r.flops_source == source)
            con.print(f"FLOPs of {', '.join(named)}: {source}")
    for note in dict.fromkeys(r.attention_note for r in rows if r.attention_note):
        con.print(f"[yellow]attention: {note}")
    tc = rows[0].toolchain
    if len(rows) > 2 and any(r.kernels for r in rows):  # a grid: one table of them all
        con.print(tables.kernel_grid(rows, "GPU kernels of fwd+bwd, compiled, not run", tc))
    else:
        for r in rows:
            if r.kernels:
                title = f"{r.mode}: GPU kernels, compiled, not run"
                con.print(tables.kernels(list(r.kernels), title, tc))
    recs = plan.to_records(rows, {"target": o.target, **config})
    con.print(
        f"records → {rec.write_records(stem.with_suffix('.jsonl'), recs)}",
        markup=False,
        soft_wrap=True,
    )
    return 0


def main(argv=None) -> int:
    return cli(Options, run, prog="python -m lab.tools.attention_plan", doc=__doc__, argv=argv)


if __name__ == "__main__":
    from lab.report.progress import survive_lost_output

    survive_lost_output()  # a reader gone (| head) loses no records or report
    sys.exit(main())
