"""Decoding with the key/value cache gives the logits of the full forward pass over the same
tokens: ragged prompts, several steps, scanned and unscanned layers, one device and a 4x2
mesh; the int8 cache and int8 weights within their stated bounds; bad input one line."""

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lab import decode
from lab.config import make_config
from lab.errors import ConfigError
from lab.kernels import cpu_gemv
from lab.kernels.attention import cpu_flash
from lab.mesh import make_mesh, rules_for
from lab.model import build
from lab.resolve import Platform, Request, resolve
from lab.train import make_trainer

PROMPTS = (5, 9, 1, 12)  # ragged prompt lengths (right-padded to 12)
STEPS = 4  # decode steps after the prefill
MAX_LEN = 24


def _setup(mesh="1", strategy="dp", attention="naive", **fields):
    cfg = make_config(
        preset="tiny",
        dtype="float32",
        attention=attention,
        mesh=mesh,
        strategy=strategy,
        batch_size=len(PROMPTS),
        seq_len=MAX_LEN,
        **fields,
    )
    trainer = make_trainer(cfg, make_mesh(cfg.mesh))
    params = trainer.init(jax.random.key(0)).params
    return trainer, params


def _tokens(seed=1):
    """Right-padded prompts and the tokens fed at the decode steps."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, 256, (len(PROMPTS), max(PROMPTS))).astype(np.int32)
    fed = rng.integers(0, 256, (len(PROMPTS), STEPS)).astype(np.int32)
    return prompts, fed


def _decoder(trainer, *, int8_cache=False, max_len=MAX_LEN, matmul="auto"):
    return decode.make_decoder(
        trainer.cfg.model,
        trainer.mesh,
        trainer.rules,
        trainer.state_shardings.params,
        batch=len(PROMPTS),
        max_len=max_len,
        int8_cache=int8_cache,
        matmul=matmul,
    )


def _decoded_logits(trainer, params, *, int8_cache=False, matmul="auto"):
    """[B, STEPS+1, V]: the prefill's next-token logits, then one per decode step."""
    dec = _decoder(trainer, int8_cache=int8_cache, matmul=matmul)
    prompts, fed = _tokens()
    with jax.set_mesh(trainer.mesh):
        lengths = np.asarray(PROMPTS, np.int32)
        logits, cache = dec.prefill(params, prompts, lengths, dec.empty_cache())
        out = [np.asarray(logits)]
        for t in range(STEPS):
            logits, cache = dec.step(params, fed[:, t], cache)
            out.append(np.asarray(logits))
    assert list(np.asarray(cache.lengths)) == [p + STEPS for p in PROMPTS]
    return np.stack(out, axis=1)


def _full_logits(trainer, params):
    """The same positions from the plain forward pass over each whole sequence."""
    prompts, fed = _tokens()
    model = build(trainer.cfg.model)
    rows = []
    for b, p in enumerate(PROMPTS):
        seq = np.concatenate([prompts[b, :p], fed[b]])[None]
        logits = model.apply({"params": jax.device_get(params)}, seq)[0]
        rows.append(np.asarray(logits[p - 1 : p + STEPS]))
    return np.stack(rows)


def test_the_prefill_runs_the_head_on_each_last_token_only():
    """Its logits equal the forward pass's at each prompt's last token (above), and no value
    of its program is as large as [B, P, V]: the head ran on B rows, not B·P."""
    trainer, params = _setup()
    prompts, _ = _tokens()
    B, P = prompts.shape
    model = build(trainer.cfg.model)
    cache = _decoder(trainer).empty_cache()
    fn = functools.partial(decode.prefill, model=model)
    jaxpr = jax.make_jaxpr(fn)(params, prompts, np.asarray(PROMPTS, np.int32), cache)
    sizes = [
        int(np.prod(v.aval.shape))
        for eqn in jaxpr.eqns
        for v in eqn.outvars
        if hasattr(v.aval, "shape")
    ]
    V = trainer.cfg.model.vocab_size
    assert max(sizes) < B * P * V, (max(sizes), B * P * V)


@pytest.mark.parametrize("int8_cache, scan_layers", [(True, True), (False, False)])
def test_a_filled_cache_stands_in_for_a_prefill(int8_cache, scan_layers):
    """Decode benchmarks start from Decoder.filled_cache: the empty cache's shapes, dtypes
    and shardings, the given lengths, random entries that a step reads (its logits differ
    from a zeroed cache's at the same lengths) and stay finite through."""
    trainer, params = _setup(scan_layers=scan_layers)
    dec = _decoder(trainer, int8_cache=int8_cache)
    lengths = np.asarray(PROMPTS, np.int32)
    filled, empty = dec.filled_cache(lengths), dec.empty_cache()
    for a, b in zip(jax.tree.leaves(filled), jax.tree.leaves(empty), strict=True):
        assert (a.shape, a.dtype, a.sharding) == (b.shape, b.dtype, b.sharding)
    np.testing.assert_array_equal(filled.lengths, lengths)
    tokens = _tokens()[1][:, 0]
    with jax.set_mesh(dec.mesh):
        got, after = dec.step(params, tokens, filled)  # donates `filled`
        zeroed, _ = dec.step(params, tokens, empty.replace(lengths=jnp.asarray(lengths)))
    assert np.isfinite(np.asarray(got)).all()
    assert np.abs(np.asarray(got) - np.asarray(zeroed)).max() > 1e-3
    np.testing.assert_array_equal(after.lengths, lengths + 1)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_decoding_equals_the_full_forward_pass(scan_layers):
    trainer, params = _setup(scan_layers=scan_layers)
    got, want = _decoded_logits(trainer, params), _full_logits(trainer, params)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_windowed_softcapped_model_decodes_as_its_forward_pass(scan_layers=True):
    """A local layer of window 4 then a global one (scanned: the window switched per layer),
    soft-capped logits: prefill and each decode step attend to the last 4 tokens in the local
    layer, as the full forward pass does."""
    trainer, params = _setup(
        scan_layers=scan_layers, window=4, window_pattern="local,global", softcap=5.0
    )
    got, want = _decoded_logits(trainer, params), _full_logits(trainer, params)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    plain = dataclasses.replace(trainer.cfg.model, window=0, window_pattern="", softcap=0.0)
    unmasked = _full_logits(types.SimpleNamespace(cfg=types.SimpleNamespace(model=plain)), params)
    assert np.abs(unmasked - want).max() > 1e-3  # the window and cap did change the logits


@pytest.mark.skipif(
    not (cpu_gemv.available() and cpu_flash.available()), reason="the CPU kernels are not built"
)
@pytest.mark.parametrize("tied", [True, False])
def test_the_cpu_kernels_decode_as_the_forward_pass(tied):
    """attention=cpu_flash decodes with the C++ decode kernel, every matmul (the output head
    included: a tied table read in place as [V, D], an untied head [D, V]) through the native
    GEMV: the forward pass's logits within f32 rounding; with the int8 cache within its bound;
    int8 weights (the head too, per-channel) within theirs."""
    trainer, params = _setup(attention="cpu_flash", tie_embeddings=tied)
    assert decode.decode_impl(trainer.cfg.model.attention) == "auto"
    exact = _full_logits(trainer, params)
    np.testing.assert_allclose(_decoded_logits(trainer, params), exact, rtol=1e-5, atol=1e-5)
    got = _decoded_logits(trainer, params, int8_cache=True)
    assert np.abs(got - exact).max() / np.abs(exact).max() < 2e-2
    quantized = decode.quantize(params)
    head = quantized["embed"] if tied else quantized["head"]
    assert head.q.dtype == jnp.int8 and head.scale.shape == ((256, 1) if tied else (1, 256))
    got = _decoded_logits(trainer, quantized, int8_cache=True)
    err = np.abs(got - exact).max() / np.abs(exact).max()
    assert 0 < err < 5e-2, err


def test_decoding_on_a_4x2_mesh_equals_one_device():
    """Batch over data, kv heads over model (tp): the cache sharded like the activations."""
    trainer, params = _setup(mesh="4x2", strategy="tp")
    spec = trainer.state_shardings.params["block_0"]["attn"]["wk"].spec
    assert spec[1] == "model"  # kv heads split: the cache follows them
    got = _decoded_logits(trainer, params)
    one, one_params = _setup()
    np.testing.assert_allclose(got, _full_logits(one, one_params), rtol=1e-5, atol=1e-5)


def test_int8_cache_stays_within_its_bound():
    """Keys and values int8 with a scale per (token, kv head): logits move by < 2e-2 of their
    spread (the cache's error bound is tests/test_quant.py's; here it is end to end)."""
    trainer, params = _setup()
    exact = _full_logits(trainer, params)
    got = _decoded_logits(trainer, params, int8_cache=True)
    assert np.abs(got - exact).max() / np.abs(exact).max() < 2e-2


@pytest.mark.parametrize("matmul", ["auto", "w8a8"])
def test_int8_weights_stay_within_their_bound(matmul):
    """Weight-only (the native CPU kernel where it builds, `auto` on one CPU device) and
    W8A8 (XLA's int8 × int8 → int32 dot, the activations quantized per row too)."""
    trainer, params = _setup()
    exact = _full_logits(trainer, params)
    got = _decoded_logits(trainer, decode.quantize(params), matmul=matmul)
    err = np.abs(got - exact).max() / np.abs(exact).max()
    assert 0 < err < 5e-2, err  # per-channel int8: ~1 % per matmul, a few matmuls deep


def test_auto_matmul_is_the_native_kernel_on_one_cpu_device(monkeypatch):
    mesh = make_mesh(make_config(preset="tiny", mesh="1").mesh)
    want = "native" if cpu_gemv.available() else "xla"
    assert decode.resolve_matmul("auto", mesh) == want
    monkeypatch.setattr(cpu_gemv, "available", lambda: False)
    assert decode.resolve_matmul("auto", mesh) == "xla"
    with pytest.raises(ConfigError, match="matmul=native"):
        decode.matmuls("native")
    with pytest.raises(ValueError, match="choose one of"):
        decode.resolve_matmul("fast", mesh)


def test_sampling_greedy_and_temperature():
    logits = jnp.asarray([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0]])
    assert list(decode.sample(logits, jax.random.key(0), 0.0)) == [1, 0]
    draws = jax.vmap(lambda k: decode.sample(logits[:1], k, 1.0))(
        jax.random.split(jax.random.key(1), 2000)
    )
    share = float(jnp.mean(draws == 1))
    assert abs(share - float(jax.nn.softmax(logits[0])[1])) < 0.05


def test_cache_bytes_count_what_a_step_reads():
    m = make_config(preset="tiny", dtype="float32").model
    cache = decode.cache_shapes(m, batch=2, max_len=16, int8=False)
    per_slot = 2 * m.n_layers * m.n_kv_heads * m.head_dim * 4  # keys and values, f32
    assert decode.cache_bytes(cache) == 2 * 16 * per_slot
    assert decode.cache_bytes(cache, lengths=[3, 5]) == 8 * per_slot
    # a windowed layer (3 slots) reads at most its window: 3 + 3 slots there, 3 + 5 in the other
    assert m.n_layers == 2
    assert decode.cache_bytes(cache, [3, 5], windows=(3, None)) == (6 + 8) * per_slot // 2
    stacked = decode.cache_shapes(
        dataclasses.replace(m, scan_layers=True), batch=2, max_len=16, int8=False
    )
    assert jax.tree.leaves(stacked.layers)[0].ndim == 5  # one stacked LayerKV
    assert decode.cache_bytes(stacked, [3, 5], windows=(3, None)) == (6 + 8) * per_slot // 2
    int8 = decode.cache_shapes(m, batch=2, max_len=16, int8=True)
    scales = 2 * m.n_layers * m.n_kv_heads * 4
    assert decode.cache_bytes(int8, lengths=[3, 5]) == 8 * (per_slot // 4 + scales)


def test_bad_input_is_one_line():
    with pytest.raises(ConfigError, match="does not fit a cache of 24 slots"):
        decode.check_prompts([20, 3], MAX_LEN, steps=8)
    trainer, _ = _setup(mesh="4x2", strategy="tp")
    request = Request.of(mesh="4x2", strategy="tp")
    with pytest.raises(
        ConfigError,
        match=r"batches \[3\] \(of batches= and prefill_batches=.*do not split .*\(4 devices\)",
    ):
        resolve(request, Platform.of_mesh(trainer.mesh), "decode", batches=(4, 8, 3))
    with pytest.raises(AssertionError):  # the builder trusts a resolved batch
        decode.make_decoder(
            trainer.cfg.model,
            trainer.mesh,
            rules_for("tp"),
            trainer.state_shardings.params,
            batch=3,
            max_len=MAX_LEN,
        )


def test_prompts_the_cache_cannot_take_are_one_line():
    """Checks the traced prefill cannot make: padding wider than the cache (XLA's error
    names a gather's slice sizes), and host lengths of 0 or past the padded width."""
    trainer, params = _setup()
    dec = _decoder(trainer, max_len=10)
    prompts, _ = _tokens()  # padded to 12
    lengths = np.asarray(PROMPTS, np.int32)
    with jax.set_mesh(trainer.mesh):
        with pytest.raises(ConfigError, match="padded to 12 tokens do not fit a cache of 10"):
            dec.prefill(params, prompts, lengths, dec.empty_cache())
        for bad in ([0, 3, 5, 7], [4, 3, 5, 9]):
            with pytest.raises(ConfigError, match="each must be 1 to the padded width 8"):
                dec.prefill(params, prompts[:, :8], np.asarray(bad), dec.empty_cache())


def test_a_prefill_into_a_cache_that_holds_tokens_is_nan():
    """Several tokens into a cache are a prefill into an empty one; where the cache already
    holds tokens they would attend only among themselves (no chunked prefill): NaN logits
    there, never logits that look right. An empty sequence beside it is unaffected."""
    trainer, params = _setup()
    model = build(trainer.cfg.model)
    host = jax.device_get(params)
    tokens = np.asarray(_tokens()[0][:2, :4])
    cache = decode.Decoder.empty_cache(_decoder(trainer, max_len=MAX_LEN))
    cache = jax.device_get(cache)
    cache = cache.replace(lengths=np.asarray([4, 0, 0, 0], np.int32)[:2])
    cache = jax.tree.map(lambda a: a[:2], cache)
    logits, _ = model.apply({"params": host}, tokens, cache)
    logits = np.asarray(logits)
    assert np.isnan(logits[0]).all() and np.isfinite(logits[1]).all()


def test_generating_past_the_cache_gives_no_token():
    """A sequence whose cache fills up gets NO_TOKEN, not a made-up token 0, and its length
    stays at the cache's size; the others generate on."""
    trainer, params = _setup()
    dec = decode.make_decoder(
        trainer.cfg.model,
        trainer.mesh,
        trainer.rules,
        trainer.state_shardings.params,
        batch=len(PROMPTS),
        max_len=14,
        steps=4,
    )
    prompts, _ = _tokens()
    with jax.set_mesh(trainer.mesh):
        lengths = np.asarray(PROMPTS, np.int32)
        logits, cache = dec.prefill(params, prompts, lengths, dec.empty_cache())
        tokens, cache = dec.generate(params, logits, cache, jax.random.key(0))
    tokens = np.asarray(tokens)
    # the longest prompt (12 of 14 slots): three tokens are made (two written to the cache,
    # the third's step finds it full), then NO_TOKEN
    made = [min(4, 14 - p + 1) for p in PROMPTS]
    for row, n in zip(tokens, made, strict=True):
        assert (row[:n] >= 0).all() and (row[n:] == decode.NO_TOKEN).all(), tokens
    assert np.asarray(cache.lengths).tolist() == [min(p + 4, 14) for p in PROMPTS]


def test_a_step_reads_the_whole_cache_where_the_reference_decodes():
    """The bytes a decode step reads follow the kernel that runs: the C++ kernel stops at
    each length; a soft-capped or float16 model falls back to the reference, which reads
    every slot."""
    if not cpu_gemv.available():
        pytest.skip("the native CPU kernels are not built here")
    m = make_config(preset="tiny", dtype="float32").model
    assert not decode.reads_whole_cache(m, "cpu")
    assert not decode.reads_whole_cache(m, "cpu", int8_cache=True)
    assert decode.reads_whole_cache(dataclasses.replace(m, softcap=5.0), "cpu")
    assert decode.reads_whole_cache(dataclasses.replace(m, dtype="float16"), "cpu")


@pytest.mark.parametrize("int8_cache", [False, True])
def test_a_step_past_the_cache_never_overwrites_it(int8_cache):
    """A sequence whose cache is full gets NaN logits and keeps its cache as it was; the
    others decode as usual (dynamic_update_slice would clamp and overwrite the last slot)."""
    trainer, params = _setup()
    slots = 13  # the longest prompt (12) fills all but one slot
    dec = _decoder(trainer, int8_cache=int8_cache, max_len=slots)
    prompts, fed = _tokens()
    with jax.set_mesh(trainer.mesh):
        lengths = np.asarray(PROMPTS, np.int32)
        _, cache = dec.prefill(params, prompts, lengths, dec.empty_cache())
        logits, cache = dec.step(params, fed[:, 0], cache)  # slot 12: the last one
        assert np.isfinite(np.asarray(logits)).all()
        before = jax.tree.map(np.asarray, cache.layers)
        logits, after = dec.step(params, fed[:, 1], cache)  # the longest is now full
    full = np.asarray(PROMPTS) + 2 > slots
    assert full.tolist() == [False, False, False, True]
    logits = np.asarray(logits)
    assert np.isnan(logits[full]).all() and np.isfinite(logits[~full]).all()
    for old, new in zip(jax.tree.leaves(before), jax.tree.leaves(after.layers), strict=True):
        np.testing.assert_array_equal(np.asarray(new)[full], old[full])


@pytest.mark.parametrize(
    "fields, backend, want",
    [
        ({}, "tpu", "pallas_tpu (Pallas TPU: reads each sequence's valid blocks)"),
        ({"softcap": 30.0}, "gpu", "pallas_gpu (Pallas Triton: reads each sequence's valid"),
        (
            {"attention": "blockwise"},
            "tpu",
            "reference (plain JAX: reads every cache slot) instead of pallas_tpu: "
            "attention=blockwise decodes with the reference (auto or pallas picks pallas_tpu)",
        ),
        pytest.param(
            {},
            "cpu",
            "cpu (C++: reads each sequence's valid slots)",
            marks=pytest.mark.skipif(not cpu_gemv.available(), reason="cpu kernel not built"),
        ),
        pytest.param(
            {"softcap": 30.0},
            "cpu",
            "reference (plain JAX: reads every cache slot) instead of cpu: the cpu kernel has "
            "no soft-cap (softcap=30)",
            marks=pytest.mark.skipif(not cpu_gemv.available(), reason="cpu kernel not built"),
        ),
        pytest.param(
            {"dtype": "float16"},
            "cpu",
            "reference (plain JAX: reads every cache slot) instead of cpu: the cpu kernel takes "
            "float32 or bfloat16 queries",
            marks=pytest.mark.skipif(not cpu_gemv.available(), reason="cpu kernel not built"),
        ),
    ],
)
def test_the_decode_kernel_line_names_the_kernel_and_why_not_the_preferred(fields, backend, want):
    """lab.serve's header names the decode attention kernel a step runs and, where it is not
    the backend's preferred one, why (a soft-cap or a float16 model leaves the C++ kernel for
    the reference, which reads every cache slot)."""
    model = dataclasses.replace(make_config(preset="tiny", dtype="float32").model, **fields)
    line = decode.decode_kernel_line(model, backend)
    assert line.startswith(want), line
    assert ("instead of" in line) == ("reference" in want)
