"""Parallelism: what each sharding strategy moves, collective benchmarks, shard_map kernels.

`collectives_hlo` reads the collectives of a compiled step, `explain` holds them against the
analytic figures, `collectives` times them (nccl-tests conventions), `collective_matmul` and
`ring_attention` are hand-written shard_map kernels (`shmap` papers over the JAX versions),
`scaling` runs the scaling, DP-extrapolation and remat × batch experiments.
"""
