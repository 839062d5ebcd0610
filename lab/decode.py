"""Serving the lab's transformer: prefill and decode with a key/value cache, and sampling.

Pure functions over pytrees: the parameters, the cache (lab.model.KVCache: every layer's keys
and values [B, G, S, K], int8 with per-token scales or the compute dtype, and each sequence's
length) and the sampling key go in, the new cache and the tokens come out.

    prefill(params, prompts_BxP, prompt_lengths_B, cache)  → (next logits [B, V], cache)
        the prompts (right-padded to P) through the model at once, their keys and values
        written to slots 0 … P-1, each sequence's length set to its own prompt length; the
        logits of each prompt's last real token
    step(params, tokens_B, cache) → (logits [B, V], cache)
        one token per sequence at its own length, attended against its cache
        (lab.kernels.attention.decode_attention), every length + 1

`make_decoder` jits them for a mesh with shardings like the trainer's: the batch over the data
axes, kv heads over `model`, the cache donated so each step updates it in place.
"""

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lab import quant
from lab.config import ModelConfig
from lab.errors import ConfigError
from lab.kernels import cpu_gemv
from lab.kernels.attention import choose_decode, decode_kernel, decode_kernel_noted
from lab.mesh import check_divisible
from lab.model import CACHE, KVCache, LayerKV, build, decode_impl
from lab.model import unstack_layers as _unstack
from lab.names import BATCH, LAYERS


def cache_shapes(m: ModelConfig, batch: int, max_len: int, *, int8: bool) -> KVCache:
    """The cache as ShapeDtypeStructs: every layer's [B, G, S, K] keys and values (int8 with
    [B, G, 1, S] float32 scales, or the compute dtype), stacked under scan_layers."""
    G, K = m.n_kv_heads, m.head_dim
    dtype = jnp.int8 if int8 else jnp.dtype(m.dtype)
    lead = (m.n_layers,) if m.scan_layers else ()
    kv = jax.ShapeDtypeStruct((*lead, batch, G, max_len, K), dtype)
    sc = jax.ShapeDtypeStruct((*lead, batch, G, 1, max_len), jnp.float32) if int8 else None
    layer = LayerKV(kv, kv, sc, sc)
    layers = layer if m.scan_layers else (layer,) * m.n_layers
    return KVCache(layers, jax.ShapeDtypeStruct((batch,), jnp.int32))


def _slots_axis(x) -> int:
    """Where the cache slots are: [.., S, K] for keys and values, [.., 1, S] for scales."""
    return -1 if x.shape[-2] == 1 else -2


def cache_bytes(cache: KVCache, lengths=None, windows=None) -> int:
    """Bytes a decode step reads from the cache: every layer's keys, values (and scales) up to
    each sequence's length (every slot when `lengths` is None); with `windows` (one per layer,
    None for a global one), a windowed layer's last `window` slots at most, as the kernels
    that stop at each length read them. A stacked cache (scan_layers) counts layer by layer."""
    layers = cache.layers if isinstance(cache.layers, tuple | list) else (cache.layers,)
    stacked = [x.shape[0] for x in jax.tree.leaves(layers[0]) if x.ndim == 5]
    n_layers = stacked[0] if stacked else len(layers)
    if windows is not None and len(windows) != n_layers:
        raise ValueError(f"{len(windows)} windows for a cache of {n_layers} layers")
    windows = [None] * n_layers if windows is None else list(windows)

    def slots_read(window, batch, slots) -> int:
        if lengths is None:
            return batch * slots
        return sum(min(int(n), window or int(n)) for n in lengths)

    total = 0.0
    for j, layer in enumerate(layers):
        for x in jax.tree.leaves(layer):
            batch, slots = x.shape[-4], x.shape[_slots_axis(x)]
            if x.ndim == 5:  # [layers, B, ...]: each layer with its own window
                per_slot = x.size * jnp.dtype(x.dtype).itemsize / (x.shape[0] * batch * slots)
                total += sum(per_slot * slots_read(w, batch, slots) for w in windows)
            else:
                per_slot = x.size * jnp.dtype(x.dtype).itemsize / (batch * slots)
                total += per_slot * slots_read(windows[j], batch, slots)
    return int(total)


def _cache_logical(cache: KVCache) -> KVCache:
    """Logical axes of every cache leaf: [layers?, batch, kv heads, slots, head_dim]; the
    slots and head_dim are never split (the decode kernel reads a sequence's cache whole)."""

    def axes(x):
        lead = (LAYERS,) if x.ndim == 5 else ()
        return lead + (CACHE if _slots_axis(x) == -2 else (*CACHE[:2], None, None))

    return KVCache(jax.tree.map(axes, cache.layers), (BATCH,))


def sample(logits_BxV, key, temperature: float):
    """Greedy (temperature 0) or a draw from softmax(logits / temperature)."""
    if temperature == 0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits_BxV / temperature).astype(jnp.int32)


def prefill(params, prompts_BxP, prompt_lengths_B, cache: KVCache, *, model):
    """(logits of each prompt's last real token [B, V], the cache holding the prompts)."""
    empty = cache.replace(lengths=jnp.zeros_like(cache.lengths))
    last_B = prompt_lengths_B - 1  # the head runs on these positions only
    logits_Bx1xV, cache = model.apply({"params": params}, prompts_BxP, empty, keep_B=last_B)
    return logits_Bx1xV[:, 0], cache.replace(lengths=prompt_lengths_B.astype(jnp.int32))


def cache_slots(cache: KVCache) -> int:
    """S: the slots each sequence's cache holds."""
    x = jax.tree.leaves(cache.layers)[0]
    return x.shape[_slots_axis(x)]


def step(params, tokens_B, cache: KVCache, *, model):
    """(logits [B, V] of the next token, the cache with this token written).

    A sequence whose cache is full gets NaN logits and its cache and length left untouched:
    writing past the last slot would otherwise overwrite it silently (dynamic_update_slice
    clamps)."""
    logits_Bx1xV, new = model.apply({"params": params}, tokens_B[:, None], cache)
    full_B = cache.lengths + 1 > cache_slots(cache)
    logits_BxV = jnp.where(full_B[:, None], jnp.nan, logits_Bx1xV[:, 0])
    return logits_BxV, new.replace(lengths=jnp.where(full_B, cache.lengths, cache.lengths + 1))


NO_TOKEN = -1  # what generate gives a sequence whose cache was full: no token was made


def generate(params, logits_BxV, cache: KVCache, key, *, steps: int, temperature: float, model):
    """`steps` tokens per sequence from the prefill's logits: (tokens [B, steps], cache). A
    sequence whose cache fills up gets NO_TOKEN from then on (its logits are NaN: a sample
    of them would be a made-up token 0)."""

    def one(carry, key):
        logits_BxV, cache = carry
        tokens_B = sample(logits_BxV, key, temperature)
        tokens_B = jnp.where(jnp.isnan(logits_BxV[:, 0]), NO_TOKEN, tokens_B)
        logits_BxV, cache = step(params, tokens_B, cache, model=model)
        return (logits_BxV, cache), tokens_B

    (_, cache), tokens_SxB = jax.lax.scan(one, (logits_BxV, cache), jax.random.split(key, steps))
    return tokens_SxB.T, cache


class _CheckedPrefill:
    """The jitted prefill, with the checks its traced body cannot make: prompts padded wider
    than the cache (XLA's own error names a gather's slice sizes), and, where the lengths are
    on the host, a length of 0 (the head would read the last pad) or past the padded width
    (NaN logits). `lower` is the jitted function's, for plans."""

    def __init__(self, jitted, max_len: int):
        self.jitted, self.max_len = jitted, max_len

    def __call__(self, params, prompts_BxP, prompt_lengths_B, cache):
        width = prompts_BxP.shape[1]
        if width > self.max_len:
            raise ConfigError(
                f"prompts padded to {width} tokens do not fit a cache of {self.max_len} "
                f"slots: pad them to at most {self.max_len} (or make the cache larger)"
            )
        if not isinstance(prompt_lengths_B, jax.Array):  # host values: no device round trip
            lengths = np.asarray(prompt_lengths_B)
            if lengths.size and (lengths.min() < 1 or lengths.max() > width):
                raise ConfigError(
                    f"prompt lengths {lengths.tolist()}: each must be 1 to the padded width {width}"
                )
        return self.jitted(params, prompts_BxP, prompt_lengths_B, cache)

    def lower(self, *args):
        return self.jitted.lower(*args)


@dataclasses.dataclass(frozen=True)
class Decoder:
    """prefill, step and generate for one model on one mesh, jitted with shardings."""

    model_cfg: ModelConfig
    mesh: Any
    rules: tuple
    batch: int
    max_len: int
    int8_cache: bool
    abstract_cache: KVCache
    cache_sharding: Any
    batch_sharding: NamedSharding
    prefill: Any
    step: Any
    generate: Any
    matmul: str = "xla"  # how the weights are multiplied (MATMULS), `auto` resolved

    def empty_cache(self) -> KVCache:
        """A zeroed cache on its shardings (lengths 0)."""
        make = jax.jit(
            lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.abstract_cache),
            out_shardings=self.cache_sharding,
        )
        with jax.set_mesh(self.mesh):
            return make()

    def filled_cache(self, lengths_B, seed: int = 0) -> KVCache:
        """A cache whose first lengths_B[b] slots of sequence b hold random entries, on its
        shardings: what a decode step reads after a prefill of those lengths. A step's work
        depends on the lengths, not on what the slots hold, so a benchmark of decode steps
        at a long context costs this cache's bytes instead of a prefill (at 100,000 tokens a
        prefill is minutes to hours on a CPU). Float entries ~ N(0, 1); int8 codes uniform in
        [-127, 127] with scales ~ U(0.5, 1.5)/127."""

        leaves, tree = jax.tree_util.tree_flatten_with_path(self.abstract_cache)
        names = tuple(getattr(path[-1], "name", "") for path, _ in leaves)
        avals = tuple((tuple(s.shape), jnp.dtype(s.dtype)) for _, s in leaves)
        shardings, sharding_tree = jax.tree_util.tree_flatten(self.cache_sharding)
        fill = _cache_filler(tree, names, avals, sharding_tree, tuple(shardings), seed)
        with jax.set_mesh(self.mesh):
            return fill(jnp.asarray(lengths_B))


@functools.lru_cache(maxsize=16)
def _cache_filler(tree, names, avals, sharding_tree, shardings, seed: int):
    """The jitted fill of `Decoder.filled_cache`, one per cache layout: every matmul variant
    and batch of a serving sweep fills a cache of the same layout, and a function jitted anew
    each time compiled again each time (3.6-3.9 s for model=tiny, most of lab.serve's wall)."""

    def leaf(key, name, shape, dtype):
        if name == "lengths":
            return jnp.zeros(shape, dtype)  # replaced below
        if dtype == jnp.int8:
            return jax.random.randint(key, shape, -127, 128, jnp.int32).astype(jnp.int8)
        if name.endswith("_scale"):
            return jax.random.uniform(key, shape, dtype, 0.5, 1.5) / 127
        return jax.random.normal(key, shape, dtype)

    def make(lengths_B):
        keys = jax.random.split(jax.random.key(seed), len(avals))
        filled = [leaf(k, n, *a) for k, n, a in zip(keys, names, avals, strict=True)]
        cache = jax.tree.unflatten(tree, filled)
        return cache.replace(lengths=lengths_B.astype(jnp.int32))

    out = jax.tree_util.tree_unflatten(sharding_tree, shardings)
    return jax.jit(make, out_shardings=out)


# How a decoder multiplies by its weights: XLA's dot (`xla`; int8 weights weight-only, their
# codes converted to the compute dtype), XLA's int8 × int8 → int32 dot for int8 weights
# (`w8a8`), or the native CPU kernel for decode's few rows (`native`, lab/kernels/cpu_gemv.py:
# every weight read once in its own dtype; prefill's many rows keep XLA's dot), threaded over
# the host's cores, or on the calling thread alone (`native1`: on a busy host a second thread
# that the OS has paused makes every call wait for it). `auto`: native on a one-device CPU
# mesh where the kernel builds, else xla. lab.serve measures them all and keeps the fastest.
MATMULS = ("auto", "xla", "w8a8", "native", "native1")


def resolve_matmul(matmul: str, mesh) -> str:
    """`auto` made concrete for this mesh; a name outside MATMULS is a ValueError."""
    if matmul not in MATMULS:
        raise ValueError(f"{matmul=}: choose one of {', '.join(MATMULS)}")
    if matmul != "auto":
        return matmul
    one_cpu = mesh.devices.size == 1 and mesh.devices.flat[0].platform == "cpu"
    return "native" if one_cpu and cpu_gemv.available() else "xla"


def matmuls(matmul: str, platform: str = "cpu") -> quant.Matmuls:
    """What lab.quant.matmul runs while a decoder's functions are traced on `platform`'s
    devices (on GPU a batch-1 product is padded to two rows: quant.Matmuls.min_rows)."""
    native = matmul in ("native", "native1")
    if native and not cpu_gemv.available():
        raise ConfigError(
            "matmul=native: the native CPU matmul kernel is not built here (no C++ compiler, "
            "a failed build, or LAB_CPU_GEMV=0): use matmul=xla"
        )
    return quant.Matmuls(
        int8_activations=matmul == "w8a8",
        native=functools.partial(cpu_gemv.model_matmul, threads=1 if matmul == "native1" else 0)
        if native
        else None,
        min_rows=2 if platform in ("gpu", "cuda", "rocm") else 1,
    )


def _with_rules(fn, rules, matmul: str = "xla", platform: str = "cpu"):
    @functools.wraps(fn)
    def wrapped(*args, **kw):
        with nn.logical_axis_rules(rules), quant.using(matmuls(matmul, platform)):
            return fn(*args, **kw)

    return wrapped


def make_decoder(
    model_cfg: ModelConfig,
    mesh,
    rules,
    param_shardings,
    *,
    batch: int,
    max_len: int,
    int8_cache: bool = False,
    steps: int = 1,
    temperature: float = 0.0,
    matmul: str = "auto",
) -> Decoder:
    """Jitted prefill / step / generate: the batch over the rules' batch axes, the cache
    sharded like the activations (kv heads over `model`) and donated to every call; the
    weights multiplied as `matmul` says (MATMULS). `batch` splits over the batch axes: a
    decoding config resolved with it (lab.resolve, purpose decode, `batches=`) says so."""
    matmul = resolve_matmul(matmul, mesh)
    matmuls(matmul)  # a kernel that is not built: one line now, not while tracing
    platform = mesh.devices.flat[0].platform
    if model_cfg.dtype == "auto":
        raise ValueError("make_decoder needs a resolved compute dtype (lab.resolve.resolve)")
    model = build(model_cfg)
    batch_axes = dict(rules).get(BATCH)
    n_batch = math.prod(mesh.shape[a] for a in (batch_axes or ()))
    assert batch % n_batch == 0, (batch, batch_axes, n_batch)  # lab.resolve's decode rule
    abstract = cache_shapes(model_cfg, batch, max_len, int8=int8_cache)
    logical = _cache_logical(abstract)
    is_names = lambda x: isinstance(x, tuple) and all(isinstance(n, str | None) for n in x)  # noqa: E731
    with nn.logical_axis_rules(rules):
        specs = jax.tree.map(nn.logical_to_mesh_axes, logical, is_leaf=is_names)
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    for leaf, spec in zip(
        jax.tree.leaves(abstract), jax.tree.leaves(specs, is_leaf=is_spec), strict=True
    ):
        check_divisible("the cache", leaf.shape, spec, mesh)
    cache_sh = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=is_spec)
    batch_sh = NamedSharding(mesh, P(batch_axes))
    tokens_sh = NamedSharding(mesh, P(batch_axes, None))
    replicated = NamedSharding(mesh, P())
    logits_sh = NamedSharding(mesh, P(batch_axes, None))
    prefill_jit = jax.jit(
        _with_rules(functools.partial(prefill, model=model), rules, matmul, platform),
        in_shardings=(param_shardings, tokens_sh, batch_sh, cache_sh),
        out_shardings=(logits_sh, cache_sh),
        donate_argnums=3,
    )
    step_jit = jax.jit(
        _with_rules(functools.partial(step, model=model), rules, matmul, platform),
        in_shardings=(param_shardings, batch_sh, cache_sh),
        out_shardings=(logits_sh, cache_sh),
        donate_argnums=2,
    )
    gen_jit = jax.jit(
        _with_rules(
            functools.partial(generate, steps=steps, temperature=temperature, model=model),
            rules,
            matmul,
            platform,
        ),
        in_shardings=(param_shardings, logits_sh, cache_sh, replicated),
        out_shardings=(tokens_sh, cache_sh),
        donate_argnums=2,
    )
    return Decoder(
        model_cfg,
        mesh,
        rules,
        batch,
        max_len,
        int8_cache,
        abstract,
        cache_sh,
        batch_sh,
        _CheckedPrefill(prefill_jit, max_len),
        step_jit,
        gen_jit,
        matmul,
    )


def unstack_layers(params, n_layers: int):
    """Parameters of a scan_layers model (every block's weights stacked [n_layers, ...] under
    `blocks`) as the unscanned model's (`block_0` … `block_{n-1}`). Decoding runs unscanned:
    each layer's cache is then its own donated buffer, updated in place, where a scan would
    gather the layers' new caches into a fresh stack every step (a full copy of the cache in
    temporary memory, and its bytes moved twice more per step)."""
    return _unstack(params, n_layers)


def param_shardings(shardings, params):
    """Shardings of `params` whose matmul weights may be int8 (quant.Int8Weight), from the
    float weights' `shardings`: the codes take the float weight's sharding; the scales the
    same, except on their contracted axes (size 1), which are never split."""

    def one(sh, p):
        if not isinstance(p, quant.Int8Weight):
            return sh
        spec = tuple(sh.spec) + (None,) * (p.scale.ndim - len(sh.spec))
        kept = [a if n > 1 else None for a, n in zip(spec, p.scale.shape, strict=True)]
        return quant.Int8Weight(sh, NamedSharding(sh.mesh, P(*kept)))

    return jax.tree.map(one, shardings, params, is_leaf=lambda x: isinstance(x, quant.Int8Weight))


def batch_multiple(trainer) -> int:
    """Devices the batch is split over (the rules' batch axes): every serving batch is a
    multiple of it."""
    axes = dict(trainer.rules).get(BATCH) or ()
    return math.prod(trainer.mesh.shape[a] for a in axes)


def reads_whole_cache(model: ModelConfig, backend: str, *, int8_cache: bool = False) -> bool:
    """Whether a decode step reads every slot of the cache (the plain-JAX reference masks
    past each length) rather than stopping at each sequence's length (the Pallas and C++
    kernels): the kernel decode_attention runs for this model's soft-cap and dtypes."""
    kv = jnp.int8 if int8_cache else model.dtype
    impl = decode_kernel(
        decode_impl(model.attention),
        softcap=model.softcap or None,
        q_dtype=model.dtype,
        kv_dtype=kv,
        backend=backend,
    )
    return impl == "reference"


DECODE_KERNELS = {  # what each decode kernel reads of the cache, for a run's header
    "reference": "plain JAX: reads every cache slot",
    "cpu": "C++: reads each sequence's valid slots",
    "pallas_tpu": "Pallas TPU: reads each sequence's valid blocks",
    "pallas_gpu": "Pallas Triton: reads each sequence's valid blocks",
}


def decode_kernel_line(model: ModelConfig, backend: str) -> str:
    """'cpu (C++: ...)' or 'reference (plain JAX: ...) instead of cpu: why': the decode
    attention kernel a decode step of this model runs on `backend`, and why it is not the
    backend's preferred one (auto's, for a plain-float cache) where it is not."""
    asked = decode_impl(model.attention)
    kernel, why = decode_kernel_noted(
        asked,
        softcap=model.softcap or None,
        q_dtype=model.dtype,
        kv_dtype=model.dtype,
        backend=backend,
    )
    best = choose_decode("auto", backend=backend)
    if why is None and kernel != best:
        # attention= names the kernel, but auto would take it too (a soft-cap, float16): that
        # is why, whether attention= was asked or filled (auto → blockwise for float16)
        auto, why = decode_kernel_noted(
            "auto",
            softcap=model.softcap or None,
            q_dtype=model.dtype,
            kv_dtype=model.dtype,
            backend=backend,
        )
        why = why if auto == kernel else None
    if why is None and kernel != best:
        pick = "auto or cpu_flash" if backend == "cpu" else "auto or pallas"
        why = f"attention={model.attention} decodes with the {kernel} ({pick} picks {best})"
    line = f"{kernel} ({DECODE_KERNELS.get(kernel, kernel)})"
    return line if why is None else f"{line} instead of {best}: {why}"


def check_prompts(prompt_lengths, max_len: int, steps: int = 0) -> None:
    """A prompt (plus the tokens to generate) longer than the cache is one line."""
    longest = max(int(n) for n in prompt_lengths)
    if longest + steps > max_len:
        raise ConfigError(
            f"a prompt of {longest} tokens plus {steps} to generate does not fit a cache of "
            f"{max_len} slots: raise context= or shorten the prompt"
        )
    if min(int(n) for n in prompt_lengths) < 1:
        raise ConfigError("every prompt needs at least one token")


def quantize(params):
    """int8 weights, one scale per output channel (lab/quant.py); the lookup table stays."""
    return quant.quantize_params(params)
