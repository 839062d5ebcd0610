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
estimate misses the kernel's FLOPs too; where the compiled cost is an upper bound — packed
documents, whose segment ids the kernels' estimates cannot see — the floor is that of the
analytic FLOPs and the bytes read and written once), and the TFLOP/s and share of peak it
implies. The time is a model of the compiled program, so it and its rates are *predicted*;
memory and FLOPs are *compiled, not run*. Records go to results/.
"""

import dataclasses
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
from lab.kernels.attention.common import Mask
from lab.measure import cost, specs, toolchain
from lab.measure import records as rec
from lab.measure.attention import PlanPoint
from lab.measure.memory import compiled_memory, device_capacity_bytes
from lab.names import DATA, MODEL
from lab.resolve import Platform, target_note

SPEC = P(DATA, None, MODEL, None)  # batch over data, heads over model


@dataclasses.dataclass(frozen=True)
class MaskChoice:
    """One mask a plan compiles: plain (causal or not), a sliding window of the last `window`
    keys, or packed documents of `doc_len` tokens each (segment ids restarting per document,
    causal within it)."""

    causal: bool
    window: int | None = None  # keys a query sees, itself included: Mask window (W - 1, 0)
    doc_len: int | None = None  # tokens per packed document

    @property
    def label(self) -> str:
        if self.window:
            return f"window {self.window:,}"
        if self.doc_len:
            return f"docs of {self.doc_len:,}"
        return "causal" if self.causal else "full"

    @property
    def key(self) -> str:
        """The command-line key that asked for it (attention_plan's window= / docs=)."""
        return f"window={self.window}" if self.window else f"docs={self.doc_len}"

    def kwargs(self, batch: int, seq: int) -> dict:
        """The dispatch's mask keywords (segment ids as NumPy constants [batch, seq])."""
        out = {}
        if self.window:
            out["window"] = (self.window - 1, 0)
        if self.doc_len:
            out["q_segment_ids"] = self.segment_ids(batch, seq)
        return out

    def segment_ids(self, batch: int, seq: int):
        ids = (np.arange(seq) // self.doc_len).astype(np.int32)
        return np.broadcast_to(ids, (batch, seq)).copy()

    def mask(self, batch: int, seq: int) -> Mask:
        """The common.Mask, its arrays NumPy (so a block map of it is exact)."""
        kw = self.kwargs(batch, seq)
        ids = kw.get("q_segment_ids")
        return Mask.make(
            causal=self.causal or self.doc_len is not None or self.window is not None,
            window=kw.get("window"),
            q_segment_ids=ids,
            kv_segment_ids=ids,
        )

    def pairs(self, seq: int) -> float | None:
        """Unmasked (query, key) pairs of one sequence and head (None: plain, whose FLOPs
        keep attention_flops' convention)."""
        if self.window:
            return seq * cost.visible_keys(seq, self.window)
        if self.doc_len:
            whole, rest = divmod(seq, self.doc_len)
            lens = [self.doc_len] * whole + ([rest] if rest else [])
            return sum(n * cost.visible_keys(n) for n in lens)
        return None


def _sharded(causal: bool, impl: str, mask: MaskChoice | None = None, batch: int = 0, seq=0):
    """The target's Pallas kernel through the lab's dispatch, as the model calls it: under
    the target's mesh `pallas` is its platform's kernel, run per shard under shard_map."""
    from lab.kernels.attention import attention

    extra = {} if mask is None else mask.kwargs(batch, seq)
    return functools.partial(attention, causal=causal, impl=impl, shard_spec=SPEC, **extra)


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


def _inputs(target: str, batch, heads, kv_heads, seq, head_dim, dtype, data):
    """(the target's devices, the plan's mesh, q and k/v as abstract sharded arrays), or the
    ConfigError of a shape the mesh cannot split."""
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
    return devices, mesh, q, kv


def check(target: str, *, seqs, head_dims, masks=None, **config) -> None:
    """Every point of a grid as `plan` checks it before compiling (the target, the mesh, the
    shapes, the kernel the dispatch takes for the input), so that a bad request is one line
    before the first compile, not after a progress line."""
    c = dict(config)
    impl, causal = c.pop("impl", "pallas"), c.pop("causal")
    masked = [m for m in masks or () if m.window is not None or m.doc_len is not None]
    if masked and not causal:  # the plain mask's row would be full, the others causal
        keys = " ".join(m.key for m in masked)
        what = "is a causal mask" if len(masked) == 1 else "are causal masks"
        raise ConfigError(
            f"{keys} {what} (a query sees only keys before it): plan with causal=true, else "
            "the saving set beside the full plain mask counts the causal one as its own"
        )
    for seq in seqs:
        for head_dim in head_dims:
            for mask in masks or [MaskChoice(causal)]:
                _, mesh, q, kv = _inputs(target, seq=seq, head_dim=head_dim, **c)
                features = frozenset(mask.mask(c["batch"], seq).features(seq, seq))
                is_causal = causal or mask.window is not None or mask.doc_len is not None
                _chosen(impl, q, kv, is_causal, mesh, features)


def plan(
    target: str,
    *,
    batch,
    heads,
    kv_heads,
    seq,
    head_dim,
    dtype,
    causal,
    data,
    impl="pallas",
    mask: MaskChoice | None = None,
) -> list[PlanPoint]:
    """One point per mode: the compiler's figures for the kernel on `target` (on a GPU target,
    every kernel's registers, spills and shared memory too) under `mask` (None: plain,
    `causal` or not)."""
    mask = mask or MaskChoice(causal)
    causal = causal or mask.window is not None or mask.doc_len is not None
    devices, mesh, q, kv = _inputs(target, batch, heads, kv_heads, seq, head_dim, dtype, data)
    n_model = mesh.shape[MODEL]
    kind = devices[0].device_kind
    spec, peak = specs.lookup(kind), specs.peak_flops(kind, dtype)
    full_mask = mask.mask(batch, seq)
    features = frozenset(full_mask.features(seq, seq))
    chosen, note = _chosen(impl, q, kv, causal, mesh, features)
    target_platform = Platform.of(devices_lib.describe_target(devices), devices, target=target)
    target_line = target_note(
        target_platform, impl, chosen, q, kv, causal=causal, features=features
    )
    note = "; ".join(n for n in (target_line, note) if n) or None
    tc = toolchain.probe() if plans.gpu_kind(devices) else None
    rows = []
    shard = (batch // mesh.shape[DATA], seq, heads // n_model, head_dim)
    kv_shard = (shard[0], seq, kv_heads // n_model, head_dim)
    attn = _sharded(causal, impl, mask, batch, seq)
    for mode, fn in _programs(attn).items():
        t0 = time.perf_counter()

        def lower(fn=fn):
            with jax.sharding.set_mesh(mesh):
                return jax.jit(fn).lower(q, kv, kv)

        try:
            compiled, kernels = plans.compile_plan(lower, devices)
        except ValueError as e:  # the dispatch's one-line refusal (shape, dtype, head_dim)
            raise ConfigError(str(e)) from None
        except MemoryError as e:  # this host's (a mask's table built here), not the compiler's
            raise ConfigError(
                f"{mode}: this host lacks the memory to build the plan for seq={seq:,} ({e})"
            ) from None
        except Exception as e:  # noqa: BLE001 — compilers' refusals (tiles, VMEM, smem) vary
            first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"{mode}: the compiler refused the kernel for {target}: {first}"
            ) from None
        pairs = mask.pairs(seq)
        if pairs is None:
            analytic = cost.attention_flops(batch, heads, seq, seq, head_dim, causal=causal)
        else:  # only the unmasked pairs: Q·Kᵀ and P·V, 2·K FLOPs each per pair
            analytic = 4.0 * batch * heads * head_dim * pairs
        analytic *= 1.0 if mode == "fwd" else 3.5  # backward = 2.5x forward (the convention)
        per_device = analytic / len(devices)
        c = cost.compiled_cost(compiled) or {}
        with jax.sharding.set_mesh(mesh):  # the kernels' tuned tiles are the target's
            tiles = _kernel_flops(chosen, shard, kv_shard, dtype, full_mask, mode, mesh)
        # segment ids the kernels' cost estimates cannot see: the compiled cost overstates
        upper = tiles is not None and tiles[0] < tiles[1]
        e = plans.step_estimate(
            compiled, per_device, spec, peak, cost_is_upper=upper, device_kind=kind
        )
        rows.append(
            PlanPoint(
                mode=mode,
                seq=seq,
                head_dim=head_dim,
                device_kind=kind,
                devices=len(devices),
                compile_s=time.perf_counter() - t0,
                memory=compiled_memory(compiled),
                hbm_bytes=device_capacity_bytes(devices[0])
                or (spec.memory_bytes if spec else None),
                compiled_flops=c.get("flops"),
                compiled_flops_note=cost.lower_bound_note(c),  # a loop of unknown trips
                mask=mask.label,
                kernel_flops=None if tiles is None else tiles[0],
                kernel_flops_static=None if tiles is None else tiles[1],
                analytic_flops_per_device=per_device,
                estimated_s=e.seconds,
                estimate_source=e.source,
                peak_flops=peak,
                impl=chosen,
                attention_note=note,
                kernels=tuple(kernels),
                toolchain=tc,
                estimate_error=e.error,
                estimate_over_floor=e.over_floor,
            )
        )
    return rows


def _kernel_flops(chosen: str, shard, kv_shard, dtype, mask: Mask, mode: str, mesh):
    """(FLOPs per device of the tiles the kernels visit under `mask`, counted from its
    block map with the segment ids known; the same count from the mask's static part only,
    what the pallas_calls' cost estimates carry), or None for a kernel that states none."""
    from lab.kernels.attention import pallas_gpu, pallas_mgpu, pallas_tpu

    module = {"pallas_tpu": pallas_tpu, "pallas_gpu": pallas_gpu, "pallas_mgpu": pallas_mgpu}
    if chosen not in module:
        return None
    B = shard[0]
    per_device = Mask(
        *(None if x is None else x[:B] for x in (mask.q_segment_ids, mask.kv_segment_ids)),
        causal=mask.causal,
        window=mask.window,
    )
    static = Mask.make(causal=mask.causal, window=mask.window)
    out = []
    for m in (per_device, static):
        c = module[chosen].kernel_cost(
            shard, kv_shard, shard[-1], dtype, mask=m, backward=mode != "fwd"
        )
        out.append(c.flops)
    return tuple(out)


def _chosen(impl: str, q, kv, causal: bool, mesh, features=frozenset()):
    """(the kernel the dispatch compiles for the target, why it passed over the one it
    prefers there or None); a kernel it refuses is the dispatch's one line (ConfigError).
    `plan` adds where the target would run cuDNN but this host compiles another kernel."""
    from lab.kernels.attention import choose_noted

    try:
        with jax.sharding.set_mesh(mesh):  # the target's platform and device kind decide
            return choose_noted(impl, q, kv, kv, causal=causal, features=features)
    except ValueError as e:
        text = str(e)
        if "has no compiled kernel on backend" in text:  # the dispatch lists every impl; a
            # plan compiles Pallas kernels only: the ones the target's compiler takes
            backend = "tpu" if "backend 'tpu'" in text else "gpu"
            takes = "pallas, pallas_tpu" if backend == "tpu" else "pallas, pallas_gpu, pallas_mgpu"
            head, _, listed = text.partition(": choose one of")
            why = listed[listed.find(" (") :] if " (" in listed else ""
            if "needs a Hopper GPU" in why:  # the one reason that holds for a plan's target
                takes = "pallas, pallas_gpu"
            else:  # the others are about running here (interpret=True, this JAX's interpreter)
                why = ""
            text = f"{head}: choose one of {takes}{why}"
        raise ConfigError(text) from None


def masks_of(causal: bool, windows=(), doc_lens=()) -> list[MaskChoice]:
    """The plain mask (`causal` or not), then one per sliding window and per packed document
    length: the masks a plan compiles side by side."""
    return [
        MaskChoice(causal),
        *(MaskChoice(True, window=w) for w in windows),
        *(MaskChoice(True, doc_len=d) for d in doc_lens),
    ]


def grid(target: str, *, seqs, head_dims, masks=None, progress=None, **config) -> list[PlanPoint]:
    """`plan` for every sequence length × head dim × mask (default: the plain one), in that
    order. `progress(label)` is called before each point."""
    rows = []
    for seq in seqs:
        for head_dim in head_dims:
            for mask in masks or [None]:
                if progress:
                    progress(f"L={seq} K={head_dim}" + (f" {mask.label}" if mask else ""))
                rows += plan(target, seq=seq, head_dim=head_dim, mask=mask, **config)
    return rows


def to_records(rows: list[PlanPoint], config: dict) -> list[dict]:
    """Per point, as records: memory and FLOPs per device (compiled, not run; the FLOPs
    derived where they are the block map's count, `PlanPoint.flops_source`), on a GPU target
    each kernel's registers per thread with its spills, shared memory, occupancy and launches
    in the config (compiled, not run; the compiler's toolchain beside them), the analytic
    FLOPs (derived from the shape), and the time per call with the TFLOP/s and share of peak
    it implies (predicted: a model of the compiled program; where the time is a floor, it is
    marked a lower bound and the rates upper bounds). `config` (the command's options) joins
    each point's mode, target kind, chosen kernel, seq and head_dim."""
    out = []
    for r in rows:
        c = dict(op="attention plan", mode=r.mode, target_kind=r.device_kind, **config)
        c.update(chosen_impl=r.impl, attention_note=r.attention_note)
        c.update({k: getattr(r, k) for k in ("seq", "head_dim") if getattr(r, k) is not None})
        c.update(mask=r.mask, flops_source=r.flops_source)
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
        if r.flops is not None:  # the block map's count is the lab's arithmetic: derived
            how = "derived" if r.flops_derived else label
            out.append(
                rec.make_record("attention plan FLOPs per device", r.flops, "FLOP", label=how, **c)
            )
        tools = {"toolchain": r.toolchain.record()} if r.toolchain else {}
        for k in r.kernels:  # the GPU kernels' resources, as the plan's table shows them
            out.append(
                rec.make_record(
                    "attention plan kernel registers",
                    k.registers,
                    "registers",
                    label=label,
                    kernel=k.record(),
                    **tools,
                    **c,
                )
            )
        out.append(
            rec.make_record(
                "attention plan analytic FLOPs per device",
                r.analytic_flops_per_device,
                "FLOP",
                label="derived",
                **c,
            )
        )
        if not r.estimated_s:
            continue
        how = dict(c, source=r.estimate_source)
        if r.estimate_error:  # what is known of the time's error (a prediction states it)
            how["model_error"] = r.estimate_error
        floor = r.estimate_is_a_floor
        figures = [("attention plan step time", r.estimated_s, "s", "lower")]
        if r.tflops:
            figures.append(("attention plan TFLOP/s", r.tflops * 1e12, "FLOP/s", "upper"))
        if r.peak_share:
            figures.append(("attention plan share of peak", r.peak_share, "fraction", "upper"))
        for what, value, unit, bound in figures:
            extra = {"bound": bound} if floor else {}
            out.append(rec.make_record(what, value, unit, label="predicted", **how, **extra))
    return out
