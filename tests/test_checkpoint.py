"""The checksums a checkpoint keeps of every array: any one changed word changes them, words
that trade places change them, and a sharded array sums to the same numbers as the whole one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from lab import checkpoint


def _state(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(rng.normal(size=(16, 24)), jnp.float32),
        "emb": jnp.asarray(rng.normal(size=(32, 8)), jnp.bfloat16),
        "step": jnp.asarray(rng.integers(1, 100), jnp.int32),
        "q": jnp.asarray(rng.integers(-128, 127, size=(5, 7)), jnp.int8),
        "mask": jnp.asarray(rng.random((9,)) < 0.5),
        "key": jax.random.key(int(rng.integers(1000))),
    }


def test_every_leaf_has_two_sums_keyed_by_its_path():
    sums = checkpoint.fingerprint(_state())
    assert set(sums) == {"w", "emb", "step", "q", "mask", "key"}
    assert all(len(v) == 2 and all(0 <= x < 2**32 for x in v) for v in sums.values())
    assert checkpoint.fingerprint(_state()) == sums  # the same values, the same sums
    assert checkpoint.fingerprint(_state(1)) != sums


@pytest.mark.parametrize("leaf", ["w", "emb", "step", "q", "mask"])
def test_one_changed_word_changes_both_sums(leaf):
    state = _state()
    x = np.asarray(state[leaf]).copy().reshape(-1)
    i = len(x) // 2
    if x.dtype == np.bool_:
        x[i] = ~x[i]
    else:  # one bit of one value: the smallest damage a disk or a copy can do
        bits = x.view(np.dtype(f"u{x.dtype.itemsize}"))
        bits[i] ^= 1 << (x.dtype.itemsize * 8 - 2)
    changed = {**state, leaf: jnp.asarray(x.reshape(np.shape(state[leaf])), state[leaf].dtype)}
    before, after = checkpoint.fingerprint(state), checkpoint.fingerprint(changed)
    key = leaf
    assert before[key][0] != after[key][0] and before[key][1] != after[key][1]
    assert all(before[k] == after[k] for k in before if k != key)


def test_two_values_that_trade_places_change_the_weighted_sum():
    state = _state()
    w = np.asarray(state["w"]).copy()
    w[[0, 1]] = w[[1, 0]]
    swapped = checkpoint.fingerprint({**state, "w": jnp.asarray(w)})["w"]
    before = checkpoint.fingerprint(state)["w"]
    assert swapped[0] == before[0] and swapped[1] != before[1]


def test_a_sharded_array_sums_as_the_whole_one():
    devices = np.array(jax.devices()[:8]).reshape(4, 2)
    mesh = jax.sharding.Mesh(devices, ("data", "model"))
    state = _state()
    sharded = jax.device_put(state["w"], NamedSharding(mesh, PartitionSpec("data", "model")))
    assert checkpoint.fingerprint({"w": sharded}) == checkpoint.fingerprint({"w": state["w"]})
    # and the flat position, not a shard's own, weights each word
    w = np.asarray(state["w"]).reshape(-1).view(np.uint32).astype(np.uint64)
    weighted = int((w * (2 * np.arange(w.size, dtype=np.uint64) + 1)).sum() % 2**32)
    assert checkpoint.fingerprint({"w": sharded})["w"] == [int(w.sum() % 2**32), weighted]


@pytest.mark.parametrize("leaf", ["w", "emb", "step", "q", "mask"])
def test_the_host_sums_are_the_device_sums(leaf):
    """A checkpoint saved on one backend is checked on another: NumPy's sums (arrays in host
    memory) and XLA's (any device) must be the same two numbers."""
    x = _state()[leaf]
    big = jnp.tile(x.reshape(-1), 3000)  # past one NumPy chunk of 2**20 words
    for y in (x, big):
        assert checkpoint._host_sums(y, chunk=1000) == [int(v) for v in checkpoint._sums(y)]


def test_a_step_of_a_model_with_other_arrays_is_another_model_not_damage(tmp_path):
    """Another layer count saves other arrays, not other shapes: named as another model in
    one line, nothing moved (orbax's tree mismatch had set the step aside as damaged, its
    reason cut at a colon)."""
    import jax
    import numpy as np
    import pytest

    from lab import checkpoint
    from lab.errors import ConfigError

    three = {"params": {f"block_{i}": np.ones((2,), np.float32) for i in range(3)}}
    saver = checkpoint.Saver(checkpoint.manager(tmp_path))
    saver.save(1, three)
    saver.finish()
    two = {"params": {f"block_{i}": np.ones((2,), np.float32) for i in range(2)}}
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])
        ),
        two,
    )
    with pytest.raises(ConfigError, match=r"params\.block_2: saved, not in this model"):
        checkpoint.restore_latest(tmp_path, abstract, warn=pytest.fail)
    assert checkpoint.saved_steps(tmp_path) == [1]


def test_importing_the_training_modules_leaves_the_programs_logging_alone():
    """orbax logs through absl when imported, and absl's first log call configures the root
    logger, after which a program's own logging.basicConfig does nothing: orbax is imported
    where a checkpoint is first saved or read, not with the modules a program imports."""
    import os
    import subprocess
    import sys

    code = (
        "import logging, sys; import lab.train, lab.session, lab.loop; "
        "assert 'orbax' not in sys.modules, 'orbax imported'; "
        "logging.basicConfig(level=logging.INFO, format='MINE %(message)s'); "
        "logging.getLogger('user').info('hello')"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == ["MINE hello"]
