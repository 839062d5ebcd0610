"""`python -m lab.kernels.attention.plan --target tpu:v5e:2x2 [--seq 4096 ...]`: the Pallas TPU
flash kernel compiled for a TPU slice that is not here — *compiled, not run*.

The kernel runs per device under `shard_map` (batch over one mesh axis, heads over the
other), as it does inside the sharded training step; forward and forward + backward are
compiled through Mosaic with libtpu. For each the plan prints the per-device memory from
`memory_analysis()` against the chip's HBM, the compiled FLOPs per device beside the analytic
count (`lab.measure.cost.attention_flops`: XLA's cost analysis cannot see inside the Mosaic
call and counts ~0 for it), the time per call (the compiler's estimate, floored by the
roofline of the analytic FLOPs and the compiled bytes at the spec sheet's peaks, since that
estimate misses the kernel's FLOPs too), and the TFLOP/s and share of peak it implies.
Records go to results/.
"""

import argparse
import functools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lab import aot
from lab.config import ConfigError
from lab.measure import cost, specs
from lab.measure import records as rec
from lab.measure.memory import compiled_memory

SPEC = P("data", None, "model", None)  # batch over data, heads over model


def _sharded(mesh, causal: bool):
    from lab.kernels.attention import pallas_tpu

    kernel = functools.partial(pallas_tpu.flash_attention_tpu, causal=causal)
    # check_vma=False: pallas_call's out_shape carries no varying-mesh-axes type; each output
    # shard depends only on its own inputs.
    return jax.shard_map(kernel, mesh=mesh, in_specs=(SPEC,) * 3, out_specs=SPEC, check_vma=False)


def _programs(attn):
    def fwd_bwd(q, k, v):
        out, vjp = jax.vjp(attn, q, k, v)
        return (out, *vjp(out))

    return {"fwd": attn, "fwd+bwd": fwd_bwd}


def mesh_for(devices, data: int):
    if len(devices) % data:
        raise ConfigError(f"--data {data} does not divide the target's {len(devices)} devices")
    return jax.sharding.Mesh(np.array(devices).reshape(data, -1), ("data", "model"))


def plan(target: str, *, batch, heads, kv_heads, seq, head_dim, dtype, causal, data) -> list:
    """One row per mode: the compiler's figures for the kernel on `target`."""
    aot.prepare_host(target)
    devices = aot.topology_devices(target)
    mesh = mesh_for(devices, data)
    n_model = mesh.shape["model"]
    if batch % mesh.shape["data"] or kv_heads % n_model or heads % kv_heads:
        raise ConfigError(
            f"batch={batch} heads={heads} kv_heads={kv_heads} on mesh data={mesh.shape['data']} "
            f"x model={n_model}: batch must split over data, kv heads over model, and heads "
            "must be a multiple of kv heads"
        )
    sh = NamedSharding(mesh, SPEC)
    q = jax.ShapeDtypeStruct((batch, seq, heads, head_dim), jnp.dtype(dtype), sharding=sh)
    kv = jax.ShapeDtypeStruct((batch, seq, kv_heads, head_dim), jnp.dtype(dtype), sharding=sh)
    kind = devices[0].device_kind
    spec, peak = specs.lookup(kind), specs.peak_flops(kind, dtype)
    rows = []
    for mode, fn in _programs(_sharded(mesh, causal)).items():
        t0 = time.perf_counter()
        try:
            compiled = jax.jit(fn).lower(q, kv, kv).compile()
        except Exception as e:  # noqa: BLE001 — Mosaic's refusals (tiles, VMEM) come in many types
            first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
            raise ConfigError(f"{mode}: Mosaic refused the kernel for {target}: {first}") from None
        analytic = cost.attention_flops(batch, heads, seq, seq, head_dim, causal=causal)
        analytic *= 1.0 if mode == "fwd" else 3.5  # backward = 2.5x forward (the convention)
        per_device = analytic / len(devices)
        c = cost.compiled_cost(compiled) or {}
        est, source = aot.step_seconds(compiled, per_device, spec, peak)
        rows.append(
            dict(
                mode=mode,
                device_kind=kind,
                devices=len(devices),
                compile_s=time.perf_counter() - t0,
                memory=compiled_memory(compiled),
                hbm_bytes=spec.memory_bytes if spec else None,
                compiled_flops=c.get("flops"),
                analytic_flops_per_device=per_device,
                estimated_s=est,
                estimate_source=source,
                tflops=per_device / est / 1e12 if est else None,
                peak_share=per_device / est / peak if est and peak else None,
            )
        )
    return rows


def to_records(rows: list[dict], config: dict) -> list[dict]:
    out = []
    for r in rows:
        c = dict(op="attention plan", mode=r["mode"], target_kind=r["device_kind"], **config)
        label = "compiled, not run"
        if r["memory"]:
            out.append(
                rec.make_record(
                    "attention plan memory per device",
                    r["memory"]["total_bytes"],
                    "B",
                    label=label,
                    **c,
                )
            )
        if r["estimated_s"]:
            out.append(
                rec.make_record(
                    "attention plan step time",
                    r["estimated_s"],
                    "s",
                    label=label,
                    source=r["estimate_source"],
                    **c,
                )
            )
    return out


def table(rows: list[dict], title: str):
    from rich.table import Table

    t = Table(title=title)
    cols = (
        "mode",
        "memory / device",
        "of HBM",
        "FLOPs / device (compiled | analytic)",
        "est. time",
        "TFLOP/s",
        "of peak",
        "estimate",
    )
    for col in cols:
        t.add_column(col, justify="right")
    for r in rows:
        need = r["memory"]["total_bytes"] if r["memory"] else None
        hbm = f"{need / r['hbm_bytes']:.1%}" if need and r["hbm_bytes"] else "–"
        compiled_g = max(r["compiled_flops"] or 0.0, 0.0) / 1e9  # XLA can report -0
        flops = f"{compiled_g:,.1f} | {r['analytic_flops_per_device'] / 1e9:,.1f} G"
        t.add_row(
            r["mode"],
            f"{need / 2**20:,.1f} MiB" if need else "–",
            hbm,
            flops,
            f"{r['estimated_s'] * 1e3:,.3f} ms" if r["estimated_s"] else "–",
            f"{r['tflops']:.1f}" if r["tflops"] else "–",
            f"{r['peak_share']:.0%}" if r["peak_share"] else "–",
            r["estimate_source"],
        )
    return t


def _parser():
    p = argparse.ArgumentParser(prog="python -m lab.kernels.attention.plan", description=__doc__)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--target", default="tpu:v5e:2x2", help=f"e.g. {aot.target_help()}")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--causal", choices=("yes", "no"), default="yes")
    p.add_argument("--data", type=int, default=2, help="mesh axis the batch splits over")
    p.add_argument("--out", default="results")
    return p


def main(argv=None) -> int:
    from rich.console import Console

    args = _parser().parse_args(argv)
    config = dict(
        batch=args.batch,
        heads=args.heads,
        kv_heads=args.kv_heads,
        seq=args.seq,
        head_dim=args.head_dim,
        dtype=args.dtype,
        causal=args.causal == "yes",
        data=args.data,
    )
    try:
        if min(v for k, v in config.items() if isinstance(v, int) and k != "causal") < 1:
            raise ConfigError(f"sizes must be positive: {config}")
        rows = plan(args.target, **config)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    console = Console(width=150)
    title = (
        f"flash attention plan · {args.target} ({rows[0]['device_kind']} × {rows[0]['devices']})"
        f" · B={args.batch} H={args.heads}/{args.kv_heads} L=S={args.seq} D={args.head_dim} "
        f"{args.dtype} causal={args.causal} · compiled, not run"
    )
    console.print(table(rows, title))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = rec.write_records(
        Path(args.out) / f"attention-plan-{stamp}.jsonl",
        to_records(rows, {"target": args.target, **config}),
    )
    console.print(f"records → {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
