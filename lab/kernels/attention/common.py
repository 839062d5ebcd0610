"""What every attention implementation shares: input checks, padding, the causal convention.

Causal convention (the reference's): query row i may see key column j when
j <= i + (S - L), i.e. the mask is aligned to the bottom-right corner, which is what decoding
with a key/value cache needs. For L == S this is the usual lower triangle. Causal attention
with L > S leaves the first rows with no key at all: kernels that take a `Mask` give such rows
the output 0 (FlashAttention's convention); the others refuse it (`check_qkv`).

`Mask` is the one description of which (query, key) pairs take part, shared by every
implementation: causal, a sliding window, segment ids (packed sequences), per-sequence
lengths, and any combination. `Mask.block_map` classifies every (query block, key block) tile
as empty, partial or full before a kernel runs, so kernels skip the empty tiles and apply the
mask only to the partial ones.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# A large finite negative instead of -inf: exp(MASK - m) is exactly 0 and never inf - inf = NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
INT32_MAX = 2**31 - 1  # positions and window sides are counted in int32 by every kernel


def target_device():
    """The context mesh's abstract device (an ahead-of-time target's), or None."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else getattr(mesh, "abstract_device", None)


def platform() -> str:
    """The platform the program is being built for: the context mesh's (an AOT target's TPU
    or GPU devices on a CPU host), else JAX's default backend; cpu, gpu or tpu."""
    name = getattr(target_device(), "platform", None) or jax.default_backend()
    return {"cuda": "gpu", "rocm": "gpu"}.get(name, name)


def device_kind() -> str:
    """The device kind the program is built for: a target's under its mesh, else device 0's."""
    return getattr(target_device(), "device_kind", None) or jax.devices()[0].device_kind


def check_qkv(
    q_BxLxHxK,
    k_BxSxGxK,
    v_BxSxGxK,
    *,
    causal: bool,
    empty_rows: bool = False,
    value_dim: bool = False,
) -> None:
    """Shape rules every implementation needs; raise ValueError naming the broken one.

    `empty_rows`: the caller gives rows with no visible key the output 0 (causal L > S is
    then allowed); `value_dim`: the caller takes a value head dim unlike the query/key one.
    """
    q, k, v = q_BxLxHxK, k_BxSxGxK, v_BxSxGxK
    check_rank(q, k, v)
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"{k.shape=} {v.shape=}: keys and values must share batch, seq and heads")
    if not value_dim and k.shape != v.shape:
        raise ValueError(
            f"{k.shape=} {v.shape=}: this implementation needs the value head dim equal to "
            "the key head dim"
        )
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"{q.shape=} {k.shape=}: batch and head_dim of q and k must match")
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"{q.shape=} {k.shape=}: query heads must be a multiple of kv heads "
            "(grouped-query attention)"
        )
    if causal and not empty_rows and q.shape[1] > k.shape[1]:
        raise ValueError(
            f"{q.shape=} {k.shape=}: causal attention needs q seq <= kv seq "
            "(bottom-right aligned mask; earlier rows would see no key)"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{q.dtype=} {k.dtype=} {v.dtype=}: q, k, v must share one dtype")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"{q.dtype=}: attention takes floating-point q, k, v")


def check_rank(q, k, v) -> None:
    """q, k and v are each [batch, seq, heads, head_dim], none of them 0 (checked before any
    rule that divides by one): ValueError otherwise."""
    shapes = " ".join(f"{n}.shape={jnp.shape(x)}" for n, x in zip("qkv", (q, k, v), strict=True))
    if any(jnp.ndim(x) != 4 for x in (q, k, v)):
        raise ValueError(f"{shapes}: expected [batch, seq, heads, head_dim]")
    if 0 in (*jnp.shape(q), *jnp.shape(k), *jnp.shape(v)):
        raise ValueError(f"{shapes}: every dimension must be at least 1")


def check_dtype(q_BxLxHxK, allowed: tuple, impl: str) -> None:
    """Kernels support a few dtypes; name them in the error."""
    if q_BxLxHxK.dtype not in [jnp.dtype(d) for d in allowed]:
        names = ", ".join(jnp.dtype(d).name for d in allowed)
        raise ValueError(f"{q_BxLxHxK.dtype=}: impl={impl!r} supports dtypes {names}")


def default_scale(head_dim: int, scale: float | None) -> float:
    """1/sqrt(head_dim) for None, else `scale`: a finite number (a NaN would make every output
    NaN, a string would be read as a number)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool | str | bytes):
        raise ValueError(f"scale={scale!r}: must be a number (or None: 1/sqrt(head_dim))")
    value = float(scale)
    if not math.isfinite(value):
        raise ValueError(f"scale={scale!r}: must be finite (or None: 1/sqrt(head_dim))")
    return value


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_seq(x_BxSxHxK, length: int, axis: int = 1):
    """Zero-pad the sequence axis to `length`; padded keys are masked, padded queries dropped.
    `axis`: 1 in [B, S, H, K]; 2 for per-row statistics [B, H, L] (log-sum-exp, delta)."""
    extra = length - x_BxSxHxK.shape[axis]
    if extra == 0:
        return x_BxSxHxK
    widths = [(0, 0)] * x_BxSxHxK.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x_BxSxHxK, widths)


def visible(q_pos, k_pos, *, causal: bool, kv_len: int, offset: int):
    """Which (query, key) pairs take part: real keys only, and below the causal diagonal.

    `q_pos`, `k_pos` broadcast against each other; `offset` = S - L (see module docstring).
    """
    ok = k_pos < kv_len
    if causal:
        ok = ok & (k_pos <= q_pos + offset)
    return ok


def _div(a, b: int):
    """Integer division of a non-negative traced index (lax.div: lowers everywhere, any x64)."""
    a = jnp.asarray(a)
    return lax.div(a, jnp.asarray(b, a.dtype))


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static sizes of one call, shared by a kernel's forward and backward (hashable: a jit key).

    The block-skipping rules live here once; they take traced block indices (program ids or
    loop counters) and use only non-negative integer division, which every lowering accepts.
    """

    L: int  # query length before padding
    S: int  # key length before padding
    G: int  # kv heads
    R: int  # query heads per kv head
    bq: int  # query rows per block
    bk: int  # key columns per block
    causal: bool
    scale: float

    @property
    def offset(self) -> int:
        return self.S - self.L  # key j is visible to query i iff j <= i + offset (causal)

    @property
    def n_q(self) -> int:
        return round_up(self.L, self.bq) // self.bq

    @property
    def n_k(self) -> int:
        return round_up(self.S, self.bk) // self.bk

    @property
    def needs_mask(self) -> bool:
        """Whether any tile has invisible entries (causal, or padded keys)."""
        return self.causal or self.S % self.bk != 0

    def sees(self, i, j):
        """Whether query block i sees any key of block j (causal: not above the diagonal)."""
        return j * self.bk <= i * self.bq + self.bq - 1 + self.offset

    def k_blocks_end(self, i):
        """One past the last key block query block i sees: the causal loop bound."""
        if not self.causal:
            return self.n_k
        return jnp.minimum(self.n_k, _div(i * self.bq + self.bq - 1 + self.offset, self.bk) + 1)

    def q_blocks_start(self, j):
        """First query block that sees any key of block j."""
        if not self.causal:
            return 0
        return _div(jnp.maximum(j * self.bk - self.offset, 0), self.bq)

    def k_blocks_whole(self, i):
        """Key blocks 0 … n-1 that every row of query block i sees whole (no causal cut, no
        padded key): a kernel may run them without a mask, and mask only the rest.

        Block j is whole iff it holds no padded key ((j+1)·bk <= S) and, when causal, its last
        key is visible to the block's first query: j·bk + bk - 1 <= i·bq + offset.
        """
        whole = self.S // self.bk
        if not self.causal:
            return whole
        return jnp.minimum(whole, _div(i * self.bq + self.offset + 1, self.bk))

    def q_blocks_masked_end(self, j):
        """One past the last query block that needs the mask against key block j: blocks from
        here to n_q see it whole (none do if block j holds padded keys)."""
        start = self.q_blocks_start(j)
        if self.causal:
            # first i with i·bq + offset >= j·bk + bk - 1 (its first row sees the last key)
            need = jnp.maximum(j * self.bk + self.bk - 1 - self.offset, 0)
            first_whole = jnp.maximum(_div(need + self.bq - 1, self.bq), start)
        else:
            first_whole = jnp.asarray(start, jnp.int32)
        padded = (j + 1) * self.bk > self.S
        return jnp.where(padded, self.n_q, jnp.minimum(first_whole, self.n_q))


# ---------------------------------------------------------------------------- masks

EMPTY, PARTIAL, FULL = 0, 1, 2  # a tile's kind in `BlockMap.kind`

# What an implementation may take beyond plain (causal or full) attention; each kernel module
# lists the ones it supports in FEATURES, and the dispatch refuses the rest in one line.
FEATURE_NAMES = {
    "empty_rows": "causal attention with more queries than keys (rows with no key give 0)",
    "segments": "segment ids (packed sequences)",
    "lengths": "per-sequence query/key lengths",
    "window": "a sliding window",
    "softcap": "logit soft-capping",
    "sinks": "attention sinks",
    "lse": "return_lse=True",
    "value_dim": "a value head dim unlike the query/key head dim",
}


@dataclasses.dataclass(frozen=True)
class BlockMap:
    """Every (query block, key block) tile classified before a kernel runs.

    kind      [B, n_q, n_k] int32  EMPTY (skip), PARTIAL (apply the mask) or FULL (no mask)
    kv_blocks [B, n_q, n_k] int32  per query block, its non-empty key blocks ascending, then the
                                   last of them repeated (a Pallas index_map that repeats a block
                                   fetches nothing new)
    kv_count  [B, n_q]      int32  how many of kv_blocks are real
    q_blocks  [B, n_k, n_q] int32  per key block, its non-empty query blocks (backward dK/dV)
    q_count   [B, n_k]      int32

    B is the batch when the mask depends on per-sequence arrays (segment ids, lengths), else 1
    (the same map for every sequence). NumPy arrays where the mask is static (the kernel may
    read them at trace time), jax arrays otherwise.
    """

    kind: object
    kv_blocks: object
    kv_count: object
    q_blocks: object
    q_count: object

    @property
    def static(self) -> bool:
        return isinstance(self.kind, np.ndarray)

    def merged(self) -> "BlockMap":
        """One map for the whole batch (B = 1): a tile is empty only if empty in every
        sequence, full only if full in every one; for kernels whose tile spans the batch."""
        if self.kind.shape[0] == 1:
            return self
        xp = np if self.static else jnp
        kind = xp.where(
            (self.kind == EMPTY).all(0), EMPTY, xp.where((self.kind == FULL).all(0), FULL, PARTIAL)
        )
        return BlockMap.from_kind(kind[None], xp)

    @staticmethod
    def from_kind(kind, xp) -> "BlockMap":
        def lists(kind_BxNxM):
            nonempty = kind_BxNxM != EMPTY
            count = nonempty.sum(-1).astype(np.int32)
            if xp is np:
                order = np.argsort(~nonempty, axis=-1, kind="stable")
            else:
                order = jnp.argsort(~nonempty, axis=-1, stable=True)
            last = xp.take_along_axis(order, xp.maximum(count - 1, 0)[..., None], axis=-1)
            t = xp.arange(kind_BxNxM.shape[-1])
            return xp.where(t < count[..., None], order, last).astype(np.int32), count

        kind = kind.astype(np.int32)
        kv_blocks, kv_count = lists(kind)
        q_blocks, q_count = lists(xp.swapaxes(kind, 1, 2))
        return BlockMap(kind, kv_blocks, kv_count, q_blocks, q_count)


def _block_min_max(ids_BxN, block: int, n_blocks: int, xp):
    """Per-block (min, max) of segment ids [B, N]; the tail padded with its last id."""
    pad = n_blocks * block - ids_BxN.shape[1]
    ids = xp.pad(ids_BxN, ((0, 0), (0, pad)), mode="edge").reshape(ids_BxN.shape[0], -1, block)
    return ids.min(-1), ids.max(-1)


def check_flag(name: str, value) -> bool:
    """`value` as a bool where it is one (Python or NumPy); anything else (a string, None, a
    number) is refused, since its truthiness would pick the mode: 'no' would mean True."""
    if not isinstance(value, bool | np.bool_):
        raise ValueError(f"{name}={value!r}: must be True or False")
    return bool(value)


def check_interpret(value):
    """`interpret` as the kernels take it: a bool (Python or NumPy), or an interpreter's
    parameters object (Pallas's InterpretParams, the GPU interpreter's InterpretGPUParams:
    truthy, and passed on as they are); a string, None or a number is refused, since its
    truthiness would pick the mode."""
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if value is None or isinstance(value, str | int | float):
        raise ValueError(
            f"interpret={value!r}: must be True or False (or an interpreter's params object)"
        )
    return value


def _as_array(name: str, x):
    """A mask array given as a Python list or tuple (or a number) as a NumPy array, which the
    shape and dtype checks read and `Mask.block_map` keeps static; arrays pass unchanged."""
    if x is None or hasattr(x, "dtype"):
        return x
    try:
        return np.asarray(x)
    except ValueError:  # ragged nested lists
        raise ValueError(f"{name}={x!r}: expected an integer array") from None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mask:
    """Which (query i, key j) pairs of one call take part; every clause must hold.

    causal          j <= i + (S - L): bottom-right aligned (module docstring); a kernel's
                    own `causal` argument is folded in (`with_causal`)
    window          (left, right): i + (S-L) - left <= j <= i + (S-L) + right, each side an
                    int >= 0 or None (unbounded); FlashAttention's window_size, inclusive:
                    (1023, 0) with causal is "the last 1,024 tokens, itself included"
    q_segment_ids   [B, L] int, kv_segment_ids [B, S] int: packed sequences, a query sees
                    only keys of its own segment
    q_lengths       [B] int: rows i >= q_lengths[b] see nothing (output 0)
    kv_lengths      [B] int: keys j >= kv_lengths[b] are padding

    The diagonal stays at the padded shapes' offset S - L: lengths mark right padding, they do
    not move it. A row that sees no key gets the output 0 and log-sum-exp -inf (with
    attention sinks: the output 0 and the sink's logit). A pytree: the arrays are its leaves,
    causal and window its static part, so a Mask passes through jit and shard_map.
    """

    q_segment_ids: object = None
    kv_segment_ids: object = None
    q_lengths: object = None
    kv_lengths: object = None
    causal: bool = dataclasses.field(default=False, metadata=dict(static=True))
    window: tuple | None = dataclasses.field(default=None, metadata=dict(static=True))

    @staticmethod
    def make(
        *,
        causal: bool = False,
        window=None,
        q_segment_ids=None,
        kv_segment_ids=None,
        q_lengths=None,
        kv_lengths=None,
    ) -> "Mask":
        """A checked Mask (window normalised to a tuple of two ints or Nones)."""
        if window is not None:
            if not (isinstance(window, (tuple, list)) and len(window) == 2) or any(
                w is not None
                and (isinstance(w, bool) or not isinstance(w, (int, np.integer)))
                or (w is not None and w < 0)
                for w in window
            ):
                raise ValueError(
                    f"window={window!r}: expected (left, right), each an int >= 0 or None"
                )
            if any(w is not None and w > INT32_MAX for w in window):
                raise ValueError(  # the kernels count positions in int32
                    f"window={window!r}: a side above {INT32_MAX} (2**31 - 1); give None for "
                    "a side without a bound"
                )
            window = tuple(None if w is None else int(w) for w in window)
            if window == (None, None):
                window = None
        if (q_segment_ids is None) != (kv_segment_ids is None):
            raise ValueError("segment ids: pass both q_segment_ids and kv_segment_ids, or neither")
        arrays = dict(
            q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_segment_ids,
            q_lengths=q_lengths,
            kv_lengths=kv_lengths,
        )
        arrays = {name: _as_array(name, x) for name, x in arrays.items()}
        return Mask(**arrays, causal=check_flag("causal", causal), window=window)

    @property
    def segments(self) -> bool:
        return self.q_segment_ids is not None

    @property
    def lengths(self) -> bool:
        return self.q_lengths is not None or self.kv_lengths is not None

    def arrays(self) -> tuple:
        """The mask's arrays (segment ids, lengths) that are given."""
        names = ("q_segment_ids", "kv_segment_ids", "q_lengths", "kv_lengths")
        return tuple(a for a in (getattr(self, n) for n in names) if a is not None)

    @property
    def dynamic(self) -> bool:
        """Whether the mask depends on arrays (segment ids, lengths): a per-sequence map."""
        return self.segments or self.lengths

    def features(self, L: int, S: int) -> set:
        """The FEATURE_NAMES this mask needs from a kernel."""
        out = set()
        if self.segments:
            out.add("segments")
        if self.lengths:
            out.add("lengths")
        if self.window is not None:
            out.add("window")
        if self.causal and L > S:
            out.add("empty_rows")
        return out

    def check(self, B: int, L: int, S: int) -> None:
        """ValueError naming a mask array whose shape or dtype does not fit q [B, L, ...], or
        a length outside 0..L (queries) or 0..S (keys). Lengths are checked where their values
        are known (called outside jit); traced under jit, a length past a bound acts as that
        bound, as no check can stop a compiled program."""
        for name, want in (
            ("q_segment_ids", (B, L)),
            ("kv_segment_ids", (B, S)),
            ("q_lengths", (B,)),
            ("kv_lengths", (B,)),
        ):
            x = getattr(self, name)
            if x is None:
                continue
            if tuple(x.shape) != want or not jnp.issubdtype(x.dtype, jnp.integer):
                raise ValueError(
                    f"{name}.shape={tuple(x.shape)} dtype={x.dtype}: expected integers of "
                    f"shape {want} for q [B={B}, L={L}] and k [B, S={S}]"
                )
        for name, top in (("q_lengths", L), ("kv_lengths", S)):
            x = getattr(self, name)
            if x is None:
                continue
            try:
                values = np.asarray(x)
            except jax.errors.TracerArrayConversionError:  # traced: known when it runs
                continue
            bad = values[(values < 0) | (values > top)]
            if bad.size:
                raise ValueError(
                    f"{name} holds {int(bad[0])}: a length is 0..{top} "
                    f"({'L, the queries' if name == 'q_lengths' else 'S, the keys'} of the call)"
                )

    def band(self, L: int, S: int) -> tuple:
        """(lo, hi): key offsets from the diagonal i + S - L that row i may see (None:
        unbounded), causal and window combined."""
        left, right = self.window or (None, None)
        if self.causal:
            right = 0 if right is None else min(right, 0)
        return (None if left is None else -left), right

    def visible(
        self, q_pos, k_pos, *, L: int, S: int, q_seg=None, kv_seg=None, q_len=None, kv_len=None
    ):
        """Elementwise: whether query position q_pos sees key position k_pos (broadcasting).

        The caller passes the tile's slices of the mask arrays, shaped to broadcast against
        the positions: q_seg like q_pos, kv_seg like k_pos, lengths [B, 1, 1]-like. Positions
        past L or S (block padding) are never visible.
        """
        lo, hi = self.band(L, S)
        ok = (q_pos < L) & (k_pos < S)
        d = k_pos - q_pos - (S - L)
        if lo is not None:
            ok = ok & (d >= lo)
        if hi is not None:
            ok = ok & (d <= hi)
        if q_len is not None:
            ok = ok & (q_pos < q_len)
        if kv_len is not None:
            ok = ok & (k_pos < kv_len)
        if q_seg is not None:
            ok = ok & (q_seg == kv_seg)
        return ok

    def dense(self, B: int, L: int, S: int):
        """The full [B, L, S] boolean mask (the reference's; quadratic memory)."""
        q_pos = jnp.arange(L)[None, :, None]
        k_pos = jnp.arange(S)[None, None, :]
        seg_q = None if not self.segments else self.q_segment_ids[:, :, None]
        seg_k = None if not self.segments else self.kv_segment_ids[:, None, :]
        q_len = None if self.q_lengths is None else self.q_lengths[:, None, None]
        kv_len = None if self.kv_lengths is None else self.kv_lengths[:, None, None]
        ok = self.visible(
            q_pos, k_pos, L=L, S=S, q_seg=seg_q, kv_seg=seg_k, q_len=q_len, kv_len=kv_len
        )
        return jnp.broadcast_to(ok, (B, L, S))

    def block_map(self, L: int, S: int, bq: int, bk: int) -> BlockMap:
        """Classify each (query block, key block) tile: EMPTY, PARTIAL or FULL.

        The band (causal, window) and the static lengths L, S are exact per tile; lengths per
        sequence shrink the tile to its real rows and columns; segment ids compare the tile's
        min/max ids (tiles whose id ranges overlap without being one segment are PARTIAL,
        which is safe: the kernel applies the exact mask there). NumPy when static, or when
        every mask array is a NumPy array.
        """
        arrays = [x for x in jax.tree.leaves(self) if x is not None]
        xp = np if all(isinstance(x, np.ndarray) for x in arrays) else jnp
        n_q, n_k = round_up(L, bq) // bq, round_up(S, bk) // bk
        i0 = xp.arange(n_q)[None, :, None] * bq  # first row of each query block
        j0 = xp.arange(n_k)[None, None, :] * bk
        i_end = xp.minimum(i0 + bq, L)  # one past the last real row
        j_end = xp.minimum(j0 + bk, S)
        if self.q_lengths is not None:
            i_end = xp.minimum(i_end, self.q_lengths[:, None, None])
        if self.kv_lengths is not None:
            j_end = xp.minimum(j_end, self.kv_lengths[:, None, None])
        i1, j1 = i_end - 1, j_end - 1  # last real row / column (may be < first: none)
        any_ = (i0 <= i1) & (j0 <= j1)
        all_ = (i_end == i0 + bq) & (j_end == j0 + bk)
        lo, hi = self.band(L, S)
        off = S - L
        # Row r sees keys [r + off + lo, r + off + hi]; consecutive rows' ranges overlap, so
        # the tile's rows together see [i0 + off + lo, i1 + off + hi], and each row sees the
        # whole tile iff the last row's lower bound and the first row's upper bound allow it.
        if lo is not None:
            any_ = any_ & (j1 >= i0 + off + lo)
            all_ = all_ & (j0 >= i1 + off + lo)
        if hi is not None:
            any_ = any_ & (j0 <= i1 + off + hi)
            all_ = all_ & (j1 <= i0 + off + hi)
        if self.segments:
            q_min, q_max = _block_min_max(self.q_segment_ids, bq, n_q, xp)
            k_min, k_max = _block_min_max(self.kv_segment_ids, bk, n_k, xp)
            q_min, q_max = q_min[:, :, None], q_max[:, :, None]
            k_min, k_max = k_min[:, None, :], k_max[:, None, :]
            any_ = any_ & (q_min <= k_max) & (k_min <= q_max)
            all_ = all_ & (q_min == q_max) & (k_min == k_max) & (q_min == k_min)
        all_ = all_ & any_
        kind = xp.where(all_, FULL, xp.where(any_, PARTIAL, EMPTY))
        B = max(kind.shape[0], 1)
        kind = xp.broadcast_to(kind, (B, n_q, n_k))
        return BlockMap.from_kind(kind, xp)


def attention_tile_flops(
    mask: Mask,
    B: int,
    H: int,
    L: int,
    S: int,
    K: int,
    V: int | None = None,
    *,
    bq: int,
    bk: int,
    backward: bool = False,
) -> float:
    """Matmul FLOPs a block-skipping kernel does under `mask`: only the tiles the block map
    leaves non-empty are counted, each whole (bq·bk scores: a partial tile costs a full one).

    Forward per tile: Q·Kᵀ (2·bq·bk·K) + P·V (2·bq·bk·V); backward (returned alone): the
    recomputed Q·Kᵀ, dP = dO·Vᵀ, dV, dQ and dK, i.e. 2·bq·bk·(3·K + 2·V), the
    FlashAttention-2 count (2.5× the forward when V = K). Softmax exp/max/sum not counted.
    Dividing by `attention_flops(causal=False)` in lab/measure/cost.py gives the share of the
    full score matrix the mask leaves.
    """
    V = K if V is None else V
    tiles = np.asarray(mask.block_map(L, S, bq, bk).kind != EMPTY).sum(axis=(1, 2))
    tiles = float(tiles.sum()) if tiles.shape[0] == B else float(tiles.sum()) * B
    per_tile = 2.0 * bq * bk * ((3 * K + 2 * V) if backward else (K + V))
    return H * tiles * per_tile


@dataclasses.dataclass(frozen=True)
class TileCost:
    """What one kernel launch does over the tiles its block map leaves non-empty: the numbers
    a `pl.CostEstimate` carries, and whether they are exact or an upper bound."""

    flops: float
    transcendentals: float
    bytes_accessed: float
    exact: bool  # False: the mask's arrays (segment ids, lengths) are data at trace time, so
    # only its static part (causal, window, L, S) was counted: an upper bound

    def __add__(self, other: "TileCost") -> "TileCost":
        return TileCost(
            self.flops + other.flops,
            self.transcendentals + other.transcendentals,
            self.bytes_accessed + other.bytes_accessed,
            self.exact and other.exact,
        )

    def estimate(self):
        """The Pallas `CostEstimate` of these figures (XLA wants integers)."""
        from jax.experimental import pallas as pl

        return pl.CostEstimate(
            flops=int(self.flops),
            transcendentals=int(self.transcendentals),
            bytes_accessed=int(self.bytes_accessed),
        )


def visited_tiles(mask: "Mask | None", g: Geometry, B: int) -> tuple[float, bool]:
    """(tiles a kernel of geometry `g` visits per head over B sequences, exact): those the
    block map classifies non-empty (Mask.block_map; without a Mask, g's causal band and
    padding). Where the mask's arrays are concrete (NumPy) the count is exact; where they are
    traced (inside jit, the usual case) only the static part of the mask is known — its
    causal and window band — and the count is an upper bound."""
    mask = Mask.make(causal=g.causal) if mask is None else mask
    arrays = [x for x in jax.tree.leaves(mask) if x is not None]
    exact = all(isinstance(x, np.ndarray) for x in arrays)
    if not exact:
        mask = Mask.make(causal=mask.causal or g.causal, window=mask.window)
    kind = np.asarray(mask.block_map(g.L, g.S, g.bq, g.bk).kind)
    tiles = float((kind != EMPTY).sum())
    return (tiles if kind.shape[0] == B else tiles * B), exact


def tile_cost(
    mask: "Mask | None",
    g: Geometry,
    *,
    B: int,
    H: int,
    widths: int,
    row_bytes: float,
    tile_bytes: float,
    rows: float,
    dynamic: bool = False,
) -> TileCost:
    """A launch's cost over its visited tiles (`visited_tiles`) for H heads: per tile
    2·bq·bk·`widths` FLOPs (`widths`: the sum over the tile's matmuls of the dimension each
    contracts or produces besides the bq×bk score tile, e.g. K + V for the forward's Q·Kᵀ and
    P·V) and bq·bk exponentials; bytes: `tile_bytes` read per visited tile (the other side's
    blocks) plus `row_bytes` per row of its own side, `rows` of them per head (read and
    written once). Softmax max/sum and masking are not counted, as in attention_flops.
    `dynamic`: the kernel's mask has arrays it cannot see at trace time (segment ids,
    lengths), so `mask` is only its static part and the cost an upper bound."""
    tiles, exact = visited_tiles(mask, g, B)
    exact = exact and not dynamic
    per_head = tiles * g.bq * g.bk
    return TileCost(
        flops=2.0 * H * per_head * widths,
        transcendentals=float(H * per_head),
        bytes_accessed=H * (tiles * tile_bytes + B * rows * row_bytes),
        exact=exact,
    )


def launch_cost(
    g: Geometry, mask, dynamic, part: str, B: int, H: int, K: int, V: int, itemsize: int
):
    """One flash-attention launch's TileCost from the tiles it visits (tile_cost), as the
    Pallas kernels (TPU, Triton) lay out their work: `part` fwd, dq or dkv; `dynamic`: the
    mask's arrays are data here, so the count is an upper bound from `mask`, its static
    part. Per tile: forward Q·Kᵀ and P·V (K + V); dQ Q·Kᵀ,
    dO·Vᵀ, dS·K (2K + V); dK/dV Q·Kᵀ, Pᵀ·dO, dO·Vᵀ, dSᵀ·Q (2K + 2V): the backward
    recomputes the scores and dP in both of its kernels."""
    widths = {"fwd": K + V, "dq": 2 * K + V, "dkv": 2 * K + 2 * V}[part]
    if part == "dkv":  # its own side is the keys: read K, V and write dK, dV once per kv head
        rows, row_bytes, tile_bytes = (
            g.n_k * g.bk / g.R,
            2 * itemsize * (K + V),
            g.bq * (itemsize * (K + V) + 8),
        )
    else:  # the queries: read q (and dO, lse, delta), write o or dQ once
        rows, tile_bytes = g.n_q * g.bq, g.bk * itemsize * (K + V)
        row_bytes = itemsize * (K + V) + 4 if part == "fwd" else itemsize * (2 * K + V) + 8
    return tile_cost(
        mask,
        g,
        B=B,
        H=H,
        widths=widths,
        row_bytes=row_bytes,
        tile_bytes=tile_bytes,
        rows=rows,
        dynamic=dynamic,
    )


def check_softcap(softcap) -> float | None:
    """None (no cap) or a positive finite float: what every kernel taking `softcap=` checks. A
    Python or NumPy number, or a concrete 0-d array; the cap is a constant of the program, so
    a traced value is refused."""
    if softcap is None:
        return None
    try:
        if isinstance(softcap, bool | str | bytes) or np.ndim(softcap) != 0:
            raise TypeError
        value = float(softcap)
    except TypeError:  # also jax's ConcretizationTypeError: a traced cap
        raise ValueError(
            f"softcap={softcap!r}: must be a positive number known when tracing (or None: no cap)"
        ) from None
    if not value > 0:
        raise ValueError(f"softcap={softcap!r}: must be a positive number (or None: no cap)")
    if value == float("inf"):
        raise ValueError(f"softcap={softcap!r}: must be finite (None means no cap)")
    return value


# ---------------------------------------------------------------------------- attention sinks


def sink_output(o_BxLxHxV, lse_BxHxL, sinks_H):
    """(output, lse) of a flash kernel with one sink logit per query head folded in
    (fold_sinks): the output times w in float32, back in its dtype; the residuals every
    kernel's unchanged backward takes."""
    w_BxHxL, lse_BxHxL = fold_sinks(lse_BxHxL, sinks_H[None, :, None])
    w_BxLxHx1 = jnp.swapaxes(w_BxHxL, 1, 2)[..., None]
    o_BxLxHxV = (o_BxLxHxV.astype(jnp.float32) * w_BxLxHx1).astype(o_BxLxHxV.dtype)
    return o_BxLxHxV, lse_BxHxL


def with_causal(mask: "Mask | None", causal) -> "Mask":
    """The Mask one kernel call runs: `mask` with the call's `causal` folded in, or `causal`
    alone without a mask. Every implementation takes both and combines them, as `attention`
    does (its `causal` defaults to True and the mask arguments add clauses): the call is
    causal when either says so, so a non-causal masked call passes causal=False. Ignoring
    `causal` beside a mask would drop causality without a word, since it defaults to True."""
    causal = check_flag("causal", causal)
    if mask is None:
        return Mask.make(causal=causal)
    if not isinstance(mask, Mask):
        raise ValueError(f"mask={type(mask).__name__}: expected a Mask (Mask.make) or None")
    return dataclasses.replace(mask, causal=True) if causal and not mask.causal else mask


def kernel_mask(mask: "Mask | None", causal: bool, B: int, L: int, S: int) -> "Mask | None":
    """The Mask a Pallas kernel runs for a call: `mask` checked against the shapes with
    `causal` folded in (`with_causal`), or for a causal call with more queries than keys a
    causal Mask (the Mask path gives its rows with no key 0); None for a plain call."""
    if mask is None and not (check_flag("causal", causal) and L > S):
        return None
    mask = with_causal(mask, causal)
    mask.check(B, L, S)
    return mask


def fold_sinks(lse, sink):
    """(w, lse_sink), both shaped like `lse`: a kernel's output without sinks times w is its
    output with a sink logit per row in the softmax denominator, and lse_sink is that
    denominator's log. Exact, since O_sink = O·Σ_keys/(Σ_keys + e^sink) = O·exp(lse -
    logaddexp(lse, sink)). `lse` follows the kernels' residual convention, +inf for a row that
    sees no key (taken as log 0); lse_sink keeps it for a row with no key and no sink. Fed as
    the residuals (O·w, lse_sink), a kernel's unchanged backward computes exact dQ, dK, dV:
    P = exp(S - lse_sink) are the probabilities with the sink, and delta = Σ dO·O·w."""
    keys = jnp.where(lse == jnp.inf, -jnp.inf, lse)
    both = jnp.logaddexp(keys, sink.astype(jnp.float32))
    w = jnp.where(both == -jnp.inf, 0.0, jnp.exp(keys - both))
    return w, jnp.where(both == -jnp.inf, jnp.inf, both)


def sink_grad(sink, lse_sink, delta):
    """Each row's share of the sink logit's gradient, -P_sink·delta, shaped like `lse_sink`
    (the caller sums it over the rows of each head): d O/d sink = -P_sink·O and d lse/d sink =
    P_sink, so with delta = Σ dO·O - dlse the cotangent is -P_sink·delta."""
    return -jnp.exp(sink.astype(jnp.float32) - lse_sink) * delta


def check_sinks(sinks, H: int):
    """None or one logit per query head, [H] (what every kernel taking `sinks=` checks), as
    an array (a list is taken, as the mask arrays are)."""
    if sinks is None:
        return None
    sinks = jnp.asarray(sinks)
    if tuple(sinks.shape) != (H,):
        raise ValueError(f"{sinks.shape=}: attention sinks are one logit per query head, ({H},)")
    return sinks
