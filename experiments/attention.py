"""C08: naive attention against flash attention — error, time and memory over sequence length.

Every implementation runs the same causal attention on the same random inputs, forward and
forward+backward (the gradient of ⟨o, do⟩ for a random do). Time is `timing.bench`'s median;
memory is the compiler's temporaries for that jitted call (what XLA must allocate beyond
inputs and outputs: the naive form's L×S scores, the flash form's tiles). The speedup part
of C08 is about on-chip SRAM, so only an accelerator's figure can decide it; the CPU's is
recorded as context.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import backend, pick, record
from lab.kernels.attention.reference import attention_reference
from lab.measure import memory, timing

CLAIMS = ("C08",)


def _library(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def implementations(be: str) -> dict:
    """name → (fn(q, k, v), is_flash). Flash kinds present on this backend, plus the naive
    reference and, on accelerators, the library call (cuDNN's fused kernel on GPU)."""
    from lab.kernels import attention as dispatch
    from lab.kernels.attention.blockwise import blockwise_attention

    impls = {
        "naive": (functools.partial(attention_reference, causal=True), False),
        "flash (blockwise jnp)": (functools.partial(blockwise_attention, causal=True), True),
    }
    kernel = {"tpu": "pallas", "gpu": "pallas"}.get(be)
    if kernel and kernel in getattr(dispatch, "IMPLS", ()):
        impls[f"flash ({kernel} {be})"] = (
            functools.partial(dispatch.attention, causal=True, impl=kernel),
            True,
        )
    if be == "gpu":
        impls["library (cuDNN)"] = (
            functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn"),
            True,
        )
    elif be == "tpu":
        impls["library (XLA)"] = (_library, False)
    return impls


def _fwd_bwd(fn):
    def loss(q, k, v, do):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * do)

    return jax.grad(loss, argnums=(0, 1, 2))


def _measure(fn, args, budget_s: float) -> dict:
    jitted = jax.jit(fn)
    mem = memory.compiled_memory(jitted.lower(*args).compile()) or {}
    r = timing.bench(jitted, *args, budget_s=budget_s, warmup=1, min_runs=3, max_runs=100)
    return {
        "median_s": r.median_s,
        "compile_s": r.compile_s,
        "runs": r.runs,
        "temp_bytes": mem.get("temp_bytes"),
        "out": jitted(*args),
    }


def _max_err(a, b) -> float:
    leaves = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max(
        float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))) for x, y in leaves
    )


def exponent(seq_lens, values) -> float | None:
    """Least-squares slope of log(value) on log(seq_len): 2 for n², 1 for linear."""
    pts = [(s, v) for s, v in zip(seq_lens, values, strict=True) if v]
    if len(pts) < 2:
        return None
    x, y = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
    return float(np.polyfit(x, y, 1)[0])


def run(size: str = "quick") -> list[dict]:
    be = backend()
    B, H, K, D = pick(size, tiny=(1, 2, 1, 16), quick=(1, 4, 2, 64), full=(2, 8, 4, 64))
    seq_lens = pick(
        size,
        tiny=(64, 128),
        quick=(256, 512, 1024, 2048),
        full=(512, 1024, 2048, 4096) if be == "cpu" else (1024, 2048, 4096, 8192, 16384),
    )
    budget = pick(size, tiny=0.01, quick=0.15, full=1.0)
    dtype = jnp.float32
    impls = implementations(be)
    recs, by = [], {}
    for L in seq_lens:
        q, k, v, do = timing.random_inputs(
            L, [(B, L, H, D), (B, L, K, D), (B, L, K, D), (B, L, H, D)], dtype
        )
        outs = {}
        for name, (fn, _) in impls.items():
            for mode, f, args in (("fwd", fn, (q, k, v)), ("fwd+bwd", _fwd_bwd(fn), (q, k, v, do))):
                m = _measure(f, args, budget)
                outs[(name, mode)] = m.pop("out")
                by[(name, mode, L)] = m
                recs.append(
                    record(
                        "C08",
                        None,
                        f"{name} {mode}, L={L}",
                        m["median_s"],
                        "s",
                        series="attention",
                        impl=name,
                        mode=mode,
                        seq_len=L,
                        shape=[B, L, H, K, D],
                        dtype="float32",
                        **m,
                    )
                )
        for name, (_, is_flash) in impls.items():
            if name == "naive":
                continue
            err = max(_max_err(outs[(name, m)], outs[("naive", m)]) for m in ("fwd", "fwd+bwd"))
            recs.append(
                record(
                    "C08",
                    "flash_max_error" if is_flash else None,
                    f"{name}: max |Δ| against naive (outputs and gradients), L={L}",
                    err,
                    "max |Δ|",
                    role="evidence" if is_flash else "context",
                    impl=name,
                    seq_len=L,
                )
            )
    longest = seq_lens[-1]
    for name, (_, is_flash) in impls.items():
        temps = [by[(name, "fwd+bwd", L)]["temp_bytes"] for L in seq_lens]
        recs.append(
            record(
                "C08",
                "flash_memory_exponent" if is_flash else None,
                f"{name} fwd+bwd: slope of log(temporary bytes) on log(L), "
                f"L={seq_lens[0]}…{longest}",
                exponent(seq_lens, temps),
                "exponent",
                role="evidence" if is_flash else "context",
                impl=name,
                temp_bytes=temps,
                seq_lens=list(seq_lens),
            )
        )
        if name == "naive":
            continue
        naive_s = by[("naive", "fwd+bwd", longest)]["median_s"]
        recs.append(
            record(
                "C08",
                "flash_speedup" if is_flash else None,
                f"naive over {name} time, fwd+bwd, L={longest}",
                naive_s / by[(name, "fwd+bwd", longest)]["median_s"],
                "×",
                label="derived",
                role="evidence" if is_flash else "context",
                impl=name,
                seq_len=longest,
            )
        )
    return recs
