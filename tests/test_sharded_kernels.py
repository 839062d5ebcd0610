"""Hand-written shard_map kernels equal the plain jit computation, forward and gradient:
the collective matmul, ring attention, and attention=ring inside the model (strategy=cp)."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lab.config import ConfigError, ModelConfig
from lab.kernels.attention import attention_reference
from lab.kernels.attention.ring import block_attention, combine, ring_attention
from lab.kernels.collective_matmul import collective_matmul, gathered_matmul, matmul_reference
from lab.measure.timing import random_inputs
from lab.mesh import make_mesh, rules_for
from lab.model import build

TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5)}


def _close(got, want, dtype=jnp.float32):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), **TOL[dtype])


def _value_and_grads(fn, *args):
    """Output and the gradient of a random-weighted sum of it (one compile: forward + vjp)."""
    shape = jax.eval_shape(fn, *args).shape
    weights = random_inputs(99, [shape])[0]

    @jax.jit
    def both(*a):
        out, vjp = jax.vjp(fn, *a)
        return out, vjp(weights)

    return both(*args)


@pytest.mark.parametrize(
    "mesh_spec, axis, M, K, N", [("2x4", "model", 32, 16, 24), ("8", "data", 64, 8, 64)]
)
def test_collective_matmul_equals_jit(mesh_spec, axis, M, K, N):
    mesh = make_mesh(mesh_spec)
    x_MxK, w_KxN = random_inputs(M + N, [(M, K), (K, N)])
    ring = functools.partial(collective_matmul, mesh=mesh, axis=axis)
    _close(_value_and_grads(ring, x_MxK, w_KxN), _value_and_grads(matmul_reference, x_MxK, w_KxN))
    plain = functools.partial(gathered_matmul, mesh=mesh, axis=axis)
    _close(jax.jit(plain)(x_MxK, w_KxN), matmul_reference(x_MxK, w_KxN))


def test_collective_matmul_rejects_indivisible_shapes():
    with pytest.raises(ValueError, match="divisible by model=4"):
        collective_matmul(jnp.ones((6, 4)), jnp.ones((4, 8)), mesh=make_mesh("2x4"), axis="model")


def test_collective_matmul_sends_a_ring_of_permutes_not_a_gather():
    from lab.parallel import collectives_hlo

    mesh = make_mesh("2x4")
    x_MxK, w_KxN = random_inputs(0, [(32, 16), (16, 24)])
    fn = jax.jit(functools.partial(collective_matmul, mesh=mesh, axis="model"))
    kinds = {c.kind for c in collectives_hlo.from_compiled(fn.lower(x_MxK, w_KxN).compile(), mesh)}
    assert kinds == {"collective-permute"}


def test_combining_partial_softmaxes_is_exact():
    q, k, v = random_inputs(3, [(1, 8, 2, 4), (1, 16, 2, 4), (1, 16, 2, 4)])
    part = functools.partial(block_attention, causal=False, scale=0.5)

    @jax.jit
    def split_in_two(q, k, v):
        o_a, lse_a = part(q, k[:, :5], v[:, :5])
        o_b, lse_b = part(q, k[:, 5:], v[:, 5:])
        return combine(o_a, lse_a, o_b, lse_b)[0]

    _close(split_in_two(q, k, v), attention_reference(q, k, v, causal=False, scale=0.5))


@pytest.mark.parametrize("causal", [True, False])
def test_flash_lse_and_its_gradient_equal_the_plain_log_sum_exp(causal):
    """The local block's LSE output is differentiable: a loss on both outputs has the
    gradient of the same loss computed the plain way (scores in full, logsumexp)."""
    from lab.kernels.attention import blockwise

    q, k, v = random_inputs(5, [(2, 24, 4, 8), (2, 40, 2, 8), (2, 40, 2, 8)])
    w_o, w_lse = random_inputs(6, [(2, 24, 4, 8), (2, 24, 4)])
    tiles = blockwise.BlockSizes(8, 16)

    def flash(q, k, v):
        o, lse = blockwise.blockwise_attention_with_lse(q, k, v, causal=causal, block_sizes=tiles)
        return o, lse

    def plain(q, k, v):
        s = jnp.einsum("blhd,bshd->bhls", q, jnp.repeat(k, 2, axis=2)) / jnp.sqrt(8.0)
        if causal:
            L, S = s.shape[-2:]
            s = jnp.where(jnp.arange(S)[None, :] <= jnp.arange(L)[:, None] + S - L, s, -1e30)
        lse = jax.nn.logsumexp(s, axis=-1)
        o = jnp.einsum("bhls,bshd->blhd", jnp.exp(s - lse[..., None]), jnp.repeat(v, 2, axis=2))
        return o, jnp.moveaxis(lse, 1, 2)

    loss = lambda f: lambda *a: jnp.sum(f(*a)[0] * w_o) + jnp.sum(f(*a)[1] * w_lse)
    _close(flash(q, k, v), plain(q, k, v))
    got = jax.grad(loss(flash), argnums=(0, 1, 2))(q, k, v)
    _close(got, jax.grad(loss(plain), argnums=(0, 1, 2))(q, k, v))


@pytest.mark.parametrize(
    "mesh_spec, seq_axis, batch_axes, shapes, causal",
    [
        ("2x4", "model", "data", (2, 32, 4, 2, 8), True),  # B, L, H, G (grouped-query), K
        ("8", "data", None, (1, 64, 2, 2, 16), True),
        ("4x2", "model", "data", (4, 16, 6, 3, 8), False),
    ],
)
def test_ring_attention_equals_reference(mesh_spec, seq_axis, batch_axes, shapes, causal):
    B, L, H, G, K = shapes
    mesh = make_mesh(mesh_spec)
    q, k, v = random_inputs(L + H, [(B, L, H, K), (B, L, G, K), (B, L, G, K)])
    ring = functools.partial(
        ring_attention, mesh=mesh, seq_axis=seq_axis, batch_axes=batch_axes, causal=causal
    )
    ref = functools.partial(attention_reference, causal=causal)
    _close(_value_and_grads(ring, q, k, v), _value_and_grads(ref, q, k, v))


def test_ring_attention_rejects_indivisible_length():
    q = jnp.ones((1, 6, 2, 4))
    with pytest.raises(ValueError, match="divisible by model=4"):
        ring_attention(q, q, q, mesh=make_mesh("2x4"), seq_axis="model")


def _model_loss(cfg: ModelConfig, mesh, strategy: str, tokens_BxL, params=None):
    """Loss and parameter gradients of the model, traced under the mesh and rules like train."""
    model = build(cfg)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules_for(strategy)):
        if params is None:
            params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), tokens_BxL)["params"])

        def loss(p):
            logits = model.apply({"params": p}, tokens_BxL)
            return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

        return params, jax.jit(jax.value_and_grad(loss))(params)


def test_model_with_ring_attention_equals_naive():
    mesh = make_mesh("2x4")
    base = ModelConfig(d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, dtype="float32")
    tokens_BxL = jax.random.randint(jax.random.key(1), (2, 32), 0, 256)
    params, want = _model_loss(dataclasses.replace(base, attention="naive"), mesh, "dp", tokens_BxL)
    ring_cfg = dataclasses.replace(base, attention="ring")
    _, got = _model_loss(ring_cfg, mesh, "cp", tokens_BxL, params)
    _close(got, want)


def test_ring_attention_needs_the_cp_strategy():
    """A rule between keys: refused when the request is resolved, not when it is parsed."""
    from lab.resolve import Platform, Request, resolve

    platform = Platform.of_mesh(make_mesh("2x4"))
    with pytest.raises(ConfigError, match="strategy=cp"):
        resolve(Request.parse(["attention=ring", "mesh=2x4"]), platform)
    ok = resolve(Request.parse(["attention=ring", "mesh=2x4", "strategy=cp"]), platform)
    assert ok.cfg.strategy == "cp" and ok.cfg.model.attention == "ring"


def test_collective_matmul_command(capsys, tmp_path):
    import json

    from lab.tools import collective_matmul

    argv = ["mesh=2x4", "size=256", "budget=0.01", f"out_dir={tmp_path}"]
    assert collective_matmul.main(argv) == 0
    out = capsys.readouterr().out
    assert "over model=4" in out and "collective matmul" in out
    err = float(out.split("max |ring - jnp| = ")[1].split(",")[0])
    gathered = float(out.split("max |all-gather then matmul - jnp| = ")[1].split()[0])
    assert err < 1e-3 and gathered < 1e-3  # both products checked, as the help says
    # results are data: both times, both errors and the ratio as records
    (path,) = tmp_path.glob("collective-matmul-*.jsonl")
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    whats = {(r["what"], r["config"]["impl"], r["label"]) for r in recs}
    ring, gather = "collective matmul (ring)", "all-gather then matmul"
    assert whats == {
        ("collective matmul time", ring, "measured"),
        ("collective matmul time", gather, "measured"),
        ("collective matmul max abs error", ring, "measured"),
        ("collective matmul max abs error", gather, "measured"),
        (f"collective matmul time ratio vs {gather}", ring, "derived"),
    }
    assert all(r["config"]["size"] == 256 and r["config"]["simulated_devices"] for r in recs)
    assert collective_matmul.main(["mesh=2x4", "size=250"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: size=250: x's rows and w's columns split over model=4, so size must be a "
        "multiple of 4 (e.g. size=248)"
    )
    assert collective_matmul.main(["mesh=2x4", "size=1000000"]) == 2  # 4 TB of f32: refused
    assert "GiB, and 8 simulated devices share" in capsys.readouterr().err


def test_collective_matmul_command_says_where_it_is_and_that_the_host_is_busy(
    capsys, tmp_path, monkeypatch
):
    """It was silent for ~9 s (two compiles, then the timing): a line as each part starts,
    and, as every timing tool, a note before it times on a busy host."""
    from lab.measure import records
    from lab.tools import collective_matmul

    monkeypatch.setattr(records, "busy_host", lambda: (3.5, 2))
    argv = ["mesh=2x4", "size=64", "budget=0.01", f"out_dir={tmp_path}"]
    assert collective_matmul.main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "host load average 3.5 on 2 cores: other work shares them" in out, out
    for i, part in enumerate(["checking the ring", "checking all-gather", "timing both"]):
        assert part in out and f"({i}/3 done" in out, out
    assert out.index("host load") < out.index("checking the ring") < out.index("max |ring")


@pytest.mark.parametrize("impl", ["blockwise", "cpu_flash"])
def test_the_kernels_run_inside_a_users_checked_shard_map(impl):
    """Called inside shard_map(check_vma=True) with per-device segment ids: the loop carries
    and the FFI call's outputs are typed as varying like their inputs, and forward and
    gradients equal the plain call's."""
    from lab.kernels.attention import attention
    from lab.kernels.attention import cpu_flash as cf

    if impl == "cpu_flash" and not cf.available():
        pytest.skip("no C++ compiler here")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    q, k, v = random_inputs(3, [(4, 24, 4, 32), (4, 24, 2, 32), (4, 24, 2, 32)])
    seg = jnp.asarray(np.repeat(np.arange(3), 8)[None].repeat(4, 0), jnp.int32)

    def call(q, k, v, seg):
        return attention(q, k, v, impl=impl, q_segment_ids=seg)

    spec = jax.sharding.PartitionSpec("data")
    sharded = jax.shard_map(call, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=True)
    got = _value_and_grads(lambda q, k, v: sharded(q, k, v, seg), q, k, v)
    want = _value_and_grads(lambda q, k, v: call(q, k, v, seg), q, k, v)
    _close(got, want)


@pytest.mark.parametrize("impl", ["blockwise", "cpu_flash"])
def test_replicated_inputs_get_summed_gradients_inside_a_checked_shard_map(impl):
    """Keys, values and sinks replicated while the queries split along the sequence (no mask:
    each shard's rows see every key): each replicated input's gradient is the sum of every
    device's, as the plain call's is."""
    from lab.kernels.attention import attention
    from lab.kernels.attention import cpu_flash as cf

    if impl == "cpu_flash" and not cf.available():
        pytest.skip("no C++ compiler here")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    q, k, v, sinks = random_inputs(5, [(2, 32, 4, 16), (2, 24, 2, 16), (2, 24, 2, 16), (4,)])

    def call(q, k, v, sinks):
        return attention(q, k, v, impl=impl, causal=False, sinks=sinks)

    P = jax.sharding.PartitionSpec
    specs = (P(None, "data"), P(), P(), P())
    sharded = jax.shard_map(call, mesh=mesh, in_specs=specs, out_specs=specs[0], check_vma=True)
    _close(_value_and_grads(sharded, q, k, v, sinks), _value_and_grads(call, q, k, v, sinks))
