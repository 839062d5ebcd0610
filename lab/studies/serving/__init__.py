"""Serving the lab's transformer, measured: prefill and decode timed apart, what a decode step
must move, how close it comes to the memory roof, where batching turns it compute-bound, and
what int8 weights and an int8 cache change. `python -m lab.serve` is the command.

One idea per module:

    weights   the parameters to serve: a run folder's newest checkpoint, or random weights
    roofs     this device's memory and compute roofs, measured, and the best bandwidth seen
    timed     prefill and decode steps timed (a decoder, random prompts, the warm-up)
    points    one prefill or decode point: its time with the bytes and FLOPs it implies
    int8      what int8 weights and an int8 cache cost in accuracy
    sample    a short generated text of a trained byte-level model
    study     the whole study (its plan, the checks before it, the sweep, the summary)
    compiled  the decode step compiled for a target= (compiled, not run)
    records   one lab.measure record per figure

The results are the frozen types of lab.measure.serving; the formulas are lab.measure.cost's
(weight_read_bytes, step_flops, prefill_flops, critical_batch, serving_peak_bytes). The decode
step's figures (MaxText's inference microbenchmark, the scaling book's inference chapter):

    bytes a step must move  = the weights the matmuls read (every parameter but the embedding
                              table, of which a lookup reads B rows) + the cache it reads
    achieved bandwidth      = those bytes / the step's median time
    FLOPs of a step         = B · (2·N + 4·layers·S·d_model)     (N: non-embedding parameters,
                              S: the cache slots attention reads)
    arithmetic intensity    = FLOPs / bytes ≈ B · 2 / bytes per weight while the weights
                              dominate: decode is memory-bound until B reaches
    critical batch B*       = ridge · W / (f − ridge · c)        (W weight bytes, f FLOPs and
                              c cache bytes per sequence; ridge = compute roof / memory roof)

Both roofs are measured here (lab.measure.ceilings: the copy kernel's bandwidth, the matmul
peak at the compute dtype), in the same process, before the sweep.
"""
