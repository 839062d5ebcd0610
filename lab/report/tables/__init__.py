"""Every table the lab prints in a terminal (rich), built from the studies' types (lab.measure),
plain dicts and records.

The library returns numbers; the commands hand them here. Numbers become text only through
lab/report/format.py, so a figure reads the same in every table.

One module per command family; this package re-exports every public name, so callers keep
writing `from lab.report import tables` and `tables.run_summary(...)`.
"""

from lab.report.tables.attention import (
    attention_plan,
    attention_plan_masks,
    attention_sweep,
    attention_targets,
)
from lab.report.tables.common import GIB
from lab.report.tables.compiled import kernel_grid, kernels, toolchain_line
from lab.report.tables.explain import explain_collectives, explain_memory, explain_pipeline
from lab.report.tables.ledger import off_by, verdicts
from lab.report.tables.parallelism import collectives, scaling
from lab.report.tables.prediction import (
    prediction_cpu_rows,
    prediction_here_rows,
    prediction_markdown,
    prediction_rows,
)
from lab.report.tables.roofline import ceilings
from lab.report.tables.run import (
    analysis,
    breakdown_line,
    offload_line,
    pipeline_line,
    run_header,
    run_summary,
    top_ops_line,
)
from lab.report.tables.serving import (
    serving_decode,
    serving_int8,
    serving_matmuls,
    serving_peers,
    serving_plans,
    serving_prefill,
    serving_summary,
)
from lab.report.tables.steps import step_compare
from lab.report.tables.tuning import candidate_text, static_pass, tied_text, tune_stage, tune_step

__all__ = [
    "GIB",
    "analysis",
    "attention_plan",
    "attention_plan_masks",
    "attention_sweep",
    "attention_targets",
    "breakdown_line",
    "ceilings",
    "collectives",
    "explain_collectives",
    "explain_memory",
    "explain_pipeline",
    "kernel_grid",
    "kernels",
    "offload_line",
    "pipeline_line",
    "prediction_cpu_rows",
    "prediction_here_rows",
    "prediction_markdown",
    "prediction_rows",
    "run_header",
    "run_summary",
    "scaling",
    "serving_decode",
    "serving_int8",
    "serving_matmuls",
    "serving_peers",
    "serving_plans",
    "serving_prefill",
    "serving_summary",
    "candidate_text",
    "static_pass",
    "step_compare",
    "toolchain_line",
    "top_ops_line",
    "tied_text",
    "tune_stage",
    "tune_step",
    "off_by",
    "verdicts",
]
