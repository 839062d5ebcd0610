"""The device mesh and the logical→mesh rules that place weights and activations on it.

One physical mesh always has the axes (data, stage, fsdp, model); axes the user did not name
have size 1, so every rule table can name every axis. Weights and activations carry *logical*
names (batch, seq, embed, heads, kv, mlp, vocab, layers); one short table per strategy says
which mesh axes each logical name is split over.
"""

import difflib
import math

import numpy as np

from lab.errors import ConfigError
from lab.names import (
    BATCH,
    DATA,
    EMBED,
    FSDP,
    HEADS,
    LAYERS,
    MESH_AXES,
    MLP,
    MODEL,
    SEQ,
    STAGE,
    VOCAB,
)

AXES = MESH_AXES
POSITIONAL = {1: (DATA,), 2: (DATA, MODEL), 3: (DATA, FSDP, MODEL)}

# Logical axis → mesh axes, one table per strategy. Names not listed are replicated.
RULES: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    # Data parallel: every device holds all weights and a slice of the batch.
    "dp": ((BATCH, (DATA, FSDP, MODEL)),),
    # Fully sharded data parallel (ZeRO-3): weights split along embed, gathered per use.
    "fsdp": ((BATCH, (DATA, FSDP, MODEL)), (EMBED, (FSDP, MODEL))),
    # Tensor parallel (Megatron): attention heads and MLP columns/rows split over `model`.
    "tp": ((BATCH, (DATA, FSDP)), (HEADS, (MODEL,)), (MLP, (MODEL,)), (VOCAB, (MODEL,))),
    # Both: embed over fsdp, heads/mlp/vocab over model, batch over data and fsdp.
    "fsdp+tp": (
        (BATCH, (DATA, FSDP)),
        (EMBED, (FSDP,)),
        (HEADS, (MODEL,)),
        (MLP, (MODEL,)),
        (VOCAB, (MODEL,)),
    ),
    # Context parallel: the sequence split over `model` (attention=ring passes K/V around it).
    "cp": ((BATCH, (DATA, FSDP)), (SEQ, (MODEL,))),
    # Pipeline parallel (lab/kernels/pipeline.py): the stacked layers split over `stage`, each
    # stage a contiguous block of them. Outside the pipeline (embedding, head, loss) the batch
    # is split over the stages too, and the embedding and head tables along the vocabulary
    # (gathered per use); inside a stage `stage` and `data` are manual (lab/model.py).
    "pp": ((BATCH, (STAGE, DATA, FSDP, MODEL)), (LAYERS, (STAGE,)), (VOCAB, (STAGE,))),
    # Pipeline + ZeRO-3 inside each stage: the stage's weights split along embed over fsdp.
    "pp+fsdp": (
        (BATCH, (STAGE, DATA, FSDP)),
        (LAYERS, (STAGE,)),
        (EMBED, (FSDP,)),
        (VOCAB, (STAGE,)),
    ),
    # Pipeline + tensor parallel (Megatron) inside each stage.
    "pp+tp": (
        (BATCH, (STAGE, DATA, FSDP)),
        (LAYERS, (STAGE,)),
        (HEADS, (MODEL,)),
        (MLP, (MODEL,)),
        (VOCAB, (MODEL,)),
    ),
}


# The mesh axes each strategy exists for: on a mesh where all of them have size 1 the strategy
# splits nothing (strategy=fsdp on mesh=data:8 is data parallelism), which lab.resolve refuses.
STRATEGY_AXES = {
    "fsdp": (FSDP, MODEL),
    "tp": (MODEL,),
    "fsdp+tp": (FSDP, MODEL),
    "cp": (MODEL,),
    "pp": (STAGE,),
    "pp+fsdp": (STAGE,),
    "pp+tp": (STAGE,),
}


def split_words(strategy: str, sizes: dict[str, int]) -> str:
    """What `strategy` splits over the axes of this mesh that have more than one device, in
    words: 'batch over data×model, embed over model' for fsdp on data=4 × model=2 (the axis
    that carries the weights' split is then `model`); '' where nothing is split."""
    parts = []
    for logical, axes in RULES.get(strategy, ()):
        used = [a for a in axes if sizes.get(a, 1) > 1]
        if used:
            parts.append(f"{logical} over {'×'.join(used)}")
    return ", ".join(parts)


def strategy_mesh(spec: str, strategy: str) -> str:
    """A bare device count follows an explicit strategy's axis: mesh=8 strategy=fsdp is
    fsdp:8 (not data:8, on which fsdp would split nothing), tp and cp model:8, pp stage:8.
    Any other spec is the user's word and is kept."""
    text = str(spec).strip()
    axes = STRATEGY_AXES.get(strategy)
    if not axes or ":" in text or "x" in text.lower() or strategy == "fsdp+tp":
        return spec
    return f"{axes[0]}:{text}"


class MeshSpecError(ConfigError):
    """A mesh that cannot be built: one line for the user (exit 2, like any config error)."""


def parse_mesh_spec(spec: str) -> dict[str, int]:
    """'4x2' → {data: 4, model: 2}; 'data:2,fsdp:2,model:2' names axes; -1 is filled later."""
    spec = str(spec).strip()
    if ":" in spec:
        pairs = [p.split(":", 1) for p in spec.split(",")]
        for p in pairs:
            if len(p) != 2:  # data:2,model or data:2, (an axis without its size)
                what = f"axis {p[0].strip()!r} has no size" if p[0].strip() else "an empty axis"
                raise MeshSpecError(f"{what}: name each axis with its size, e.g. data:2,model:4")
        names = [n.strip() for n, _ in pairs]
        sizes = [s for _, s in pairs]
    else:
        sizes = spec.lower().split("x")
        if len(sizes) not in POSITIONAL:
            raise MeshSpecError("give 1 to 3 sizes (data[xmodel] or dataxfsdpxmodel)")
        names = list(POSITIONAL[len(sizes)])
    out = {}
    for name, size in zip(names, sizes, strict=True):
        if name not in AXES:
            close = difflib.get_close_matches(name.lower(), AXES, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise MeshSpecError(f"unknown axis {name!r}{hint}; axes are {', '.join(AXES)}")
        if name in out:
            raise MeshSpecError(f"axis {name!r} given twice")
        try:
            n = int(size)
        except ValueError:
            raise MeshSpecError(f"size {size!r} of axis {name!r} is not an integer") from None
        if n == 0 or n < -1:
            raise MeshSpecError(f"axis {name!r} has size {n}; sizes are >= 1 or -1 (fill)")
        out[name] = n
    if sum(v == -1 for v in out.values()) > 1:
        raise MeshSpecError("at most one axis may be -1")
    return out


SIMULATED_DEVICES = 8  # what an axis of -1 fills on CPU when cpu_devices is not given


def cpu_devices_for(spec: str) -> int:
    """Simulated CPU devices for the spec (cpu_devices=0): the product of its sizes, and where
    an axis is -1 ("fill the devices") as many of that product as fit SIMULATED_DEVICES, at
    least one: data:2,fsdp:-1 gives 8 (fsdp 4), not 2 with fsdp left at 1."""
    sizes = parse_mesh_spec(spec).values()
    fixed = math.prod(max(v, 1) for v in sizes)
    if -1 in sizes:
        return fixed * max(1, SIMULATED_DEVICES // fixed)
    return fixed


def resolve_shape(spec: str, n_devices: int, target: str = "") -> dict[str, int]:
    """Full (data, stage, fsdp, model) sizes for `n_devices`, -1 filled; errors name the
    numbers, and the `target` (tpu:v5e:2x2, gpu:h100:8) whose devices they are, if any: a
    target's devices are not present, they are what the plan is compiled for."""
    have = (
        f"the target {target} has {n_devices}"
        if target
        else f"only {n_devices} {'is' if n_devices == 1 else 'are'} present"
    )
    total = f"the target's {n_devices}" if target else f"the {n_devices} present"
    sizes = {a: 1 for a in AXES} | parse_mesh_spec(spec)
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if -1 in sizes.values():
        if n_devices % fixed:
            raise MeshSpecError(f"mesh={spec}: {fixed} does not divide the {n_devices} devices")
        sizes = {a: (n_devices // fixed if v == -1 else v) for a, v in sizes.items()}
    elif fixed > n_devices:
        raise MeshSpecError(f"mesh={spec} needs {fixed} devices but {have}")
    elif n_devices % fixed:
        raise MeshSpecError(f"mesh={spec} uses {fixed} devices, which does not divide {total}")
    return sizes


def make_mesh(spec: str, devices=None):
    """A jax Mesh with axes (data, stage, fsdp, model) over `devices` (default: all devices)."""
    import jax

    devices = jax.devices() if devices is None else devices
    sizes = resolve_shape(spec, len(devices))
    shape = tuple(sizes[a] for a in AXES)
    devices = list(devices)[: math.prod(shape)]
    try:
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices=devices)
    except (ValueError, AssertionError, NotImplementedError):
        # mesh_utils places axes along the physical interconnect but refuses some device sets
        # (a subset of a slice, simulated CPU devices, AOT topologies): then take them in order
        grid = np.asarray(devices).reshape(shape)
    return jax.sharding.Mesh(grid, AXES)


def auto_strategy(sizes: dict[str, int]) -> str:
    """Pick the rules that use every axis the user asked for."""
    fsdp, model = sizes.get(FSDP, 1) > 1, sizes.get(MODEL, 1) > 1
    if sizes.get(STAGE, 1) > 1:
        return "pp+tp" if model else ("pp+fsdp" if fsdp else "pp")
    return {(True, True): "fsdp+tp", (False, True): "tp", (True, False): "fsdp"}.get(
        (fsdp, model), "dp"
    )


def rules_for(strategy: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    if strategy not in RULES:
        raise MeshSpecError(f"strategy={strategy!r}: expected one of {', '.join(RULES)}")
    return RULES[strategy]


def axis_size(mesh, mesh_axes) -> int:
    """Number of devices a dimension is split over (mesh_axes: None, a name, or a tuple)."""
    if mesh_axes is None:
        return 1
    names = (mesh_axes,) if isinstance(mesh_axes, str) else mesh_axes
    return math.prod(mesh.shape[n] for n in names)


def check_divisible(name: str, shape: tuple[int, ...], spec, mesh) -> None:
    """Every dimension must split evenly over its mesh axes; say which tensor and axis if not."""
    padded = tuple(spec)[: len(shape)] + (None,) * (len(shape) - len(tuple(spec)))
    for dim, (size, axes) in enumerate(zip(shape, padded, strict=True)):
        n = axis_size(mesh, axes)
        if size % n:
            raise MeshSpecError(
                f"{name}: dimension {dim} (size {size}) does not divide mesh axis "
                f"{axes} (size {n}); change the mesh, the strategy or the model size"
            )
