"""The Pallas flash kernel compiled for a slice that is not here — *compiled, not run*
(`python -m lab.tools.attention_plan target=tpu:v5e:2x2 seq=4096`).

The kernel is the lab's dispatch's `pallas` for the target (pallas_tpu through Mosaic with
libtpu; on an H100/H200 pallas_mgpu through Mosaic GPU, elsewhere pallas_gpu through Triton,
with the CUDA plugin; `impl=` names one), run per device under `shard_map`
(batch over one mesh axis, heads over the other) as inside the sharded training step; forward
and forward + backward are compiled. On a GPU target every kernel's registers, spill bytes,
shared memory and blocks per SM come back from the compiler. For each the plan prints the
per-device memory from
`memory_analysis()` against the chip's HBM, the compiled FLOPs per device beside the analytic
count (`lab.measure.cost.attention_flops`: XLA's cost analysis cannot see inside the Mosaic
call and counts ~0 for it), the time per call (the compiler's estimate, floored by the
roofline of the analytic FLOPs and the compiled bytes at the spec sheet's peaks, since that
estimate misses the kernel's FLOPs too), and the TFLOP/s and share of peak it implies.
Records go to results/.
"""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lab import devices as devices_lib
from lab import plans
from lab.errors import ConfigError
from lab.measure import cost, specs, toolchain
from lab.measure import records as rec
from lab.measure.attention import PlanPoint
from lab.measure.memory import compiled_memory
from lab.names import DATA, MODEL
from lab.resolve import Platform, target_note

SPEC = P(DATA, None, MODEL, None)  # batch over data, heads over model


def _sharded(causal: bool, impl: str):
    """The target's Pallas kernel through the lab's dispatch, as the model calls it: under
    the target's mesh `pallas` is its platform's kernel, run per shard under shard_map."""
    from lab.kernels.attention import attention

    return functools.partial(attention, causal=causal, impl=impl, shard_spec=SPEC)


def _programs(attn):
    def fwd_bwd(q, k, v):
        out, vjp = jax.vjp(attn, q, k, v)
        return (out, *vjp(out))

    return {"fwd": attn, "fwd+bwd": fwd_bwd}


def mesh_for(devices, data: int):
    """A (data, model) mesh of the target's devices; data=0: 2 where the devices split in two,
    else 1 (a one-GPU target)."""
    if data == 0:
        data = 2 if len(devices) % 2 == 0 else 1
    if len(devices) % data:
        raise ConfigError(f"data={data} does not divide the target's {len(devices)} devices")
    return jax.sharding.Mesh(np.array(devices).reshape(data, -1), (DATA, MODEL))


def plan(
    target: str, *, batch, heads, kv_heads, seq, head_dim, dtype, causal, data, impl="pallas"
) -> list[PlanPoint]:
    """One point per mode: the compiler's figures for the kernel on `target` (on a GPU target,
    every kernel's registers, spills and shared memory too)."""
    plans.prepare_host(target)
    devices = plans.topology_devices(target)
    mesh = mesh_for(devices, data)
    n_model = mesh.shape[MODEL]
    if batch % mesh.shape[DATA] or kv_heads % n_model or heads % kv_heads:
        raise ConfigError(
            f"batch={batch} heads={heads} kv_heads={kv_heads} on mesh data={mesh.shape[DATA]} "
            f"x model={n_model}: batch must split over data, kv heads over model, and heads "
            "must be a multiple of kv heads"
        )
    sh = NamedSharding(mesh, SPEC)
    q = jax.ShapeDtypeStruct((batch, seq, heads, head_dim), jnp.dtype(dtype), sharding=sh)
    kv = jax.ShapeDtypeStruct((batch, seq, kv_heads, head_dim), jnp.dtype(dtype), sharding=sh)
    kind = devices[0].device_kind
    spec, peak = specs.lookup(kind), specs.peak_flops(kind, dtype)
    chosen, note = _chosen(impl, q, kv, causal, mesh)
    target_platform = Platform.of(devices_lib.describe_target(devices), devices, target=target)
    target_line = target_note(target_platform, impl, chosen, q, kv, causal=causal)
    note = "; ".join(n for n in (target_line, note) if n) or None
    tc = toolchain.probe() if plans.gpu_kind(devices) else None
    rows = []
    for mode, fn in _programs(_sharded(causal, impl)).items():
        t0 = time.perf_counter()

        def lower(fn=fn):
            with jax.sharding.set_mesh(mesh):
                return jax.jit(fn).lower(q, kv, kv)

        try:
            compiled, kernels = plans.compile_plan(lower, devices)
        except ValueError as e:  # the dispatch's one-line refusal (shape, dtype, head_dim)
            raise ConfigError(str(e)) from None
        except Exception as e:  # noqa: BLE001 — compilers' refusals (tiles, VMEM, smem) vary
            first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"{mode}: the compiler refused the kernel for {target}: {first}"
            ) from None
        analytic = cost.attention_flops(batch, heads, seq, seq, head_dim, causal=causal)
        analytic *= 1.0 if mode == "fwd" else 3.5  # backward = 2.5x forward (the convention)
        per_device = analytic / len(devices)
        c = cost.compiled_cost(compiled) or {}
        est, source = plans.step_seconds(compiled, per_device, spec, peak)
        rows.append(
            PlanPoint(
                mode=mode,
                seq=seq,
                head_dim=head_dim,
                device_kind=kind,
                devices=len(devices),
                compile_s=time.perf_counter() - t0,
                memory=compiled_memory(compiled),
                hbm_bytes=spec.memory_bytes if spec else None,
                compiled_flops=c.get("flops"),
                compiled_flops_note=cost.lower_bound_note(c),  # a loop of unknown trips
                analytic_flops_per_device=per_device,
                estimated_s=est,
                estimate_source=source,
                peak_flops=peak,
                impl=chosen,
                attention_note=note,
                kernels=tuple(kernels),
                toolchain=tc,
            )
        )
    return rows


def _chosen(impl: str, q, kv, causal: bool, mesh) -> tuple[str, str | None]:
    """(the kernel the dispatch compiles for the target, why it passed over the one it
    prefers there or None); a kernel it refuses is the dispatch's one line (ConfigError).
    `plan` adds where the target would run cuDNN but this host compiles another kernel."""
    from lab.kernels.attention import choose_noted

    try:
        with jax.sharding.set_mesh(mesh):  # the target's platform and device kind decide
            return choose_noted(impl, q, kv, kv, causal=causal)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def grid(target: str, *, seqs, head_dims, progress=None, **config) -> list[PlanPoint]:
    """`plan` for every sequence length × head dim, in that order. `progress(label)` is
    called before each point."""
    rows = []
    for seq in seqs:
        for head_dim in head_dims:
            if progress:
                progress(f"L={seq} K={head_dim}")
            rows += plan(target, seq=seq, head_dim=head_dim, **config)
    return rows


def to_records(rows: list[PlanPoint], config: dict) -> list[dict]:
    """Per point, its memory and time floor as records; `config` (the command's options)
    joins each point's mode, target kind, chosen kernel, seq and head_dim."""
    out = []
    for r in rows:
        c = dict(op="attention plan", mode=r.mode, target_kind=r.device_kind, **config)
        c.update(chosen_impl=r.impl, attention_note=r.attention_note)
        c.update({k: getattr(r, k) for k in ("seq", "head_dim") if getattr(r, k) is not None})
        label = "compiled, not run"
        if r.memory:
            out.append(
                rec.make_record(
                    "attention plan memory per device",
                    r.memory_bytes,
                    "B",
                    label=label,
                    **c,
                )
            )
        if r.estimated_s:
            out.append(
                rec.make_record(
                    "attention plan step time",
                    r.estimated_s,
                    "s",
                    label=label,
                    source=r.estimate_source,
                    **c,
                )
            )
    return out
