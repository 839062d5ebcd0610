"""Analysis of compiled programs: the collectives a compiled step really holds
(`collectives_hlo`), held against the analytic figures of its sharding strategy (`explain`).

Hand-written shard_map kernels live in lab/kernels; the studies that time steps and
collectives in lab/studies and lab/measure.
"""
