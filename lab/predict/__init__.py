"""Predicted step times: a model of the compiled program on a machine, with its measured error.

`model.py` times every op of the optimized HLO on a `Machine`; `machines.py` builds machines
from a datasheet entry (TPU slices, NVIDIA GPUs) or from this CPU's measured ceilings, and fits
the model's few free parameters on a named calibration set.
"""
