"""Datasheet figures per accelerator, keyed by JAX's `device_kind`, each with its source.

MFU, "percent of peak" and every *predicted* figure divide a measurement by one of these
numbers, so each number names the document it comes from (`DeviceSpec.sources`). Peaks are
dense (no 2:4 sparsity): NVIDIA datasheets print the sparse figure with an asterisk, and a
JAX matmul never uses sparsity, so the table halves those. An unknown device gets `None`
everywhere: the lab then says "MFU unavailable" instead of guessing.

Units: FLOP/s (or OP/s for int8) per device, bytes, bytes/s. Interconnect figures are the
per-device total the vendor states (NVLink and ICI: both directions added; PCIe: x16 both
directions). Prices are rough on-demand rental rates, one device for one hour, as of the
date in `price_as_of`: enough for "$ per million tokens" to within a factor, not a quote.
"""

import dataclasses
import re
from collections.abc import Mapping

import numpy as np

TERA = 1e12
GB = 1e9  # datasheets use decimal gigabytes for memory size and bandwidth
GIB = 2**30

DTYPES = ("float32", "tf32", "bfloat16", "float16", "float8", "int8")
DTYPE_ALIASES = {
    "f32": "float32",
    "fp32": "float32",
    "float32": "float32",
    "tf32": "tf32",
    "tensorfloat32": "tf32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "f16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float16": "float16",
    "fp8": "float8",
    "f8": "float8",
    "float8": "float8",
    "float8_e4m3fn": "float8",
    "float8_e5m2": "float8",
    "e4m3": "float8",
    "e5m2": "float8",
    "int8": "int8",
    "i8": "int8",
}
NUMERIC_FIELDS = (
    "memory_bytes",
    "memory_bandwidth",
    "interconnect_bandwidth",
    "host_bandwidth",
    "price_usd_per_hour",
)


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One accelerator model as its vendor documents it (per device, dense peaks)."""

    name: str  # marketing name, e.g. "NVIDIA H100 SXM5 80GB"
    vendor: str  # nvidia | amd | google
    peak_flops: Mapping[str, float]  # dtype (see DTYPES) → dense FLOP/s; absent = no figure
    memory_bytes: float  # device memory (HBM/GDDR) in bytes
    memory_bandwidth: float  # device memory bandwidth, bytes/s
    interconnect: str  # name of the device-to-device link
    interconnect_bandwidth: float | None  # bytes/s per device, as stated (see module doc)
    host_bandwidth: float | None  # host link (PCIe) bytes/s, both directions, as stated
    price_usd_per_hour: float | None  # approximate on-demand rental, one device
    price_as_of: str  # when the price was read (YYYY-MM)
    sources: Mapping[str, str]  # field name, or "peak_flops.<dtype>", → where it comes from
    notes: str = ""  # caveats (emulated dtypes, figures the vendor does not publish)

    def source_of(self, field: str) -> str | None:
        """The source of a field: its own entry, else the spec's main datasheet."""
        return self.sources.get(field, self.sources.get("*"))

    def numbers(self) -> dict[str, float]:
        """Every number in the entry, keyed like `sources` (for tests and reports)."""
        out = {f"peak_flops.{k}": v for k, v in self.peak_flops.items()}
        for f in NUMERIC_FIELDS:
            if getattr(self, f) is not None:
                out[f] = getattr(self, f)
        return out


def _tf(**peaks_tflops) -> dict[str, float]:
    return {k: v * TERA for k, v in peaks_tflops.items()}


# --- NVIDIA ----------------------------------------------------------------------------
_H100_DS = "NVIDIA H100 Tensor Core GPU datasheet (2023), dense = sparse/2"
_H200_DS = "NVIDIA H200 Tensor Core GPU datasheet (2024), dense = sparse/2"
_A100_DS = "NVIDIA A100 Tensor Core GPU datasheet (2021), dense = sparse/2"
_V100_DS = "NVIDIA Tesla V100 GPU datasheet (2020)"
_L4_DS = "NVIDIA L4 Tensor Core GPU datasheet (2023), dense = sparse/2"
_T4_DS = "NVIDIA T4 Tensor Core GPU datasheet (2019)"
_ADA_WP = (
    "NVIDIA Ada Lovelace GPU architecture whitepaper v1.1, Appendix A (RTX 4090), FP32 accumulate"
)
_LAMBDA = "Lambda Cloud on-demand price list, 2025 (approximate)"
_MARKET = "typical GPU marketplace on-demand price (RunPod/Vast-style), 2025 (approximate)"
_GCP_GPU = "Google Cloud GPU pricing, us-central1 on-demand, GPU only, 2025 (approximate)"
_PCIE5 = 128 * GB  # PCIe Gen5 x16, both directions
_PCIE4 = 64 * GB
_PCIE3 = 32 * GB

# Volta and Turing have no bf16 or tf32 units: XLA runs bf16 matmuls through fp32 and tf32
# means plain fp32, so those entries repeat the FP32 figure and say so.
_NO_BF16 = "no bf16/tf32 hardware: bf16 and tf32 entries are the FP32 rate (emulated)"


def _h100_sxm() -> DeviceSpec:
    return DeviceSpec(
        name="NVIDIA H100 SXM5 80GB",
        vendor="nvidia",
        peak_flops=_tf(
            float32=67, tf32=494.5, bfloat16=989.5, float16=989.5, float8=1979, int8=1979
        ),
        memory_bytes=80 * GB,
        memory_bandwidth=3350 * GB,
        interconnect="NVLink 4",
        interconnect_bandwidth=900 * GB,
        host_bandwidth=_PCIE5,
        price_usd_per_hour=2.99,
        price_as_of="2025-06",
        sources={"*": _H100_DS + ", SXM column", "price_usd_per_hour": _LAMBDA},
    )


def _h100_pcie() -> DeviceSpec:
    return DeviceSpec(
        name="NVIDIA H100 PCIe 80GB",
        vendor="nvidia",
        peak_flops=_tf(float32=51, tf32=378, bfloat16=756, float16=756, float8=1513, int8=1513),
        memory_bytes=80 * GB,
        memory_bandwidth=2000 * GB,
        interconnect="NVLink bridge (pairs)",
        interconnect_bandwidth=600 * GB,
        host_bandwidth=_PCIE5,
        price_usd_per_hour=2.49,
        price_as_of="2025-06",
        sources={"*": _H100_DS + ", PCIe column", "price_usd_per_hour": _LAMBDA},
    )


def _h100_nvl() -> DeviceSpec:
    return DeviceSpec(
        name="NVIDIA H100 NVL 94GB",
        vendor="nvidia",
        peak_flops=_tf(
            float32=60, tf32=417.5, bfloat16=835.5, float16=835.5, float8=1670.5, int8=1670.5
        ),
        memory_bytes=94 * GB,
        memory_bandwidth=3900 * GB,
        interconnect="NVLink bridge (pairs)",
        interconnect_bandwidth=600 * GB,
        host_bandwidth=_PCIE5,
        price_usd_per_hour=None,
        price_as_of="",
        sources={"*": _H100_DS + ", H100 NVL column"},
    )


def _h200() -> DeviceSpec:
    return DeviceSpec(
        name="NVIDIA H200 SXM 141GB",
        vendor="nvidia",
        peak_flops=_tf(
            float32=67, tf32=494.5, bfloat16=989.5, float16=989.5, float8=1979, int8=1979
        ),
        memory_bytes=141 * GB,
        memory_bandwidth=4800 * GB,
        interconnect="NVLink 4",
        interconnect_bandwidth=900 * GB,
        host_bandwidth=_PCIE5,
        price_usd_per_hour=3.50,
        price_as_of="2025-06",
        sources={"*": _H200_DS + ", H200 SXM column", "price_usd_per_hour": _MARKET},
    )


def _h200_nvl() -> DeviceSpec:
    return DeviceSpec(
        name="NVIDIA H200 NVL 141GB",
        vendor="nvidia",
        peak_flops=_tf(
            float32=60, tf32=417.5, bfloat16=835.5, float16=835.5, float8=1670.5, int8=1670.5
        ),
        memory_bytes=141 * GB,
        memory_bandwidth=4800 * GB,
        interconnect="NVLink bridge (2- or 4-way)",
        interconnect_bandwidth=900 * GB,
        host_bandwidth=_PCIE5,
        price_usd_per_hour=None,
        price_as_of="",
        sources={"*": _H200_DS + ", H200 NVL column"},
    )


def _a100(memory_gb: int, form: str) -> DeviceSpec:
    """A100: same compute for every variant; memory and bandwidth differ by SKU."""
    bandwidth_gb = {(80, "SXM4"): 2039, (80, "PCIe"): 1935}.get((memory_gb, form), 1555)
    price = {80: 1.79, 40: 1.29}[memory_gb] if form == "SXM4" else None
    sources = {"*": _A100_DS + f", A100 {memory_gb}GB {form} column"}
    if price is not None:
        sources["price_usd_per_hour"] = _LAMBDA
    return DeviceSpec(
        name=f"NVIDIA A100 {form} {memory_gb}GB",
        vendor="nvidia",
        peak_flops=_tf(float32=19.5, tf32=156, bfloat16=312, float16=312, int8=624),
        memory_bytes=memory_gb * GB,
        memory_bandwidth=bandwidth_gb * GB,
        interconnect="NVLink 3" if form == "SXM4" else "NVLink bridge (pairs)",
        interconnect_bandwidth=600 * GB,
        host_bandwidth=_PCIE4,
        price_usd_per_hour=price,
        price_as_of="2025-06" if price else "",
        sources=sources,
        notes="no fp8 units",
    )


def _v100(memory_gb: int, form: str) -> DeviceSpec:
    sxm = form == "SXM2"
    fp32, tensor = (15.7, 125) if sxm else (14, 112)
    sources = {
        "*": _V100_DS + f", V100 {form} column",
        "peak_flops.bfloat16": _V100_DS + ": FP32 figure (bf16 emulated, no bf16 units)",
        "peak_flops.tf32": _V100_DS + ": FP32 figure (no tf32 units)",
    }
    if sxm:
        sources["price_usd_per_hour"] = _LAMBDA
    return DeviceSpec(
        name=f"NVIDIA Tesla V100 {form} {memory_gb}GB",
        vendor="nvidia",
        peak_flops=_tf(float32=fp32, tf32=fp32, bfloat16=fp32, float16=tensor),
        memory_bytes=memory_gb * GB,
        memory_bandwidth=900 * GB,
        interconnect="NVLink 2" if sxm else "PCIe",
        interconnect_bandwidth=300 * GB if sxm else 32 * GB,
        host_bandwidth=_PCIE3,
        price_usd_per_hour=0.55 if sxm else None,
        price_as_of="2025-06" if sxm else "",
        sources=sources,
        notes=_NO_BF16,
    )


def _l4() -> DeviceSpec:
    return DeviceSpec(
        name="NVIDIA L4 24GB",
        vendor="nvidia",
        peak_flops=_tf(float32=30.3, tf32=60, bfloat16=121, float16=121, float8=242.5, int8=242.5),
        memory_bytes=24 * GB,
        memory_bandwidth=300 * GB,
        interconnect="PCIe Gen4 (no NVLink)",
        interconnect_bandwidth=_PCIE4,
        host_bandwidth=_PCIE4,
        price_usd_per_hour=0.71,
        price_as_of="2025-06",
        sources={"*": _L4_DS, "price_usd_per_hour": _GCP_GPU + " (g2-standard-4 incl. VM)"},
    )


def _t4() -> DeviceSpec:
    return DeviceSpec(
        name="NVIDIA T4 16GB",
        vendor="nvidia",
        peak_flops=_tf(float32=8.1, tf32=8.1, bfloat16=8.1, float16=65, int8=130),
        memory_bytes=16 * GB,
        memory_bandwidth=320 * GB,
        interconnect="PCIe Gen3 (no NVLink)",
        interconnect_bandwidth=_PCIE3,
        host_bandwidth=_PCIE3,
        price_usd_per_hour=0.35,
        price_as_of="2025-06",
        sources={
            "*": _T4_DS,
            "peak_flops.bfloat16": _T4_DS + ": FP32 figure (bf16 emulated, no bf16 units)",
            "peak_flops.tf32": _T4_DS + ": FP32 figure (no tf32 units)",
            "price_usd_per_hour": _GCP_GPU,
        },
        notes=_NO_BF16,
    )


def _rtx4090() -> DeviceSpec:
    return DeviceSpec(
        name="NVIDIA GeForce RTX 4090 24GB",
        vendor="nvidia",
        peak_flops=_tf(
            float32=82.6, tf32=82.6, bfloat16=165.2, float16=165.2, float8=330.3, int8=660.6
        ),
        memory_bytes=24 * GB,
        memory_bandwidth=1008 * GB,
        interconnect="PCIe Gen4 (no NVLink)",
        interconnect_bandwidth=_PCIE4,
        host_bandwidth=_PCIE4,
        price_usd_per_hour=0.69,
        price_as_of="2025-06",
        sources={"*": _ADA_WP, "price_usd_per_hour": _MARKET},
        notes="GeForce tensor cores run fp16/bf16 at half rate with fp32 accumulation",
    )


# --- AMD -------------------------------------------------------------------------------
_MI300X_DS = "AMD Instinct MI300X accelerator data sheet (2023), dense"


def _mi300x() -> DeviceSpec:
    return DeviceSpec(
        name="AMD Instinct MI300X 192GB",
        vendor="amd",
        peak_flops=_tf(
            float32=163.4, tf32=653.7, bfloat16=1307.4, float16=1307.4, float8=2614.9, int8=2614.9
        ),
        memory_bytes=192 * GB,
        memory_bandwidth=5300 * GB,
        interconnect="Infinity Fabric (7 links)",
        interconnect_bandwidth=896 * GB,
        host_bandwidth=_PCIE5,
        price_usd_per_hour=2.50,
        price_as_of="2025-06",
        sources={"*": _MI300X_DS, "price_usd_per_hour": _MARKET},
        notes="float32 is the matrix-core FP32 figure",
    )


# --- Google TPU ------------------------------------------------------------------------
_TPU_PRICE = "Google Cloud TPU pricing, on-demand per chip-hour, us regions, 2025 (approximate)"
_TPU_NOTE = "float32 matmuls run as several bf16 MXU passes; no datasheet float32 figure"


def _tpu(gen: str, doc: str, *, bf16, int8, mem, bw, ici, price, fp8=None) -> DeviceSpec:
    peaks = {"bfloat16": bf16 * TERA, "int8": int8 * TERA}
    if fp8 is not None:
        peaks["float8"] = fp8 * TERA
    sources = {"*": f"Cloud TPU documentation, '{doc}' system architecture table"}
    if price is not None:
        sources["price_usd_per_hour"] = _TPU_PRICE
    return DeviceSpec(
        name=f"Google Cloud TPU {gen}",
        vendor="google",
        peak_flops=peaks,
        memory_bytes=mem,
        memory_bandwidth=bw * GB,
        interconnect="ICI",
        interconnect_bandwidth=None if ici is None else ici * GB,
        host_bandwidth=None,
        price_usd_per_hour=price,
        price_as_of="2025-06" if price is not None else "",
        sources=sources,
        notes=_TPU_NOTE + ("; the v4 page states no per-chip ICI figure" if ici is None else ""),
    )


SPECS: dict[str, DeviceSpec] = {
    "h100-sxm": _h100_sxm(),
    "h100-pcie": _h100_pcie(),
    "h100-nvl": _h100_nvl(),
    "h200": _h200(),
    "h200-nvl": _h200_nvl(),
    "a100-sxm4-80gb": _a100(80, "SXM4"),
    "a100-sxm4-40gb": _a100(40, "SXM4"),
    "a100-pcie-80gb": _a100(80, "PCIe"),
    "a100-pcie-40gb": _a100(40, "PCIe"),
    "v100-sxm2-16gb": _v100(16, "SXM2"),
    "v100-sxm2-32gb": _v100(32, "SXM2"),
    "v100-pcie-16gb": _v100(16, "PCIe"),
    "v100-pcie-32gb": _v100(32, "PCIe"),
    "l4": _l4(),
    "t4": _t4(),
    "rtx-4090": _rtx4090(),
    "mi300x": _mi300x(),
    "tpu-v4": _tpu("v4", "TPU v4", bf16=275, int8=275, mem=32 * GIB, bw=1200, ici=None, price=3.22),
    "tpu-v5e": _tpu("v5e", "TPU v5e", bf16=197, int8=394, mem=16 * GB, bw=819, ici=400, price=1.20),
    "tpu-v5p": _tpu(
        "v5p", "TPU v5p", bf16=459, int8=918, fp8=459, mem=95 * GIB, bw=2765, ici=1200, price=4.20
    ),
    "tpu-v6e": _tpu(
        "v6e", "TPU v6e", bf16=918, int8=1836, mem=32 * GB, bw=1638, ici=800, price=2.70
    ),
}

# device_kind (normalised: lower case, runs of space/-/_ → one space) → key. First match wins,
# so the more specific patterns come first.
_RULES: tuple[tuple[str, str], ...] = (
    (r"\bgh200\b", ""),  # Grace Hopper: different memory; no entry rather than a wrong one
    (r"\bh200\b.*\bnvl\b", "h200-nvl"),
    (r"\bh200\b", "h200"),
    (r"\bh100\b.*\bnvl\b", "h100-nvl"),
    (r"\bh100\b.*\bpcie\b", "h100-pcie"),
    (r"\bh100\b", "h100-sxm"),  # "NVIDIA H100 80GB HBM3", "H100 SXM5 80GB"
    (r"\ba100\b.*\bpcie\b.*\b80 ?gb\b|\ba100\b.*\b80 ?gb\b.*\bpcie\b", "a100-pcie-80gb"),
    (r"\ba100\b.*\bpcie\b", "a100-pcie-40gb"),
    (r"\ba100\b.*\b80 ?gb\b", "a100-sxm4-80gb"),
    (r"\ba100\b.*\b40 ?gb\b", "a100-sxm4-40gb"),
    (r"\bv100\b.*\bpcie\b.*\b32 ?gb\b", "v100-pcie-32gb"),
    (r"\bv100\b.*\bpcie\b", "v100-pcie-16gb"),
    (r"\bv100\b.*\b32 ?gb\b", "v100-sxm2-32gb"),
    (r"\bv100\b", "v100-sxm2-16gb"),
    (r"\bl4\b", "l4"),
    (r"\bt4\b", "t4"),
    (r"\b4090\b", "rtx-4090"),
    (r"\bmi300x\b", "mi300x"),
    (r"\btpu ?v4\b", "tpu-v4"),
    (r"\btpu ?v5 ?(lite|e|litepod)\b|\btpu ?v5e\b", "tpu-v5e"),
    (r"\btpu ?v5 ?p?\b", "tpu-v5p"),  # "TPU v5" is what a v5p reports
    (r"\btpu ?v6", "tpu-v6e"),  # "TPU v6 lite", "TPU v6e"
)


def normalise(device_kind: str) -> str:
    """'NVIDIA A100-SXM4-80GB' → 'nvidia a100 sxm4 80gb'."""
    return re.sub(r"[\s_\-]+", " ", device_kind.strip().lower())


def lookup_key(device_kind: str) -> str | None:
    """The SPECS key for a JAX device_kind, or None when the lab has no entry."""
    kind = normalise(device_kind)
    for pattern, key in _RULES:
        if re.search(pattern, kind):
            return key or None
    return None


def lookup(device_kind: str) -> DeviceSpec | None:
    """The spec of a JAX `device_kind` ("NVIDIA H100 80GB HBM3", "TPU v5 lite", …) or None."""
    key = lookup_key(device_kind)
    return SPECS[key] if key else None


def canonical_dtype(dtype) -> str:
    """'bf16', jnp.bfloat16, np.float32, 'float8_e4m3fn' … → one of DTYPES (else ValueError)."""
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    canon = DTYPE_ALIASES.get(name.lower())
    if canon is None:
        raise ValueError(f"dtype={dtype!r}: expected one of {', '.join(DTYPES)} (or an alias)")
    return canon


def peak_flops(device_kind: str, dtype) -> float | None:
    """Dense peak FLOP/s of one device at `dtype`, or None (unknown device or no figure).

    "float32" is plain FP32 (CUDA cores, `precision=HIGHEST`); "tf32" is what an NVIDIA GPU
    from Ampere on does for a float32 matmul at JAX's default precision.
    """
    spec = lookup(device_kind)
    if spec is None:
        return None
    return spec.peak_flops.get(canonical_dtype(dtype))
