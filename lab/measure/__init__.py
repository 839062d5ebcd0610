"""Trusted measurements, shared by lab.run, the kernels' benchmarks and the experiments.

timing    bench / compare: compile apart, blocked on every output, median of a time budget
cost      FLOPs and bytes, compiled (per device) and analytic, with their conventions
memory    compiled / allocator / RSS bytes, and the training-memory calculator
specs     datasheet peaks per device_kind, a source for every number
ceilings  measured matmul peak, copy and transfer bandwidth (`python -m lab.measure`)
roofline  the sweep of ops across arithmetic intensity, the ridge point, the plot
records   one JSON record per figure, stamped with the environment
pipeline  what a pipelined step sends between stages (the compiled reading, as types)
tuning    what the tuners measured, as frozen types (step candidates, tile stages, static pass)
serving   what a serving study measured, as frozen types (its points, int8 error, summary)
"""
