"""`python -m lab.tools.attention_plan target=tpu:v5e:2x2 seq=4096` (or target=gpu:h100): the
Pallas flash kernel compiled for hardware that is not here — compiled, not run.

The kernel runs per device under shard_map (batch over `data`, heads over `model`), as in the
sharded training step; forward and forward + backward are compiled for the target. Per mode:
memory per device against the chip's HBM, compiled FLOPs beside the analytic count, the time
per call (the compiler's estimate floored by the roofline of the analytic FLOPs), the
TFLOP/s and share of peak that implies; on a GPU, every kernel's registers, spills, shared
memory and blocks per SM. See lab/studies/plan.py.
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
    target: str = field("tpu:v5e:2x2", f"the slice, e.g. {plans.target_help()}")
    batch: int = field(4, "B", min=1)
    heads: int = field(8, "H, query heads", min=1)
    kv_heads: int = field(8, "G, key/value heads", min=1)
    seq: int = field(4096, "L = S", min=1)
    head_dim: int = field(128, "K", min=1)
    dtype: str = field("bfloat16", "compute dtype", choices=("bfloat16", "float32", "float16"))
    causal: bool = field(True, "causal mask")
    data: int = field(2, "mesh axis the batch splits over (the rest: heads)", min=1)
    out_dir: str = field("results", "folder for the records", kind="path")


def run(o: Options) -> int:
    stem = rec.output_stem(o.out_dir, "attention-plan")
    config = {k: v for k, v in dataclasses.asdict(o).items() if k not in ("target", "out_dir")}
    rows = plan.plan(o.target, **config)
    title = (
        f"flash attention plan · {o.target} ({rows[0]['device_kind']} × {rows[0]['devices']})"
        f" · B={o.batch} H={o.heads}/{o.kv_heads} L=S={o.seq} K={o.head_dim} "
        f"{o.dtype} causal={o.causal} · compiled, not run"
    )
    con = progress.console(width=150)
    con.print(tables.attention_plan(rows, title))
    for r in rows:
        if r["kernels"]:
            con.print(tables.kernels(r["kernels"], f"{r['mode']}: GPU kernels, compiled, not run"))
    recs = plan.to_records(rows, {"target": o.target, **config})
    con.print(f"records → {rec.write_records(stem.with_suffix('.jsonl'), recs)}")
    return 0


def main(argv=None) -> int:
    return cli(Options, run, prog="python -m lab.tools.attention_plan", doc=__doc__, argv=argv)


if __name__ == "__main__":
    sys.exit(main())
