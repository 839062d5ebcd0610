"""`python -m lab.tools.attention_targets`: the GPU-speed targets of the lab's GPU kernels.

bfloat16, B=2, H=32, L = S in 2048…16384, head_dim 64 and 128, causal and not, forward and
forward + backward: pallas_mgpu (Hopper) and pallas_gpu against cuDNN (or the best fallback),
JAX's bundled Pallas kernels, XLA, tokamax and PyTorch SDPA in one sweep per head_dim. Prints
the verdicts and writes the records and a Markdown block for BENCHMARKS.md. Needs an NVIDIA
GPU. See lab/studies/targets.py.
"""

import dataclasses
import sys
import time

import jax

from lab.config import cli, field
from lab.errors import ConfigError
from lab.measure import records as rec
from lab.report import markdown, progress, tables
from lab.studies import attention, targets


@dataclasses.dataclass(frozen=True)
class Options:
    head_dims: tuple = field(targets.HEAD_DIMS, "head dims", kind="ints", min=1)
    seqs: tuple = field(targets.SEQS, "sequence lengths", kind="ints", min=1)
    budget: float = field(0.3, "seconds of timed runs per implementation", min=0.01)
    out_dir: str = field("results", "folder for the records and the Markdown", kind="path")


def run(o: Options) -> int:
    if jax.default_backend() != "gpu":
        raise ConfigError(
            f"the targets compare compiled GPU kernels; this backend is {jax.default_backend()}"
            " (run on an NVIDIA GPU; on CPU, python -m lab.tools.attention_bench)"
        )
    stem = rec.output_stem(o.out_dir, "attention-targets")
    con = progress.console(width=160)
    records, verdicts = targets.run(o.head_dims, o.seqs, budget_s=o.budget, progress=con.log)
    rec.write_records(stem.with_suffix(".jsonl"), records)
    for d in o.head_dims:
        rows = attention.rows_of([r for r in records if r["config"]["head_dim"] == d])
        con.print(tables.attention_sweep(rows, "cudnn", f"K={d}"))
    con.print(tables.attention_targets(verdicts))
    command = "python -m lab.tools.attention_targets " + " ".join(sys.argv[1:])
    block = markdown.targets_block(
        verdicts, rec.environment(), command.strip(), time.strftime("%Y-%m-%d")
    )
    stem.with_suffix(".md").write_text(block)
    con.print(f"records and Markdown → {stem}.*", markup=False)
    return 0


def main(argv=None) -> int:
    return cli(Options, run, prog="python -m lab.tools.attention_targets", doc=__doc__, argv=argv)


if __name__ == "__main__":
    from lab.report.progress import survive_lost_output

    survive_lost_output()  # a reader gone (| head) loses no records or report
    sys.exit(main())
