"""C08: naive attention against flash attention — error, time and memory over sequence length.

The measurements are lab.studies.attention's `sweep`: every implementation compiled
on this backend (naive, blockwise flash in jnp, the backend's Pallas kernel, the library's
`jax.nn.dot_product_attention`, cuDNN on GPU) on the same random causal inputs, forward and
forward+backward, timed call by call against each other; memory is XLA's temporary
allocation of each compiled program; error is against a float64 reference. This module
turns those records into the ledger's: the worst flash error, the naive/flash time ratio at
the longest sequence (only an accelerator has the on-chip SRAM the claim is about: on CPU it
is context) and the slope of flash's memory against sequence length.
"""

import numpy as np

from experiments.common import backend, keep_so_far, pick, record
from lab.studies import attention as bench

CLAIMS = ("C08",)
NAIVE = "naive"
FLASH = ("blockwise", "pallas_tpu", "pallas_gpu", "pallas_mgpu", "cudnn")  # never form L×L


def exponent(seq_lens, values) -> float | None:
    """Least-squares slope of log(value) on log(seq_len): 2 for n², 1 for linear."""
    pts = [(s, v) for s, v in zip(seq_lens, values, strict=True) if v]
    if len(pts) < 2:
        return None
    x, y = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
    return float(np.polyfit(x, y, 1)[0])


# What a time record says besides its median: its spread over the samples (every contender),
# and what PyTorch's times were taken under (torch_sdpa's threads and OpenMP wait policy).
SPREAD = ("p10_s", "p90_s", "runs", "inner")
TORCH = ("torch_version", "torch_threads", "omp_wait_policy")


def _rows(bench_records: list[dict]) -> dict:
    """(impl, mode, seq) → {time and its spread, memory, error} from the bench's one-figure
    records."""
    keys = {
        "attention time": "median_s",
        "attention peak temp memory": "temp_bytes",
        "attention max error": "max_error",
    }
    rows: dict = {}
    for r in bench_records:
        c = r["config"]
        if r["what"] in keys:
            row = rows.setdefault((c["impl"], c["mode"], c["seq"]), {})
            row[keys[r["what"]]] = r["value"]
            row["label"] = r["label"]
            if r["what"] == "attention peak temp memory" and c.get("excludes"):
                row["temp_excludes"] = c["excludes"]  # a native kernel's own buffers: not in it
            if r["what"] == "attention time":
                row.update({k: c[k] for k in (*SPREAD, *TORCH) if k in c})
    return rows


def _context(rows: dict, shape: bench.Shape) -> list[dict]:
    out = []
    for (impl, mode, seq), row in sorted(rows.items()):
        if "median_s" not in row:
            continue
        out.append(
            record(
                "C08",
                None,
                f"{impl} {mode}, L={seq}",
                row["median_s"],
                "s",
                role="context",
                series="attention",
                impl=impl,
                mode=mode,
                seq_len=seq,
                temp_bytes=row.get("temp_bytes"),
                **({"temp_excludes": row["temp_excludes"]} if "temp_excludes" in row else {}),
                max_error=row.get("max_error"),
                shape=[shape.batch, seq, shape.heads, shape.kv_heads, shape.head_dim],
                causal=True,
                dtype=shape.dtype,
                median_s=row["median_s"],
                **{k: row[k] for k in (*SPREAD, *TORCH) if k in row},
            )
        )
    return out


def _evidence(rows: dict, seqs) -> list[dict]:
    out = []
    impls = sorted({k[0] for k in rows})
    longest = max(seqs)
    for impl in impls:
        flash = impl in FLASH
        errors = [r["max_error"] for k, r in rows.items() if k[0] == impl and "max_error" in r]
        if errors:
            out.append(
                record(
                    "C08",
                    "flash_max_error" if flash else None,
                    f"{impl}: largest error against the float64 reference (relative to "
                    "its largest output), outputs and dQ, every L",
                    max(errors),
                    "max |Δ|",
                    label="derived",
                    role="evidence" if flash else "context",
                    impl=impl,
                )
            )
        temps = [rows.get((impl, "fwd+bwd", s), {}).get("temp_bytes") for s in seqs]
        out.append(
            record(
                "C08",
                "flash_memory_exponent" if flash else None,
                f"{impl} fwd+bwd: slope of log(temporary bytes) on log(L), L={min(seqs)}…{longest}",
                exponent(seqs, temps),
                "exponent",
                label="derived",
                role="evidence" if flash else "context",
                impl=impl,
                temp_bytes=temps,
                seq_lens=list(seqs),
            )
        )
        naive = rows.get((NAIVE, "fwd+bwd", longest), {}).get("median_s")
        mine = rows.get((impl, "fwd+bwd", longest), {}).get("median_s")
        if impl != NAIVE and naive and mine:
            out.append(
                record(
                    "C08",
                    "flash_speedup" if flash else None,
                    f"naive over {impl} time, fwd+bwd, L={longest}",
                    naive / mine,
                    "×",
                    label="derived",
                    role="evidence" if flash else "context",
                    impl=impl,
                    seq_len=longest,
                )
            )
    return out


def run(size: str = "quick") -> list[dict]:
    be = backend()
    shape = pick(
        size,
        tiny=bench.Shape(1, 2, 1, 16),
        quick=bench.Shape(1, 4, 2, 64),
        full=bench.Shape(2, 8, 4, 64),
    )
    seqs = pick(  # tiny: one blockwise tile, then 2×2 tiles (below 256 both were one tile)
        size,
        tiny=(256, 512),
        quick=(256, 512, 1024, 2048),
        full=(512, 1024, 2048, 4096) if be == "cpu" else (1024, 2048, 4096, 8192, 16384),
    )
    budget = pick(size, tiny=0.01, quick=0.3, full=1.0)
    modes = pick(size, tiny=("fwd+bwd",), quick=bench.MODES, full=bench.MODES)
    finished: list[dict] = []  # each point's records as it finishes: a stop keeps them
    keep_so_far(lambda: _context(_rows(list(finished)), shape))
    raw = bench.sweep(
        seqs, causal=(True,), modes=modes, shape=shape, budget_s=budget, done=finished.extend
    )
    keep_so_far(None)
    rows = _rows(raw)
    return _context(rows, shape) + _evidence(rows, seqs)
