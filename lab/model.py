"""A decoder-only transformer in flax.linen: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Letters in tensor names and einsum strings (lab/names.py): B batch, L sequence, S cache slots,
D d_model, H query heads, G key/value heads, K head dim, F MLP hidden, V vocabulary. Weights and
activations carry logical axis names (lab/names.py; lab/mesh.py maps them to the mesh);
parameters live in `param_dtype`, matmuls run in `dtype`, softmax and the loss in float32.

Training calls the model on tokens alone. Serving (lab/decode.py) passes a key/value cache
too: each attention layer writes the new tokens' keys and values into it at each sequence's
own length (ragged batches), rotates positions from there, and attends either the new tokens
among themselves (prefill from an empty cache) or one new token against the cache (a decode
step, lab.kernels.attention.decode_attention); the call returns the logits and the new
cache. Weights may be int8 (lab/quant.py: Int8Weight), multiplied without dequantising.

Masks (ModelConfig): `window` makes a layer local (it sees itself and the window-1 tokens
before it, in training, prefill and decode alike), `window_pattern` which layers are (static
per layer unscanned; under scan_layers each layer's index into the pattern's distinct windows
is a scanned input and lax.switch runs that window's branch; a pipeline stage takes one window
for all layers); `softcap` caps the attention logits; packed training rows pass segment ids,
so attention stays within a document and the rotary positions restart at each.
"""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from lab import quant
from lab.config import ModelConfig
from lab.kernels import pipeline
from lab.kernels.attention import attention, decode_attention
from lab.kernels.attention.common import platform
from lab.measure.memory import LayerCensus
from lab.names import (
    BATCH,
    EMBED,
    HEAD_DIM,
    HEADS,
    HOST_MEMORY,
    LAYERS,
    MLP,
    NORM,
    SEQ,
    STAGE,
    VOCAB,
)

QKV = (BATCH, SEQ, HEADS, HEAD_DIM)  # q, k, v and the attention output
CACHE = (BATCH, HEADS, None, HEAD_DIM)  # a cache [B, G, S, K]: its slots are never split


@struct.dataclass
class LayerKV:
    """One attention layer's key/value cache in the decode kernels' layout [B, G, S, K]
    (stacked [layers, B, G, S, K] under scan_layers); an int8 cache carries one float32 scale
    per (token, kv head), [B, G, 1, S] (lab/quant.py)."""

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None


@struct.dataclass
class KVCache:
    """Every layer's cache (a tuple of LayerKV, or one stacked LayerKV under scan_layers)
    and the valid slots of each sequence, lengths [B] int32."""

    layers: tuple | LayerKV
    lengths: jax.Array


BLOCK_INPUT = "block_input"  # checkpoint name of each block's input (the residual stream)
REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole block in the backward pass
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep matmul outputs
    # as full, but each block's input is kept in host memory instead of device memory: copied
    # out after the forward, back in for the block's backward (MaxText's offload policies)
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=[BLOCK_INPUT],
        offload_src="device",
        offload_dst=HOST_MEMORY,
    ),
}


def _init(std: float, names: tuple):
    """N(0, std²), drawn in float32 whatever the parameter dtype, then cast to it: a bfloat16
    or float16 model starts from the float32 model's weights, rounded (a draw in bfloat16
    gives other numbers, so the two precisions would not start from the same point)."""
    normal = nn.initializers.normal(std)

    def init(key, shape, dtype=jnp.float32):
        return normal(key, shape, jnp.float32).astype(dtype)

    return nn.with_logical_partitioning(init, names)


def _constrain(x, names: tuple):
    return nn.with_logical_constraint(x, names)


def rope(x_BxLxHxK, positions, theta: float):
    """Rotary embeddings: rotate pairs of features by a position-dependent angle. `positions`
    is [L] (every sequence from 0) or [B, L] (decoding: each from its own length)."""
    K = x_BxLxHxK.shape[-1]
    freq_K2 = theta ** (-jnp.arange(0, K, 2, dtype=jnp.float32) / K)
    pos_BxL = positions if positions.ndim == 2 else positions[None]
    angle_BxLxK2 = pos_BxL[..., None].astype(jnp.float32) * freq_K2
    sin, cos = jnp.sin(angle_BxLxK2)[:, :, None, :], jnp.cos(angle_BxLxK2)[:, :, None, :]
    x1, x2 = jnp.split(x_BxLxHxK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxHxK.dtype)


class RMSNorm(nn.Module):
    """x / rms(x) · scale. The scale is tiny, so it is replicated (logical name `norm`)."""

    eps: float = 1e-6
    param_dtype: str = "float32"

    @nn.compact
    def __call__(self, x_BxLxD):
        scale_D = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones, (NORM,)),
            (x_BxLxD.shape[-1],),
            self.param_dtype,
        )
        x = x_BxLxD.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * scale_D.astype(jnp.float32)).astype(x_BxLxD.dtype)


def segment_positions(segments_BxL):
    """Each token's position within its document: packed rows (segment ids, one id per
    document, runs of equal ids) restart the rotary positions at every document's first token."""
    B, L = segments_BxL.shape
    i_L = jnp.arange(L, dtype=jnp.int32)
    first_BxL = jnp.concatenate(
        [jnp.ones((B, 1), bool), segments_BxL[:, 1:] != segments_BxL[:, :-1]], axis=1
    )
    start_BxL = jax.lax.cummax(jnp.where(first_BxL, i_L[None], 0), axis=1)
    return i_L[None] - start_BxL


def _by_layer(fn, windows: tuple, kind):
    """fn(window) for this layer: windows[0] when every layer is alike (kind None), else the
    scanned layer's own, chosen by `kind` (its index in windows) with lax.switch: the mask's
    window is static in every kernel, so each distinct window is its own branch and a layer
    runs only its own."""
    if kind is None:
        return fn(windows[0])
    return jax.lax.switch(kind, [functools.partial(fn, w) for w in windows])


def _overflowing(start_B, L: int, S: int):
    """[B] bool: sequences whose L new entries would run past the cache's S slots."""
    return start_B + L > S


def _put(cache, new, start_B, axis: int):
    """`new` written per sequence at slot start[b] along `axis` (2: [B,G,S,K]; 3: scales
    [B,G,1,S]), except for a sequence that would run past the cache: there
    `dynamic_update_slice` would clamp the start and silently overwrite the last slots, so that
    sequence's cache is left as it was (lab/decode.py turns its logits into NaN)."""
    L, S = new.shape[axis], cache.shape[axis]
    idx = lambda s: tuple(s if d == axis - 1 else 0 for d in range(cache.ndim - 1))  # noqa: E731
    size = lambda c: tuple(L if d == axis - 1 else n for d, n in enumerate(c.shape))  # noqa: E731
    old = jax.vmap(lambda c, s: jax.lax.dynamic_slice(c, idx(s), size(c)))(cache, start_B)
    keep = _overflowing(start_B, L, S).reshape((-1,) + (1,) * (new.ndim - 1))
    new = jnp.where(keep, old, new.astype(cache.dtype))
    return jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice(c, n, idx(s)))(cache, new, start_B)


def _write(cache_BxGxSxK, new_BxLxGxK, start_B):
    """The L new entries of each sequence written at its own slot start[b]."""
    new_BxGxLxK = jnp.swapaxes(new_BxLxGxK, 1, 2).astype(cache_BxGxSxK.dtype)
    return _put(cache_BxGxSxK, new_BxGxLxK, start_B, axis=2)


def _write_int8(kv, new_BxLxGxK, start_B, which: str):
    """Quantize the new entries per (token, kv head) and write codes and scales."""
    codes, scale = quant.quantize_kv(jnp.swapaxes(new_BxLxGxK, 1, 2))  # [B,G,L,K], [B,G,1,L]
    cache, scales = getattr(kv, which), getattr(kv, f"{which}_scale")
    cache = _put(cache, codes, start_B, axis=2)
    scales = _put(scales, scale.astype(scales.dtype), start_B, axis=3)
    return cache, scales


def update_cache(kv: LayerKV, k_BxLxGxK, v_BxLxGxK, start_B) -> LayerKV:
    """`kv` with L new keys and values per sequence at slots start[b] … start[b]+L-1."""
    if kv.k.dtype == jnp.int8:
        k, k_scale = _write_int8(kv, k_BxLxGxK, start_B, "k")
        v, v_scale = _write_int8(kv, v_BxLxGxK, start_B, "v")
        return LayerKV(k, v, k_scale, v_scale)
    return kv.replace(k=_write(kv.k, k_BxLxGxK, start_B), v=_write(kv.v, v_BxLxGxK, start_B))


def decode_impl(attention_impl: str) -> str:
    """The decode kernel of a training `attention=`: a Pallas choice keeps Pallas (the
    backend's decode kernel), auto stays auto, the CPU's C++ flash attention decodes with the
    CPU's C++ decode kernel (auto: it, where built), every other is the plain-JAX reference."""
    if attention_impl in ("auto", "pallas", "pallas_tpu", "pallas_gpu"):
        return attention_impl
    if attention_impl == "cpu_flash":
        return "auto"
    if attention_impl == "pallas_mgpu":  # no Mosaic GPU decode kernel: the GPU's Triton one
        return "pallas_gpu"
    return "reference"


class Attention(nn.Module):
    """Grouped-query attention, causal; `windows` (static): the layer's window (tokens seen,
    itself included; None = its whole past), or under scan_layers the distinct windows of the
    pattern, `kind` picking the layer's. Packed rows pass segments_BxL: attention stays within
    a document and the rotary positions restart at each."""

    cfg: ModelConfig
    windows: tuple = (None,)

    @nn.compact
    def __call__(
        self, x_BxLxD, kv: LayerKV | None = None, lengths_B=None, segments_BxL=None, kind=None
    ):
        c = self.cfg
        D, H, G, K = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim
        std = D**-0.5
        wq_DxHxK = self.param("wq", _init(std, (EMBED, HEADS, HEAD_DIM)), (D, H, K), c.param_dtype)
        wk_DxGxK = self.param("wk", _init(std, (EMBED, HEADS, HEAD_DIM)), (D, G, K), c.param_dtype)
        wv_DxGxK = self.param("wv", _init(std, (EMBED, HEADS, HEAD_DIM)), (D, G, K), c.param_dtype)
        wo_HxKxD = self.param(
            "wo", _init((H * K) ** -0.5, (HEADS, HEAD_DIM, EMBED)), (H, K, D), c.param_dtype
        )
        q_BxLxHxK = quant.matmul("bld,dhk->blhk", x_BxLxD, wq_DxHxK, c.dtype)
        k_BxLxGxK = quant.matmul("bld,dgk->blgk", x_BxLxD, wk_DxGxK, c.dtype)
        v_BxLxGxK = quant.matmul("bld,dgk->blgk", x_BxLxD, wv_DxGxK, c.dtype)
        L = x_BxLxD.shape[1]
        if kv is not None:
            pos = lengths_B[:, None] + jnp.arange(L)[None, :]
        elif segments_BxL is not None:
            pos = segment_positions(segments_BxL)
        else:
            pos = jnp.arange(L)
        q_BxLxHxK = _constrain(rope(q_BxLxHxK, pos, c.rope_theta), QKV)
        k_BxLxGxK = _constrain(rope(k_BxLxGxK, pos, c.rope_theta), QKV)
        spec = nn.logical_to_mesh_axes(QKV)  # Pallas kernels and ring run per shard
        if kv is not None:
            kv = update_cache(kv, k_BxLxGxK, v_BxLxGxK, lengths_B)
            kv = jax.tree.map(lambda a: _constrain(a, CACHE[: a.ndim]), kv)
        softcap = c.softcap or None
        if kv is not None and L == 1:  # a decode step: the new token against the cache

            def attend(window):
                return decode_attention(
                    q_BxLxHxK[:, 0],
                    kv.k,
                    kv.v,
                    lengths_B + 1,
                    kv.k_scale,
                    kv.v_scale,
                    impl=decode_impl(c.attention),
                    shard_spec=nn.logical_to_mesh_axes(CACHE),
                    window=window,
                    softcap=softcap,
                )

            o_BxLxHxK = _by_layer(attend, self.windows, kind)[:, None]
        else:  # training, or a prefill from an empty cache: the new tokens among themselves

            def attend(window):
                return attention(
                    q_BxLxHxK,
                    k_BxLxGxK,
                    v_BxLxGxK,
                    causal=True,
                    impl=c.attention,
                    shard_spec=spec,
                    window=None if window is None else (window - 1, 0),
                    q_segment_ids=segments_BxL,
                    kv_segment_ids=segments_BxL,
                    softcap=softcap,
                )

            o_BxLxHxK = _by_layer(attend, self.windows, kind)
            if kv is not None:  # a prefill sees none of what a non-empty cache holds: NaN
                held_B = lengths_B > 0
                o_BxLxHxK = jnp.where(held_B[:, None, None, None], jnp.nan, o_BxLxHxK)
        o_BxLxHxK = _constrain(o_BxLxHxK, QKV)
        y_BxLxD = quant.matmul("blhk,hkd->bld", o_BxLxHxK, wo_HxKxD, c.dtype)
        return y_BxLxD if kv is None else (y_BxLxD, kv)


class Mlp(nn.Module):
    """SwiGLU: silu(x·W_gate) ⊙ (x·W_up), then W_down."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BxLxD):
        c = self.cfg
        D, F = c.d_model, c.d_ff
        w_gate_DxF = self.param("w_gate", _init(D**-0.5, (EMBED, MLP)), (D, F), c.param_dtype)
        w_up_DxF = self.param("w_up", _init(D**-0.5, (EMBED, MLP)), (D, F), c.param_dtype)
        w_down_FxD = self.param("w_down", _init(F**-0.5, (MLP, EMBED)), (F, D), c.param_dtype)
        gate_BxLxF = quant.matmul("bld,df->blf", x_BxLxD, w_gate_DxF, c.dtype)
        up_BxLxF = quant.matmul("bld,df->blf", x_BxLxD, w_up_DxF, c.dtype)
        h_BxLxF = _constrain(nn.silu(gate_BxLxF) * up_BxLxF, (BATCH, SEQ, MLP))
        return quant.matmul("blf,fd->bld", h_BxLxF, w_down_FxD, c.dtype)


class Block(nn.Module):
    """Pre-norm residual block; returns (x, new cache or None) so nn.scan can stack it."""

    cfg: ModelConfig
    windows: tuple = (None,)  # Attention's

    @nn.compact
    def __call__(self, x_BxLxD, kv=None, lengths_B=None, segments_BxL=None, kind=None):
        c = self.cfg
        x_BxLxD = checkpoint_name(x_BxLxD, BLOCK_INPUT)
        h_BxLxD = RMSNorm(param_dtype=c.param_dtype)(x_BxLxD)
        out = Attention(c, self.windows, name="attn")(h_BxLxD, kv, lengths_B, segments_BxL, kind)
        y_BxLxD, kv = out if kv is not None else (out, None)
        x_BxLxD = x_BxLxD + y_BxLxD
        x_BxLxD = x_BxLxD + Mlp(c, name="mlp")(RMSNorm(param_dtype=c.param_dtype)(x_BxLxD))
        return _constrain(x_BxLxD, (BATCH, SEQ, EMBED)), kv


def _block_class(cfg: ModelConfig):
    if cfg.remat == "none":
        return Block
    return nn.remat(Block, policy=REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)


class Transformer(nn.Module):
    """tokens_BxL (int) → logits_BxLxV (float32); with a KVCache, (logits, the new cache),
    the tokens written at each sequence's length (lengths are advanced by lab/decode.py).
    Packed rows (training) pass segments_BxL, one id per document (lab/data.py). A prefill
    passes `keep_B`, the one position per sequence whose logits it needs (its last real
    token): the head then runs on B rows, not B·L ([B, 1, V] logits; at L = 100,000 and
    V = 32,768 the whole [B, L, V] is 12 GiB a sequence). Several tokens into a cache are a
    prefill into an empty one: a sequence whose cache already holds tokens gets NaN logits
    there (its new tokens would attend only among themselves; no chunked prefill)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens_BxL, cache: KVCache | None = None, segments_BxL=None, keep_B=None):
        c = self.cfg
        embed_VxD = self.param(
            "embed", _init(1.0, (VOCAB, EMBED)), (c.vocab_size, c.d_model), c.param_dtype
        )
        x_BxLxD = embed_lookup(embed_VxD, tokens_BxL, c.dtype)
        # A no-op unless a `perturbations` collection is passed: then the gradient with
        # respect to each position's input arrives there (tests/test_model.py: causality).
        x_BxLxD = self.perturb("embedded", x_BxLxD)
        x_BxLxD = _constrain(x_BxLxD, (BATCH, SEQ, EMBED))
        block = _block_class(c)
        lengths_B = None if cache is None else cache.lengths
        if c.scan_layers:
            windows = tuple(dict.fromkeys(c.layer_windows))  # distinct, in order of use
            kinds = None  # every layer alike: its window is static in the one scanned body
            if len(windows) > 1:  # a local/global pattern: each layer's index, scanned
                kinds = jnp.array([windows.index(w) for w in c.layer_windows], jnp.int32)
            stack = nn.scan(
                block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=(0, nn.broadcast, nn.broadcast, 0),
                length=c.n_layers,
                metadata_params={nn.PARTITION_NAME: LAYERS},
            )
            kv = None if cache is None else cache.layers
            blocks = stack(c, windows, name="blocks")
            if cache is None and _pipelined(c) and not self.is_initializing():
                x_BxLxD = _pipelined_blocks(c, self.variables["params"]["blocks"], x_BxLxD)
                layers = None
            else:
                x_BxLxD, layers = blocks(x_BxLxD, kv, lengths_B, segments_BxL, kinds)
        else:
            layers = []
            for i in range(c.n_layers):
                kv = None if cache is None else cache.layers[i]
                windows = (c.layer_window(i),)
                x_BxLxD, kv = block(c, windows, name=f"block_{i}")(
                    x_BxLxD, kv, lengths_B, segments_BxL
                )
                layers.append(kv)
            layers = tuple(layers)
        if keep_B is not None:  # L becomes 1 from here
            x_BxLxD = jnp.take_along_axis(x_BxLxD, keep_B[:, None, None], axis=1)
        x_BxLxD = RMSNorm(param_dtype=c.param_dtype, name="final_norm")(x_BxLxD)
        # The head through quant.matmul like every other weight: int8 with per-channel scales
        # in a quantised model, the native kernel in decode (lab/decode.py), f32 logits.
        if c.tie_embeddings:  # the table read in place as [V, D]; unit-variance embeddings,
            # so the logits are scaled by d^-0.5 (on the V logits, not on a copy of the table)
            logits_BxLxV = quant.matmul(
                quant.TIED_HEAD, x_BxLxD, embed_VxD, c.dtype, out_dtype=jnp.float32
            )
            logits_BxLxV = logits_BxLxV * c.d_model**-0.5
        else:
            head_DxV = self.param(
                "head",
                _init(c.d_model**-0.5, (EMBED, VOCAB)),
                (c.d_model, c.vocab_size),
                c.param_dtype,
            )
            logits_BxLxV = quant.matmul(
                "bld,dv->blv", x_BxLxD, head_DxV, c.dtype, out_dtype=jnp.float32
            )
        logits_BxLxV = _constrain(logits_BxLxV, (BATCH, SEQ, VOCAB))
        return logits_BxLxV if cache is None else (logits_BxLxV, cache.replace(layers=layers))


def embed_lookup(embed_VxD, tokens_BxL, dtype):
    """The tokens' rows of the table in `dtype`; an int8 table (a tied model quantised: one
    scale per row, lab/quant.py) has each row's codes times its scale."""
    if isinstance(embed_VxD, quant.Int8Weight):
        codes_BxLxD = jnp.take(_constrain(embed_VxD.q, (VOCAB, None)), tokens_BxL, axis=0)
        scale_BxLx1 = jnp.take(embed_VxD.scale, tokens_BxL, axis=0)
        return (codes_BxLxD.astype(jnp.float32) * scale_BxLx1).astype(dtype)
    # Gather the table whole along embed before the lookup (an FSDP all-gather): a lookup
    # into an embed-sharded table would leave activations sharded the wrong way.
    table_VxD = _constrain(embed_VxD, (VOCAB, None))
    if split := _vocab_parallel(table_VxD, tokens_BxL):
        return _vocab_parallel_take(table_VxD, tokens_BxL, *split, dtype)
    return jnp.take(table_VxD, tokens_BxL, axis=0).astype(dtype)


def _vocab_parallel(table_VxD, tokens_BxL) -> tuple | None:
    """(vocabulary mesh axes, batch mesh axes) where the lookup should run on each shard of a
    vocabulary-split table, else None. XLA gathers a vocabulary-split table whole for a
    lookup (V·D bytes onto every device, each step: 229 MB for Llama-2 7B over 8 GPUs, per
    decoded token); a per-shard lookup sums the shards' rows instead (an all-reduce of the
    tokens' activations, 2·B·L·D bytes). Chosen where that moves fewer bytes (2·B·L < V: a
    decode step, a short prefill) and the vocabulary's axes do not split the batch."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    rules = dict(nn.get_logical_axis_rules())
    vocab = tuple(a for a in mesh_axes_of(rules.get(VOCAB)) if mesh.shape.get(a, 1) > 1)
    batch = tuple(a for a in mesh_axes_of(rules.get(BATCH)) if mesh.shape.get(a, 1) > 1)
    B, L = tokens_BxL.shape
    V = table_VxD.shape[0]
    if not vocab or set(vocab) & set(batch) or 2 * B * L >= V:
        return None
    if V % math.prod(mesh.shape[a] for a in vocab) or B % math.prod(mesh.shape[a] for a in batch):
        return None
    return vocab, batch


def _vocab_parallel_take(table_VxD, tokens_BxL, vocab: tuple, batch: tuple, dtype):
    """Megatron's vocabulary-parallel embedding: each device looks the tokens up in its rows
    of the table (0 for a token another shard holds) and a sum over the vocabulary's shards
    joins them, in `dtype` (exact: one shard's row is the only term that is not 0)."""
    mesh = jax.sharding.get_abstract_mesh()

    def local(t_VxD, tok_BxL):
        index = 0
        for a in vocab:  # the shard's place along the vocabulary, major axis first
            index = index * mesh.shape[a] + jax.lax.axis_index(a)
        ids_BxL = tok_BxL - index * t_VxD.shape[0]
        inside_BxL = (ids_BxL >= 0) & (ids_BxL < t_VxD.shape[0])
        rows_BxLxD = jnp.take(t_VxD, jnp.where(inside_BxL, ids_BxL, 0), axis=0).astype(dtype)
        return jax.lax.psum(jnp.where(inside_BxL[..., None], rows_BxLxD, 0), vocab)

    b = batch or None
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(vocab, None), P(b, None)),
        out_specs=P(b, None, None),
    )(table_VxD, tokens_BxL)


def _pipelined(c: ModelConfig) -> bool:
    """Whether the blocks run as a pipeline: microbatches asked for, a stage axis to use."""
    mesh = jax.sharding.get_abstract_mesh()
    return bool(c.microbatches) and not mesh.empty and mesh.shape.get(STAGE, 1) > 1


def mesh_axes_of(axes) -> tuple:
    """A rule's mesh axes as a tuple (None, a name, or a tuple of names)."""
    return (axes,) if isinstance(axes, str) else tuple(axes or ())


def rules_without(rules, axes) -> tuple:
    """The logical rules with some mesh axes taken out (they are manual inside a shard_map)."""
    return tuple(
        (name, tuple(a for a in mesh_axes_of(m) if a not in axes) or None) for name, m in rules
    )


def _pipelined_blocks(c: ModelConfig, stacked_params, x_BxLxD):
    """The scanned blocks run as a pipeline over the context mesh's `stage` axis
    (lab/kernels/pipeline.py).

    The parameters are nn.scan's own (leading axis n_layers, logical name `layers`, which the
    pp rules put on `stage`), so a pipelined and an unpipelined model share parameters and
    checkpoints. Each stage scans `Block(cfg).apply` over its layers with the model's remat
    policy per layer. The mesh axes the batch is split over are manual inside the pipeline
    with `stage`: `data`, and `fsdp` under pp+fsdp, whose weights each stage gathers once per
    step (and whose gradients it reduce-scatters once); `model` stays automatic, and the
    block's own sharding constraints apply under the rules without the manual axes.
    """
    rules = nn.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    batch = tuple(a for a in mesh_axes_of(dict(rules).get(BATCH)) if a != STAGE)
    manual = tuple(a for a in batch if mesh.shape.get(a, 1) > 1)
    inner = rules_without(rules, (STAGE, *manual))

    def layer(p, x_BxLxD):
        with nn.logical_axis_rules(inner):
            # one window for every layer (resolve's rule for pipelines)
            return Block(c, (c.layer_window(0),)).apply({"params": p}, x_BxLxD)[0]

    remat = c.remat != "none"
    stage_fn = pipeline.scan_layers(layer, remat=remat, remat_policy=REMAT_POLICIES.get(c.remat))
    io = "stage" if STAGE in mesh_axes_of(dict(rules).get(BATCH)) else "replicated"
    return pipeline.pipeline_apply(
        stage_fn,
        stacked_params,
        x_BxLxD,
        microbatches=c.microbatches,
        repeats=c.pipeline_repeats,
        # circular: the stacked blocks are stored stage-major (lab.kernels.pipeline), so the
        # layer axis split over `stage` already gives each stage its chunks, and no all-to-all
        # of the weights and their gradients runs every step
        layer_order=layer_order(c),
        batch_axes=manual,
        batch_layout=manual,
        weight_specs=_block_specs(c, rules, manual, x_BxLxD),
        io=io if c.microbatches % mesh.shape[STAGE] == 0 else "replicated",
        # the blockwise loop and the Pallas kernels carry no varying-axes types (they are
        # written for shard_map(check_vma=False)): JAX's type check for naive attention only
        check_vma=c.attention == "naive",
    )


def layer_order(c: ModelConfig) -> str:
    """How a pipelined model stores its stacked blocks: "stage_major" under the circular
    schedule (stored index s·R·C + r·C + j holds layer (r·P + s)·C + j), else "natural". The
    checkpoint keeps that storage; `natural_layers` turns it back into layer order."""
    return "stage_major" if c.pipeline_repeats > 1 else "natural"


def natural_layers(c: ModelConfig, stacked_params, stages: int):
    """A pipelined model's stacked blocks in layer order (leaf index = layer)."""
    if layer_order(c) == "stage_major":
        return pipeline.from_stage_major_order(stacked_params, stages, c.pipeline_repeats)
    return stacked_params


def stack_layers(params, n_layers: int) -> dict:
    """The unscanned model's parameters (`block_0` … `block_{n-1}`) in the scanned layout:
    every block weight stacked under `blocks`, leading axis = layer."""
    layers = [params[f"block_{i}"] for i in range(n_layers)]
    rest = {k: v for k, v in params.items() if k not in _block_names(n_layers)}
    return {**rest, "blocks": jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}


def unstack_layers(params, n_layers: int) -> dict:
    """The inverse of `stack_layers`: `blocks` [n_layers, ...] → `block_0` … `block_{n-1}`
    (parameters already unscanned are returned as they are)."""
    if "blocks" not in params:
        return params
    out = {k: v for k, v in params.items() if k != "blocks"}
    for i in range(n_layers):
        out[f"block_{i}"] = jax.tree.map(lambda a, i=i: a[i], params["blocks"])
    return out


def _block_names(n_layers: int) -> set:
    return {f"block_{i}" for i in range(n_layers)}


def _block_specs(c: ModelConfig, rules, axes: tuple, x_BxLxD):
    """Where each block weight is split over the mesh `axes` (a PartitionSpec over its dims,
    the other axes left out); None when no weight is split over any of them."""
    x = jax.ShapeDtypeStruct((1,) + x_BxLxD.shape[1:], x_BxLxD.dtype)
    boxed = jax.eval_shape(lambda x: Block(c).init(jax.random.key(0), x), x)["params"]
    meshed = nn.logical_to_mesh(nn.get_partition_spec(boxed), rules)
    keep = lambda m: tuple(a for a in mesh_axes_of(m) if a in axes) or None  # noqa: E731
    specs = jax.tree.map(
        lambda spec, leaf: P(*(keep(m) for m in tuple(spec) + (None,) * (leaf.ndim - len(spec)))),
        meshed,
        nn.meta.unbox(boxed),
        is_leaf=lambda x: isinstance(x, P),
    )
    split = any(
        m for spec in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)) for m in spec
    )
    return specs if split else None


def _reached(jaxpr, seeds) -> set:
    """The variables of `jaxpr` computed from any of `seeds` (its invars), looking into nested
    jits output by output; any other equation's outputs are reached if one of its inputs is."""
    reached = set(seeds)
    hit = lambda v: not isinstance(v, jax.extend.core.Literal) and v in reached  # noqa: E731
    for e in jaxpr.eqns:
        inner = e.params.get("jaxpr") if e.primitive.name in ("pjit", "jit") else None
        if inner is not None:
            inner = getattr(inner, "jaxpr", inner)
            inside = _reached(
                inner, [w for v, w in zip(e.invars, inner.invars, strict=True) if hit(v)]
            )
            reached.update(
                o
                for o, w in zip(e.outvars, inner.outvars, strict=True)
                if not isinstance(w, jax.extend.core.Literal) and w in inside
            )
        elif any(hit(v) for v in e.invars):
            reached.update(e.outvars)
    return reached


def _kept_for_backward(fn, *args) -> list[tuple]:
    """(abstract value, what it is) of every array `jax.vjp` keeps from `fn`'s forward for its
    backward, traced, not run: "argument" (one of `fn`'s flat arguments but the last),
    "activation" (computed from the last argument), "weights" (from the others alone).
    Values computed from literals and constants alone are left out: XLA folds them."""
    closed, shapes = jax.make_jaxpr(lambda *a: jax.vjp(fn, *a), return_shape=True)(*args)
    jaxpr = closed.jaxpr
    n = len(jax.tree.leaves(shapes[1]))  # the backward function's leaves are what it keeps
    *weights, x = jaxpr.invars
    from_inputs, from_x = _reached(jaxpr, jaxpr.invars), _reached(jaxpr, [x])
    seen, kept = set(), []
    for v in jaxpr.outvars[len(jaxpr.outvars) - n :]:
        if isinstance(v, jax.extend.core.Literal) or v in seen or v not in from_inputs:
            continue
        seen.add(v)
        kind = "activation" if v in from_x else "argument" if v in weights else "weights"
        kept.append((v.aval, kind))
    return kept


def layer_census(cfg: ModelConfig, seq_len: int) -> LayerCensus:
    """`_layer_census` for the platform the program is built for (the context mesh's)."""
    return _layer_census(cfg, seq_len, platform())


@functools.cache
def _layer_census(cfg: ModelConfig, seq_len: int, backend: str) -> LayerCensus:
    """What one block keeps for its backward at `seq_len` tokens a sequence, per token, under
    the model's remat policy and with none: its jaxpr's residuals (lab.measure.memory:
    LayerCensus), traced on two sequences of the compute dtype, no device memory touched.

    Each kept array is an activation (computed from the block's input): the residual stream
    if it is [B, L, D] (or a per-token scalar [B, L, 1]), split over heads or MLP columns
    otherwise (a model whose d_ff equals d_model has its MLP's activations counted as the
    stream); or a weight copy (computed from the weights alone, e.g. a cast to the compute
    dtype; the weights themselves are the block's arguments and are not counted). The first
    layer's window stands for all. Call it inside a one-device mesh of the platform the step
    is built for (lab.train.census_for): attention's kernel is that platform's (`backend`, the
    cache's key); under more devices a kernel run by shard_map on the census's unsharded block
    would name each device's copy of its residuals, and the census would grow with the mesh."""
    b = 2
    x = jax.ShapeDtypeStruct((b, seq_len, cfg.d_model), jnp.dtype(cfg.dtype))
    windows = (cfg.layer_window(0),)
    stream = {(b, seq_len, cfg.d_model), (b, seq_len, 1)}

    def kept(block_cls) -> tuple[float, float, float]:
        module = block_cls(cfg, windows)
        params = jax.eval_shape(lambda x: module.init(jax.random.key(0), x)["params"], x)
        params = nn.meta.unbox(params)
        replicated = split = weights = 0.0
        for aval, kind in _kept_for_backward(
            lambda p, x: module.apply({"params": p}, x)[0], params, x
        ):
            size = math.prod(aval.shape) * aval.dtype.itemsize
            if kind == "weights":
                weights += size
            elif kind == "activation" and tuple(aval.shape) in stream:
                replicated += size / (b * seq_len)
            elif kind == "activation":
                split += size / (b * seq_len)
        return replicated, split, weights

    with nn.logical_axis_rules(()):
        full = kept(Block)
        saved = full if cfg.remat == "none" else kept(_block_class(cfg))
    return LayerCensus(
        saved_replicated=saved[0],
        saved_split=saved[1],
        full_replicated=full[0],
        full_split=full[1],
        weights=saved[2],
    )


def count_params(params) -> int:
    """Parameters (an int8 weight counts its codes, not its scales)."""
    q = lambda w: w.q if isinstance(w, quant.Int8Weight) else w  # noqa: E731
    leaves = jax.tree.leaves(
        jax.tree.map(q, params, is_leaf=lambda w: isinstance(w, quant.Int8Weight))
    )
    return sum(x.size for x in leaves)


def count_nonembedding_params(params, cfg: ModelConfig) -> int:
    """N in the 6·N FLOPs-per-token rule: every weight except the input embedding table.

    An untied output head is a matmul per token, so it counts; a tied one is the embedding
    itself and counts once through the head matmul (the lookup costs no FLOPs).
    """
    return count_params(params) - cfg.vocab_size * cfg.d_model * (0 if cfg.tie_embeddings else 1)


@functools.cache
def build(cfg: ModelConfig) -> Transformer:
    """The transformer of `cfg`, whose compute dtype must be resolved: dtype="auto" (the
    default) depends on the backend, so it is refused here with a ValueError; resolve it with
    lab.config.resolve_dtype(cfg, jax.default_backend()) (float32 on CPU, bfloat16 on GPU and
    TPU), give a dtype, or take the model of a resolved config (open_session(...).cfg.model)."""
    if cfg.dtype == "auto":
        raise ValueError(
            "ModelConfig.dtype='auto': the model needs a resolved compute dtype, which depends "
            "on the backend; resolve it with lab.config.resolve_dtype(cfg, "
            "jax.default_backend()), give dtype= (float32, bfloat16 or float16), or build the "
            "model of a resolved config (open_session(...).cfg.model)"
        )
    return Transformer(cfg)
