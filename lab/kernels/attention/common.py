"""What every attention implementation shares: input checks, padding, the causal convention.

Causal convention (the reference's): query row i may see key column j when
j <= i + (S - L), i.e. the mask is aligned to the bottom-right corner, which is what decoding
with a key/value cache needs. For L == S this is the usual lower triangle. Causal attention
with L > S would leave the first rows with no key at all, so it is refused.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

# A large finite negative instead of -inf: exp(MASK - m) is exactly 0 and never inf - inf = NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


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


def check_qkv(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, *, causal: bool) -> None:
    """Shape rules every implementation needs; raise ValueError naming the broken one."""
    q, k, v = q_BxLxHxK, k_BxSxGxK, v_BxSxGxK
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"{q.shape=} {k.shape=} {v.shape=}: expected [batch, seq, heads, head_dim]"
        )
    if k.shape != v.shape:
        raise ValueError(f"{k.shape=} {v.shape=}: keys and values must have the same shape")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"{q.shape=} {k.shape=}: batch and head_dim of q and k must match")
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"{q.shape=} {k.shape=}: query heads must be a multiple of kv heads "
            "(grouped-query attention)"
        )
    if causal and q.shape[1] > k.shape[1]:
        raise ValueError(
            f"{q.shape=} {k.shape=}: causal attention needs q seq <= kv seq "
            "(bottom-right aligned mask; earlier rows would see no key)"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{q.dtype=} {k.dtype=} {v.dtype=}: q, k, v must share one dtype")


def check_dtype(q_BxLxHxK, allowed: tuple, impl: str) -> None:
    """Kernels support a few dtypes; name them in the error."""
    if q_BxLxHxK.dtype not in [jnp.dtype(d) for d in allowed]:
        names = ", ".join(jnp.dtype(d).name for d in allowed)
        raise ValueError(f"{q_BxLxHxK.dtype=}: impl={impl!r} supports dtypes {names}")


def default_scale(head_dim: int, scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


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
