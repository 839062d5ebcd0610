"""The device-spec table: every JAX device_kind the lab may meet, every number with a source."""

import jax.numpy as jnp
import pytest

from lab.measure import specs

# device_kind as JAX reports it → the entry it must resolve to.
KINDS = {
    "NVIDIA H100 80GB HBM3": "h100-sxm",
    "NVIDIA H100 SXM5 80GB": "h100-sxm",
    "NVIDIA H100 PCIe": "h100-pcie",
    "NVIDIA H100 NVL": "h100-nvl",
    "NVIDIA H200": "h200",
    "NVIDIA H200 NVL": "h200-nvl",
    "NVIDIA A100-SXM4-80GB": "a100-sxm4-80gb",
    "NVIDIA A100-SXM4-40GB": "a100-sxm4-40gb",
    "NVIDIA A100 80GB PCIe": "a100-pcie-80gb",
    "NVIDIA A100-PCIE-40GB": "a100-pcie-40gb",
    "Tesla V100-SXM2-16GB": "v100-sxm2-16gb",
    "Tesla V100-SXM2-32GB": "v100-sxm2-32gb",
    "Tesla V100-PCIE-32GB": "v100-pcie-32gb",
    "NVIDIA L4": "l4",
    "Tesla T4": "t4",
    "NVIDIA GeForce RTX 4090": "rtx-4090",
    "AMD Instinct MI300X": "mi300x",
    "TPU v4": "tpu-v4",
    "TPU v5 lite": "tpu-v5e",
    "TPU v5e": "tpu-v5e",
    "TPU v5": "tpu-v5p",
    "TPU v5p": "tpu-v5p",
    "TPU v6 lite": "tpu-v6e",
    "TPU v6e": "tpu-v6e",
}


@pytest.mark.parametrize("kind, key", KINDS.items())
def test_lookup_of_known_kinds(kind, key):
    assert specs.lookup_key(kind) == key
    assert specs.lookup(kind) is specs.SPECS[key]
    # Robust to case, dashes and stray spaces.
    assert specs.lookup_key(f"  {kind.upper().replace(' ', '-')} ") == key


@pytest.mark.parametrize(
    "kind", ["cpu", "Host", "NVIDIA L40S", "NVIDIA GH200 480GB", "TPU v7x", "NVIDIA B200", ""]
)
def test_unknown_kinds_give_none_not_a_guess(kind):
    assert specs.lookup(kind) is None
    assert specs.peak_flops(kind, "bfloat16") is None


@pytest.mark.parametrize("key", specs.SPECS)
def test_every_number_has_a_source(key):
    spec = specs.SPECS[key]
    numbers = spec.numbers()
    assert "memory_bytes" in numbers and "memory_bandwidth" in numbers
    for field, value in numbers.items():
        assert value > 0, (key, field)
        source = spec.source_of(field)
        assert source and len(source) > 10, (key, field)
    if spec.price_usd_per_hour is not None:
        assert "price_usd_per_hour" in spec.sources  # prices never borrow the datasheet
        assert spec.price_as_of


@pytest.mark.parametrize("key", specs.SPECS)
def test_peaks_are_dense_and_ordered(key):
    peaks = specs.SPECS[key].peak_flops
    assert set(peaks) <= set(specs.DTYPES)
    assert "bfloat16" in peaks
    if "float32" in peaks:
        assert peaks["float32"] <= peaks.get("tf32", peaks["float32"]) <= peaks["bfloat16"]
    if "float8" in peaks:
        assert peaks["float8"] >= peaks["bfloat16"]
    assert max(peaks.values()) < 5e15  # no sparse (2:4) figure slipped in for these parts


def test_figures_the_articles_quote():
    """CLAIMS C05: V100 125, A100 312, H100 989, H200 989 dense fp16 TFLOP/s."""
    tflops = lambda kind: specs.peak_flops(kind, "float16") / 1e12
    assert tflops("Tesla V100-SXM2-16GB") == 125
    assert tflops("NVIDIA A100-SXM4-80GB") == 312
    assert tflops("NVIDIA H100 80GB HBM3") == pytest.approx(989.5)
    assert tflops("NVIDIA H200") == pytest.approx(989.5)
    assert specs.lookup("NVIDIA H200").memory_bytes == 141e9
    assert specs.lookup("NVIDIA H100 80GB HBM3").interconnect_bandwidth == 900e9


@pytest.mark.parametrize(
    "alias, want",
    [
        ("bf16", "bfloat16"),
        (jnp.bfloat16, "bfloat16"),
        (jnp.float32, "float32"),
        ("fp16", "float16"),
        ("float8_e4m3fn", "float8"),
        (jnp.float8_e5m2, "float8"),
        ("TF32", "tf32"),
        ("int8", "int8"),
    ],
)
def test_dtype_aliases(alias, want):
    assert specs.canonical_dtype(alias) == want


def test_bad_dtype_and_missing_figures():
    with pytest.raises(ValueError, match="dtype"):
        specs.peak_flops("NVIDIA H100 PCIe", "float64")
    assert specs.peak_flops("NVIDIA A100-SXM4-80GB", "float8") is None  # no fp8 on Ampere
    assert specs.peak_flops("TPU v5 lite", "float32") is None  # no datasheet f32 figure
    assert specs.peak_flops("TPU v5 lite", "bf16") == 197e12
