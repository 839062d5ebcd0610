"""Gradient accumulation (lab/train.py, accumulate=K): K microbatches summed in a lax.scan give
the same update as one batch K times larger (float32 within 1e-5), under data, tensor, context
and fully sharded parallelism and around a pipeline; the gradient is reduced once per step over
the axes that split the batch only; the compiled step's activations shrink as 1/K, and so do
the calculator's."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lab.config import parse_args
from lab.data import host_batch, to_global
from lab.measure.memory import compiled_memory, predict_lab_step
from lab.measure.timing import random_inputs
from lab.mesh import make_mesh
from lab.run import main
from lab.train import accumulated_grad, make_trainer, split_microbatches

TOL = dict(rtol=1e-5, atol=1e-6)  # float32: K partial sums added in another order


def test_split_keeps_each_devices_rows():
    x = jnp.arange(8)
    assert split_microbatches(x, 2).tolist() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # two devices, rows 0-3 and 4-7: each microbatch takes two of each device's rows
    assert sorted(split_microbatches(x, 2)[0, :2].tolist()) == [0, 2]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_accumulated_grad_equals_the_big_batch_gradient(k):
    w, x, y = random_inputs(k, [(6, 3), (16, 6), (16, 3)])

    def loss(w, batch):
        x, y = batch
        err = jnp.tanh(x @ w) - y
        return jnp.mean(err**2), jnp.mean(jnp.abs(err))

    want, aux = jax.grad(loss, has_aux=True)(w, (x, y))
    got, aux_k = jax.jit(lambda w, b: accumulated_grad(loss, w, b, k))(w, (x, y))
    np.testing.assert_allclose(got, want, **TOL)
    np.testing.assert_allclose(aux_k, aux, **TOL)  # equal microbatches: the mean of the means


BASE = [
    "model=tiny",
    "n_layers=4",
    "scan_layers=true",
    "batch_size=16",
    "seq_len=16",
    "dtype=float32",
    "attention=naive",
]


def _keep_gradient():
    """An optimizer whose state is the last gradient (in float32) and whose update is zero:
    the step's gradient itself is compared, not an AdamW update (whose first step, lr 0 in
    warm-up, would hide any gradient)."""
    import optax

    def init(params):
        return jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

    def update(grads, state, params=None):
        return jax.tree.map(jnp.zeros_like, grads), jax.tree.map(
            lambda g: g.astype(jnp.float32), grads
        )

    return optax.GradientTransformation(init, update)


def _one_step(argv):
    """(loss, the gradient) of one step on the same batch."""
    cfg = parse_args([*BASE, *argv])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("lab.train.make_optimizer", lambda cfg: _keep_gradient())
        trainer = make_trainer(cfg, make_mesh(cfg.mesh))
    tokens = to_global(host_batch("text", 0, 0, 16, 16, 256, pack=cfg.pack), trainer.batch_sharding)
    state, metrics = trainer.step(trainer.init(jax.random.key(0)), tokens)
    return float(metrics["loss"]), jax.device_get(state.opt_state)


@pytest.fixture(scope="module")
def whole_batch():
    """The whole batch's gradient on one device, no accumulation."""
    return _one_step(["mesh=1"])


@pytest.mark.parametrize(
    "argv",
    [
        ["mesh=4x2", "strategy=dp", "accumulate=2"],  # each device splits its own rows
        # the gradient summed on each device over data, reduced once; model stays automatic
        ["mesh=4x2", "strategy=tp", "accumulate=4"],
        ["mesh=2x2x2", "strategy=tp", "accumulate=2"],  # data and fsdp both manual
        ["mesh=2x4", "strategy=cp", "accumulate=2"],  # the sequence split, data manual
        ["mesh=2x2x2", "accumulate=2"],  # fsdp+tp: a reduce-scatter per microbatch
        ["mesh=4x2", "accumulate=2", "remat=full"],
        # around the pipeline: K accumulation steps of M pipeline microbatches each
        ["mesh=data:2,stage:4", "accumulate=2", "microbatches=4"],
    ],
)
def test_accumulate_gives_the_same_gradient(whole_batch, argv):
    loss, grads = _one_step(argv)
    np.testing.assert_allclose(loss, whole_batch[0], rtol=1e-5)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(whole_batch[1]), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), **TOL)


@pytest.mark.parametrize("extra", [["param_dtype=bfloat16"], ["data=text", "pack=true"]])
def test_accumulate_in_low_precision_and_packed(extra):
    """bfloat16 weights (the mean over the devices taken in float32: a bfloat16 one stops
    XLA:CPU) and packed documents: the same gradient as one device's whole batch, within
    the dtype's tolerance."""
    want_loss, want = _one_step(["mesh=1", *extra])
    loss, got = _one_step(["mesh=8", "accumulate=2", *extra])
    bf16 = "param_dtype=bfloat16" in extra
    tol = dict(rtol=2e-2, atol=2e-3) if bf16 else TOL
    np.testing.assert_allclose(loss, want_loss, rtol=1e-2 if bf16 else 1e-5)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), **tol)


@pytest.mark.parametrize("mesh", ["8", "4x2"])
def test_the_gradient_is_reduced_once_per_step(mesh):
    """Over the axes that split the batch and no weight the K microbatches' gradients are
    summed on each device and reduced once: as many bytes as accumulate=1 sends (less: a
    tied table's two uses are summed before the reduction, not reduced one by one)."""
    from lab.parallel import explain

    rows = {}
    for k in (1, 4):
        keys = [a for a in BASE if not a.startswith("batch_size=")]
        cfg = parse_args([*keys, "batch_size=32", f"mesh={mesh}", f"accumulate={k}"])
        ex = explain.explain(make_trainer(cfg, make_mesh(cfg.mesh)))
        rows[k] = next(r for r in ex.rows if r.role == "grad reduction")
        assert rows[k].ratio == pytest.approx(1.0, abs=0.05), rows[k]  # the analytic agrees
    assert rows[4].measured_ops == 1  # one all-reduce after the microbatch loop
    assert rows[4].measured_bus_bytes <= rows[1].measured_bus_bytes


def test_activation_memory_falls_as_one_over_k():
    """Compiled temporaries = fixed + A/K: with activations A dominating (naive attention's
    scores), temp(K)/temp(1) ~ 1/K; the calculator divides its activations by K exactly."""
    temps, preds = {}, {}
    for k in (1, 4):
        cfg = parse_args(
            ["batch_size=32", "seq_len=128", "attention=naive", "dtype=float32", f"accumulate={k}"]
        )
        trainer = make_trainer(cfg, make_mesh("1"))
        temps[k] = compiled_memory(trainer.lower().compile())["temp_bytes"]
        preds[k] = predict_lab_step(trainer.cfg, sizes=dict(trainer.mesh.shape), backend="cpu")
    assert 0.25 < temps[4] / temps[1] < 0.35  # 1/4 of the activations, plus what K keeps
    assert preds[4]["activations"] == pytest.approx(preds[1]["activations"] / 4)


def test_bad_accumulate_is_one_line(capsys):
    assert main(["accumulate=3", "batch_size=16", "steps=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "accumulate=3 must divide batch_size=16" in err and len(err.splitlines()) == 1
    assert main(["mesh=8", "accumulate=4", "batch_size=16", "steps=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "batch_size/accumulate=4 rows do not split" in err and len(err.splitlines()) == 1


# --- ahead of time: the activation peak / K on a TPU slice and an H100 ----------------------


def _plan_temps(target: str, mesh: str, layers: int, batch: int, seq: int) -> dict[int, int]:
    from lab.session import open_session

    temps = {}
    for k in (1, 4):
        cfg = parse_args(
            [f"target={target}", f"mesh={mesh}", "model=small", f"n_layers={layers}"]
            + [f"batch_size={batch}", f"seq_len={seq}"]
        )
        cfg = dataclasses.replace(cfg, accumulate=k)
        trainer = open_session(cfg).trainer
        temps[k] = compiled_memory(trainer.lower().compile())["temp_bytes"]
    return temps


@pytest.mark.slow_plan
def test_tpu_plan_activation_peak_falls_with_k():
    """XLA:TPU keeps fewer per-op activations than CPU or GPU, so the float32 accumulator
    K does not divide weighs more: temp falls, by less than 1/K (at K=4, small with one of
    its 4 layers: 0.54 with JAX 0.10's libtpu, 0.62 with JAX 0.12's; at 256 tokens the
    activations no longer decide the peak, 0.995)."""
    pytest.importorskip("libtpu")
    temps = _plan_temps("tpu:v5e:2x4", "8", layers=1, batch=64, seq=512)
    assert temps[4] < 0.8 * temps[1], temps


@pytest.mark.slow_plan
def test_gpu_plan_activation_peak_falls_with_k():
    from lab.plans import gpu

    if gpu._pjrt() is None or gpu.ptxas() is None:
        pytest.skip("the CUDA plugin or ptxas is missing: pip install -e '.[gpu-plan]'")
    temps = _plan_temps("gpu:h100:1", "1", layers=2, batch=32, seq=256)  # 0.33 on both JAX
    assert temps[4] < 0.5 * temps[1], temps
