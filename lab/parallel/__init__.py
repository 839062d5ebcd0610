"""Parallelism: what each sharding strategy moves, collective benchmarks, shard_map kernels.

`collectives_hlo` reads the collectives of a compiled step, `explain` holds them against the
analytic figures, `bench_collectives` times them, `collective_matmul` and `ring_attention` are
hand-written shard_map kernels, `scaling` and `remat` are the experiments.
"""
