"""The lab's commands (`python -m lab.tools.NAME key=value ...`), thin on purpose.

Each declares its options as a frozen dataclass (lab.config.field: help, ranges, choices),
runs through `lab.config.cli` (the grammar every command shares: `--help`, close-match hints,
one line and exit 2 for a mistake), calls one library function (lab/studies, lab/measure)
and hands what it returns to lab/report (tables, plots) and to records.

  ceilings           this device's matmul, copy and transfer ceilings and its roofline
  attention_bench    every attention implementation over sequence lengths
  attention_tune     the recorded tile search of the GPU kernels (Triton, Mosaic GPU)
  attention_plan     the Pallas attention kernels compiled for a TPU slice or GPU: compiled, not run
  attention_targets  the GPU-speed targets of pallas_mgpu / pallas_gpu, judged (GPU only)
  collectives        all-reduce, all-gather, … per mesh axis, nccl-tests style
  collective_matmul  the ppermute ring against gather-then-multiply
  scaling            one model over 1-8 devices per strategy, DP extrapolated, remat × batch
  bench_step         the lab's step against a bare flax+optax step
  tune_step          remat × batch of lab.run's step by measured MFU
  launch             one lab.run over several local jax.distributed processes
  prediction         the step-time model: its fit on the calibration set, its held-out error
  runbook            BENCHMARKS.md's GPU runbook as one command: each step budgeted, resumable
"""
