"""The articles' claims as data: each one's words, source and the range its numbers state.

A verdict (lab/report/verdict.py) holds a measured record against a `Stated` range and
nothing else, so every number an article gives lives here, next to its quote and a
`reading` that says how the words became the range ("about 100 million" → 10^8 ± 25%).
Nothing in this file is a measurement: the records supply those.

`Stated.backends` says on which backends a measurement tests the statement (a CPU cannot test
a Tensor Core claim; it records context and the verdict is `n/a here` or `predicted`).
`Stated.devices` narrows a statement to device kinds ("H100 ≈ 989 TFLOP/s"), each with its
own range; a record's device is its `config.target` (for predictions) or its `device_kind`.
"multi" is the backend of figures `python -m experiments.compare` derives from several
backends' results at once (C19).
"""

import dataclasses
from collections.abc import Mapping

ANY = ("cpu", "gpu", "tpu")
ACCELERATORS = ("gpu", "tpu")
MULTI = ("multi",)

SOURCES = {
    "000": ("000_11bfd57a11da9521.txt", "GPUs: The Beating Heart of Modern AI"),
    "001": ("001_555f5de6b326698d.txt", "Technically: GPU (Graphics Processing Unit)"),
    "002": ("002_fc77c3c20f87570a.txt", "Phase 5: GPU & Hardware for AI"),
    "003": ("003_895493ce92ecf1b5.txt", "GPU Crash Course: Why AI Can't Live Without It"),
}

# experiments/<topic>.py → section title of the report, in report order.
TOPICS = {
    "matmul": "Matrix multiply: FLOPs, precision, peak",
    "roofline": "Roofline: compute against memory and links",
    "attention": "Attention: naive against flash",
    "memory": "Training memory",
    "parallel": "Parallelism",
    "training": "Training speed and cost",
    "inference": "Inference",
    "hardware": "The hardware itself",
    "prediction": "Prediction: the step-time model against published measurements",
}


def about(x: float, factor: float = 1.25) -> dict:
    """'about x' as a range: x/factor … x·factor."""
    return {"lo": x / factor, "hi": x * factor}


@dataclasses.dataclass(frozen=True)
class Stated:
    """One number or direction an article states, as the range a measurement must fall in."""

    metric: str  # the key experiments put in a record's config["metric"]
    quote: str  # the article's words
    source: str  # seed id(s), e.g. "000" or "001, 003"
    unit: str  # unit of the range and of the records
    lo: float | None = None  # lowest value that agrees with the words (None: unbounded)
    hi: float | None = None  # highest value that agrees (None: unbounded)
    strict: bool = False  # bounds exclusive: "less than", "above"
    backends: tuple[str, ...] = ANY  # where a measurement tests the words
    devices: Mapping[str, tuple[float | None, float | None]] | None = None  # kind → (lo, hi)
    reading: str = ""  # how the words became this range and what is measured
    if_off: str = ""  # the likely reason when a measurement falls outside
    name: str = ""  # a few words for the figure, beside it where the range is not shown

    def range_for(self, device: str | None) -> tuple[float | None, float | None] | None:
        """(lo, hi) for a device kind, or None when the statement says nothing about it."""
        if self.devices is None:
            return self.lo, self.hi
        name = normalise(device or "")
        for pattern, bounds in self.devices.items():
            if pattern in name.split() or pattern in name.replace(" ", ""):
                return bounds
        return None


def normalise(device_kind: str) -> str:
    """'NVIDIA H100 80GB HBM3' → 'nvidia h100 80gb hbm3' (the spec table's convention)."""
    return " ".join(device_kind.lower().replace("-", " ").replace("_", " ").split())


@dataclasses.dataclass(frozen=True)
class Claim:
    id: str  # C01 … C22, as in ../shared/CLAIMS.md
    text: str  # the claim as the articles state it
    sources: tuple[str, ...]  # seed ids
    topic: str  # experiments module that measures it (a key of TOPICS)
    measure: str  # what the lab measures for it
    stated: tuple[Stated, ...]  # the parts a verdict is computed from


def _r(x: float, factor: float = 1.25) -> tuple[float, float]:
    d = about(x, factor)
    return d["lo"], d["hi"]


CLAIMS: tuple[Claim, ...] = (
    Claim(
        "C01",
        'A 10,000×10,000 matrix multiply is "100 million operations"; GPUs give a '
        '"100-500x speedup" over CPUs on it',
        ("000",),
        "matmul",
        "FLOPs the compiler counts for the 10,000² matmul; FLOP/s of the same jitted matmul on "
        "CPU and accelerator; their ratio",
        (
            Stated(
                "matmul_10k_flops",
                "Multiplying a 10,000×10,000 matrix? That's 100 million operations.",
                "000",
                "FLOP",
                **about(1e8),
                reading="'100 million' read as 10^8 ± 25%; an operation is one multiply or one "
                "add (the FLOP convention); the count is XLA's cost analysis of the compiled "
                "matmul (the optimized HLO counted where a backend's analysis gives none)",
                if_off="10^8 = n² is the number of entries of the result; each entry is a dot "
                "product of n multiply-adds, so the product costs 2·n³ FLOPs",
                name="FLOPs of a 10k² matmul",
            ),
            Stated(
                "gpu_cpu_matmul_speedup",
                "GPUs do thousands simultaneously. The result: 100-500x speedup.",
                "000",
                "×",
                lo=100,
                hi=500,
                backends=("gpu",),  # "GPUs": a TPU's ratio is shown beside it, judging nothing
                reading="FLOP/s of the same jitted float32 matmul on the GPU over the host CPU "
                "of the same machine; a TPU's ratio is shown as context: the words are about "
                "GPUs",
                if_off="the ratio depends on which CPU and which units: a datacenter GPU's "
                "Tensor Cores against a few CPU cores is far above 500×, fp32 CUDA cores "
                "against a many-core server CPU can be below 100×",
                name="GPU ÷ CPU matmul speed",
            ),
        ),
    ),
    Claim(
        "C02",
        "GPUs are ~100× faster than CPUs for training; a BERT that trains in 2 min on a T4 "
        "takes ~3 h on CPU",
        ("002",),
        "training",
        "training tokens/s of the same model on CPU vs accelerator",
        (
            Stated(
                "gpu_cpu_train_speedup",
                "GPUs can do this 100× faster than CPUs … Training a BERT model that takes 2 "
                "minutes on a T4 would take ~3 hours on CPU.",
                "002",
                "×",
                lo=60,
                hi=150,
                backends=("gpu",),  # "GPUs … a T4": a TPU's ratio is shown beside it
                reading="'100×' and 3 h / 2 min = 90× read as 60–150×: training tokens/s of the "
                "lab's transformer on a GPU over the CPU, the same step (one machine's, or two "
                "folders' merged by experiments.compare); a TPU's ratio is shown as context "
                "and judges nothing: the words are about GPUs; where no GPU is present, "
                "predicted: this CPU's measured step time over the "
                "step time the step-time model predicts for the same step compiled for an H100 "
                "(plans=on). A datasheet peak over this CPU's matmul peak is shown as context "
                "only: a ratio of peaks says nothing of either processor's MFU on the step",
                name="GPU ÷ CPU training speed",
            ),
        ),
    ),
    Claim(
        "C03",
        "Tensor Cores are 8–16× (002) or 8× (003) faster than plain CUDA cores",
        ("002", "003"),
        "matmul",
        "matmul FLOP/s at fp32 with full precision (no TF32) vs tf32 vs bf16/fp16 on one device",
        (
            Stated(
                "tensor_core_speedup",
                "Tensor Cores … are 8–16× faster than standard CUDA cores (002); on the same "
                "H100, Tensor Cores are 8× faster than CUDA Cores (003).",
                "002, 003",
                "×",
                lo=8,
                hi=16,
                backends=("gpu",),
                reading="bf16 matmul FLOP/s (Tensor Cores) over float32 matmul FLOP/s at "
                "precision=highest (CUDA cores, TF32 off) on the same GPU",
                name="Tensor Core ÷ CUDA core speed",
            ),
        ),
    ),
    Claim(
        "C04",
        "Mixed precision (fp16/bf16 compute, fp32 master weights, loss scaling) runs on Tensor "
        "Cores and roughly halves memory",
        ("002", "000"),
        "training",
        "step time and peak memory of the same training step, fp32 vs bf16 compute; loss agreement",
        (
            Stated(
                "mixed_precision_memory_ratio",
                "Mixed precision: Use FP16 where possible, FP32 where needed (half memory) "
                "(000); store weights in FP32 but do forward/backward pass in FP16 (002).",
                "000, 002",
                "×",
                lo=0.4,
                hi=0.6,
                reading="'half memory' read as 0.5 ± 0.1: compiled memory of the lab's step "
                "with bf16 compute (fp32 weights, gradients and AdamW state) over the same step "
                "in float32",
                if_off="the recipe keeps fp32 master weights, fp32 gradients and fp32 Adam "
                "moments, so only activations and their temporaries shrink: the total falls by "
                "the activations' share, not by half",
                name="mixed ÷ fp32 memory",
            ),
            Stated(
                "mixed_precision_speedup",
                "with autocast(): # Runs in FP16 on Tensor Cores",
                "002",
                "×",
                lo=1,
                strict=True,
                backends=("gpu",),  # Tensor Cores: a TPU's ratio is shown beside it
                reading="float32 step time over bf16-compute step time on a GPU: above 1 where "
                "the Tensor Cores run it; a TPU's ratio is shown as context: the words are "
                "about Tensor Cores",
                name="mixed ÷ fp32 speed",
            ),
        ),
    ),
    Claim(
        "C05",
        "H100 ≈ 1,000 TFLOP/s at FP16; V100 125, A100 312, H100 989, H200 989, B200 2000+",
        ("002", "003"),
        "matmul",
        "achieved bf16 matmul TFLOP/s vs the datasheet peak, per device kind",
        (
            Stated(
                "bf16_matmul_flops",
                "An H100 does ~1,000 TFLOP/s at FP16 (002). V100 125, A100 312, H100 989, "
                "H200 989, B100/B200 2000+ TFlops (FP16) (003).",
                "002, 003",
                "FLOP/s",
                backends=("gpu",),
                devices={
                    "v100": _r(125e12),
                    "a100": _r(312e12),
                    "h100": _r(989e12),
                    "h200": _r(989e12),
                    "b200": (2000e12 / 1.25, None),
                    "b100": (2000e12 / 1.25, None),
                },
                reading="bf16 matmul FLOP/s achieved on the GPU present against the article's "
                "figure for that model (±25%)",
                if_off="the articles quote the datasheet's dense peak; a real matmul reaches "
                "a fraction of it (clocks under load, memory traffic, kernel efficiency)",
                name="bf16 matmul FLOP/s",
            ),
        ),
    ),
    Claim(
        "C06",
        'Memory bandwidth often bottlenecks before compute ("memory-bound")',
        ("002", "003"),
        "roofline",
        "roofline: FLOP/s across arithmetic intensity; measured copy bandwidth and matmul peak; "
        "the ridge point; the share of a training step's time in ops below the ridge",
        (
            Stated(
                "memory_bound_share",
                "memory bandwidth often bottlenecks before compute — moving data is frequently "
                "slower than computing (002); today's GPUs often 'compute too fast, waiting on "
                "memory'—this is called memory-bound (003)",
                "002, 003",
                "× step",
                lo=0.25,
                hi=1,
                backends=ACCELERATORS,  # "today's GPUs": a CPU's share judges nothing
                reading="the lab's training step as compiled, each op at the roofs (max of its "
                "FLOPs over the matmul peak and its bytes over the memory bandwidth): ops below "
                "the ridge (norms, softmax, elementwise, optimizer) take at least a quarter of "
                "its time. Decided on an accelerator: measured at the roofs measured there, or, "
                "where none is present, predicted by the step-time model for the step compiled "
                "for an H100 (plans=on). 'Often' is read as a quarter; a step that is nearly "
                "all matmul at these roofs is off. A CPU's share is shown beside it and judges "
                "nothing: the claim is about GPUs, and a CPU's ridge (its peak over its "
                "bandwidth) is a few FLOP per byte, so its matmuls dominate",
                if_off="the share falls as the ridge falls: on a processor whose peak has not "
                "outgrown its bandwidth the same step's matmuls dominate, and it moves to "
                "memory as the peak outgrows the bandwidth",
                name="memory-bound share of step",
            ),
        ),
    ),
    Claim(
        "C07",
        "PCIe ≈ 16 GB/s, NVLink ≈ 900 GB/s (10× PCIe)",
        ("000", "003"),
        "roofline",
        "host↔device transfer bandwidth; device↔device copy bandwidth; collectives where present",
        (
            Stated(
                "pcie_bandwidth",
                "Slow: PCIe (16GB/s)",
                "000",
                "B/s",
                **about(16e9),
                backends=("gpu",),
                reading="host→device copy of pageable host memory (jax.device_put), 16 GB/s ± 25%",
                name="host→device copy bandwidth",
            ),
            Stated(
                "nvlink_bandwidth",
                "Fast: NVLink (900GB/s between H100s)",
                "000",
                "B/s",
                **about(450e9),
                backends=("gpu",),
                reading="device→device copy between two GPUs, one way; 900 GB/s is NVLink 4's "
                "total of both directions, so one direction moves at most half: 450 GB/s ± 25%",
                name="device→device copy bandwidth",
            ),
            Stated(
                "nvlink_over_pcie",
                "High-speed communication between cards—10× faster than PCIe",
                "003",
                "×",
                **about(10),
                backends=("gpu",),
                reading="device→device over host→device bandwidth measured on one machine",
                name="device→device ÷ host→device",
            ),
        ),
    ),
    Claim(
        "C08",
        "Flash Attention keeps intermediates in on-chip memory: same result, 2–5× faster, and "
        "the n² memory traffic disappears",
        ("003",),
        "attention",
        "naive vs flash (blockwise / Pallas) vs library attention: time, memory and max error "
        "across sequence lengths, fwd and fwd+bwd",
        (
            Stated(
                "flash_max_error",
                "same attention computation",
                "003",
                "max |Δ|",
                lo=0,
                hi=1e-4,
                reading="'same result': the largest error of flash attention against a float64 "
                "reference (relative to the largest output; outputs and dQ, every sequence "
                "length), float32 inputs, at most 1e-4: rounding, not a different computation",
                name="flash vs exact, max |Δ| over the largest output",
            ),
            Stated(
                "flash_speedup",
                "Result: same attention computation, 2-5× faster.",
                "003",
                "×",
                lo=2,
                hi=5,
                backends=ACCELERATORS,
                reading="naive time over flash time, forward+backward, longest sequence "
                "measured; only an accelerator has the on-chip SRAM the claim is about",
                name="flash ÷ naive speed",
            ),
            Stated(
                "flash_memory_exponent",
                "VRAM reads/writes scale as n²—super slow … Flash Attention broke the memory "
                "bottleneck.",
                "003",
                "exponent",
                hi=1.5,
                reading="slope of log(compiled temporary memory) against log(sequence length) "
                "for flash attention forward+backward: 2 is n², 1 is linear, 0 is flat (a "
                "slightly negative slope is a flat one measured); below 1.5 reads as 'the n² "
                "disappears'. This is the memory a device must hold, which every backend's "
                "compiler reports; the traffic itself (bytes read and written) is not measured "
                "here, and under flash attention it still grows as n²: K and V are read once "
                "per query tile, about n²·d²/M bytes for on-chip memory M (the FlashAttention "
                "paper's bound), a fraction of the n² scores a naive kernel writes and reads. "
                "A kernel XLA cannot see into (Pallas, cuDNN) reports no scratch of its own",
                name="flash memory's growth exponent",
            ),
        ),
    ),
    Claim(
        "C09",
        "Training memory = weights + activations + gradients + optimizer state (e.g. "
        "40+20+40+80 = 180 GB > 80 GB)",
        ("000",),
        "memory",
        "predicted bytes per component vs the compiler's memory analysis of the real step",
        (
            Stated(
                "components_over_compiled",
                "Model weights: 40GB, Activations: 20GB, Gradients: 40GB, Optimizer state: "
                "80GB, Total: 180GB > 80GB available",
                "000",
                "×",
                lo=0.8,
                hi=1.25,
                reading="the four components, computed for the lab's real step by "
                "lab.measure.memory's calculator, over the compiler's buffer assignment for "
                "that step: the decomposition accounts for the memory within 25%",
                name="components ÷ compiled memory",
            ),
        ),
    ),
    Claim(
        "C10",
        "A 7B model needs ~80 GB to train; a 70B model fits on H100s only with model parallelism",
        ("003",),
        "memory",
        "the memory calculator for 7B/70B under fp32/bf16/Adam and sharding over N devices "
        "(FSDP, and a pipeline with the optimizer state in host memory), validated on small "
        "models where it can be measured",
        (
            Stated(
                "train_memory_7b",
                "Training a 7B model needs ~80GB VRAM (params + optimizer state + activations)",
                "003",
                "B",
                **about(80e9),
                backends=("gpu",),
                reading="calculator for a Llama-2-7B shape, the mixed-precision recipe the "
                "articles describe (fp32 weights, bf16 compute, fp32 AdamW), batch 1 × 2048, "
                "flash attention, no remat; ~80 GB read as ± 25%",
                if_off="fp32 weights, gradients and both Adam moments are 16 bytes per "
                "parameter before any activation; ~80 GB needs bf16 weights and optimizer "
                "state, or an 8-bit optimizer",
                name="7B training memory",
            ),
            Stated(
                "train_memory_70b_dp_over_h100",
                "H100 + model parallelism can fit a 70B model",
                "003",
                "× H100 memory",
                lo=1,
                strict=True,
                backends=("gpu",),
                reading="70B per-device memory with every device holding the whole model "
                "(pure data parallelism) over what a step may hold of one H100 (JAX's "
                "allocator share of its 80 GB, as lab.run judges a fit): above 1, so it does "
                "not fit without splitting the model",
                name="70B unsplit ÷ H100 allocator share",
            ),
            Stated(
                "h100s_needed_70b",
                "H100 + model parallelism can fit a 70B model",
                "003",
                "H100s",
                lo=2,
                backends=("gpu",),
                reading="smallest power-of-two number of H100s over which the 70B step, "
                "sharded (FSDP), fits per device (in JAX's allocator share of each): at least "
                "2 and finite",
                name="H100s the 70B needs",
            ),
        ),
    ),
    Claim(
        "C11",
        "Gradient checkpointing saves memory at the cost of recompute",
        ("000", "002"),
        "memory",
        "peak memory and step time with and without remat, per remat policy; remat=offload "
        "(block inputs in host memory) by the calculator and compiled for an H100",
        (
            Stated(
                "remat_memory_ratio",
                "Gradient checkpointing: Recompute instead of store (save memory, use compute)",
                "000",
                "×",
                lo=0,
                hi=1,
                strict=True,
                reading="compiled memory of the step with remat=full over remat=none: below 1",
                name="remat ÷ plain memory",
            ),
            Stated(
                "remat_flops_ratio",
                "Gradient checkpointing: Recompute instead of store (save memory, use compute)",
                "000",
                "×",
                lo=1,
                strict=True,
                reading="compiled FLOPs of the step with remat=full over remat=none: above 1 "
                "(the recomputed forward)",
                name="remat ÷ plain FLOPs",
            ),
        ),
    ),
    Claim(
        "C12",
        "Smaller batches use less memory but run slower",
        ("000", "002"),
        "memory",
        "peak memory and throughput across batch sizes; the largest batch as accumulated "
        "microbatches of the smallest (accumulate=K)",
        (
            Stated(
                "small_batch_memory_ratio",
                "Batch size reduction: Smaller batches = less memory (but slower)",
                "000",
                "×",
                lo=0,
                hi=1,
                strict=True,
                reading="compiled memory at the smallest batch over the largest: below 1",
                name="small ÷ large batch memory",
            ),
            Stated(
                "small_batch_throughput_ratio",
                "Batch size reduction: Smaller batches = less memory (but slower)",
                "000",
                "×",
                lo=0,
                hi=1,
                strict=True,
                reading="training tokens/s at the smallest batch over the largest: below 1 "
                "('slower' read as less work done per second)",
                name="small ÷ large batch tokens/s",
            ),
        ),
    ),
    Claim(
        "C13",
        "Data parallelism works well up to ~8–16 GPUs, then communication becomes the bottleneck",
        ("000",),
        "parallel",
        "scaling efficiency over mesh sizes; collective time vs compute time; a model "
        "extrapolated past the devices present",
        (
            Stated(
                "dp_comm_bound_devices",
                "Works well up to ~8-16 GPUs. Communication becomes bottleneck beyond.",
                "000",
                "devices",
                lo=9,
                hi=32,
                backends=("gpu",),
                reading="smallest data-parallel GPU count at which the gradient all-reduce "
                "takes longer than the step's compute (no overlap): up to 8 GPUs share NVLink, "
                "beyond that each GPU has one InfiniBand link. 'Works well up to ~8-16' puts "
                "the first bound count past 8 (at 8 it still works well), 'beyond' 16 at most "
                "the next power of two: 9–32",
                name="GPUs where all-reduce > compute",
            ),
        ),
    ),
    Claim(
        "C14",
        "Model (layer/tensor) parallelism is necessary for models too big for one device",
        ("000", "003"),
        "parallel",
        "per-device memory under DP, FSDP, tensor and pipeline parallel on the same mesh, and "
        "their step times",
        (
            Stated(
                "sharded_over_dp_memory",
                "Model too big for one GPU → Split layers across GPUs … Complex but necessary "
                "for models >70B params (000)",
                "000",
                "×",
                lo=0,
                hi=1,
                strict=True,
                reading="per-device compiled memory of the same step with the model's state "
                "split over the mesh (FSDP: each device keeps 1/n of every layer's weights, "
                "gradients and optimizer state), over pure data parallelism on the same mesh: "
                "below 1, so splitting the model is what lets a too-big model fit. FSDP is one "
                "way to split it; the articles' layer (pipeline) and tensor splits are shown "
                "beside it, and on a step whose activations outweigh its weights they save "
                "less, or cost more (the pipeline's stage holds several microbatches)",
                name="FSDP ÷ DP memory per device",
            ),
        ),
    ),
    Claim(
        "C15",
        "Training a GPT-3-scale model would take ~350 years on CPU (003) / 355 years on CPU vs "
        "25 days on GPUs (001)",
        ("001", "003"),
        "training",
        "GPT-3 FLOPs (6·N·D) over measured CPU FLOP/s and over accelerator FLOP/s at measured MFU",
        (
            Stated(
                "gpt3_cpu_years",
                "Training GPT-3 on CPUs would take about 355 years (001); training GPT-3 on CPU "
                "would take an estimated 350 years (003)",
                "001, 003",
                "years",
                lo=350 / 1.25,
                hi=355 * 1.25,
                backends=("cpu",),
                reading="6·N·D = 6 × 175e9 × 300e9 FLOPs over the training FLOP/s measured on "
                "this CPU; 350–355 years ± 25%. The articles name no CPU: the report also gives "
                "this CPU's rate scaled linearly to a 128-core server CPU, as context",
                if_off="355 years is what 3.1e23 FLOPs take at about 28 TFLOP/s, the tensor rate "
                "of one V100 GPU, not of any CPU: the figure looks like a single-GPU estimate "
                "relabelled",
                name="GPT-3 on CPU",
            ),
            Stated(
                "gpt3_gpu_days",
                "On GPUs, it took 25 days (001); on a GPU cluster: 34 days (003)",
                "001, 003",
                "days",
                lo=25 / 1.25,
                hi=34 * 1.25,
                backends=("gpu",),
                reading="the same FLOPs on 1,024 A100s (the cluster of Narayanan et al. 2021) "
                "at the MFU the lab's step reaches; 25–34 days ± 25%",
                name="GPT-3 on GPUs",
            ),
        ),
    ),
    Claim(
        "C16",
        "Inference: a 16-core CPU serves ~10 requests/s of sentiment analysis, an RTX 4090 ~500, "
        "an H100 ~5000",
        ("000",),
        "inference",
        "requests/s and latency of a small classifier at several batch sizes on the backend "
        "present",
        (
            Stated(
                "cpu16_rps",
                "CPU (16-core): Can handle ~10 RPS",
                "000",
                "req/s",
                **about(10, 1.5),
                backends=("cpu",),
                reading="the lab's transformer at BERT-base size (12 layers, d_model 768) as the "
                "classifier, 128 tokens per request, forward only, best batch size; scaled to 16 "
                "cores from the cores this process used; ~10 read as 10 ÷/× 1.5",
                name="16-core CPU req/s",
            ),
            Stated(
                "gpu_rps",
                "GPU (RTX 4090): Can handle ~500 RPS; GPU (H100): Can handle ~5000 RPS",
                "000",
                "req/s",
                backends=("gpu",),
                devices={"4090": _r(500, 1.5), "h100": _r(5000, 1.5)},
                reading="the same classifier on the GPU, best batch size; ÷/× 1.5",
                name="GPU req/s",
            ),
        ),
    ),
    Claim(
        "C17",
        "Training a GPT-like model: CPU 1 token/s, one RTX 4090 100 tokens/s, 8×H100 100,000 "
        "tokens/s",
        ("000",),
        "training",
        "tokens/s of the lab's model, per device and per mesh",
        (
            Stated(
                "cpu_train_tokens_per_s",
                "Baseline: Train on CPU → 1 token/second",
                "000",
                "tokens/s",
                **about(1, 2),
                backends=("cpu",),
                reading="GPT-2-small (124M parameters, 1024 context) training tokens/s on this "
                "CPU: the model FLOP/s the lab's training step reaches here over GPT-2-small's "
                "FLOPs per token; '1 token/second' read within a factor of 2",
                if_off="the article names no model size; tokens/s scales inversely with "
                "parameters, so a bare figure cannot hold for 'a GPT-like model' in general",
                name="CPU training tokens/s",
            ),
            Stated(
                "gpu_train_tokens_per_s",
                "GPU (single RTX 4090) → 100 tokens/second (100x faster)",
                "000",
                "tokens/s",
                backends=("gpu",),
                devices={"4090": _r(100, 2)},
                reading="the same model on one RTX 4090; within a factor of 2",
                name="one GPU's training tokens/s",
            ),
            Stated(
                "cluster_train_tokens_per_s",
                "GPU Cluster (8× H100s) → 100,000 tokens/second",
                "000",
                "tokens/s",
                backends=("gpu",),
                devices={"h100": _r(1e5, 2)},
                reading="the same model data-parallel over 8 H100s; within a factor of 2",
                name="8×H100 training tokens/s",
            ),
        ),
    ),
    Claim(
        "C18",
        "Self-hosted inference costs ~$0.1 (7B) / ~$1 (70B) per million input tokens; GPU "
        "rental $0.50–8/hour",
        ("001", "003"),
        "inference",
        "$/1M tokens from measured tokens/s and a stated $/hour per device kind",
        (
            Stated(
                "usd_per_m_input_tokens_7b",
                "Self-hosted (7B): ~$0.1 input / $0.3 output per 1M tokens",
                "003",
                "$",
                **about(0.1, 2),
                backends=("gpu",),
                reading="$/hour of an H100 (spec table) over input (prefill) tokens per hour of "
                "a 7B model at the MFU measured for the lab's forward; within a factor of 2",
                name="7B $ per M input tokens",
            ),
            Stated(
                "usd_per_m_input_tokens_70b",
                "Self-hosted (70B): ~$1 input / $3 output per 1M tokens",
                "003",
                "$",
                **about(1.0, 2),
                backends=("gpu",),
                reading="the same for a 70B model on as many H100s as its bf16 weights need; "
                "within a factor of 2",
                name="70B $ per M input tokens",
            ),
            Stated(
                "usd_per_m_output_tokens_7b",
                "Self-hosted (7B): ~$0.1 input / $0.3 output per 1M tokens",
                "003",
                "$",
                **about(0.3, 2),
                backends=("gpu",),
                reading="$/hour of an H100 over output (decode) tokens per hour of a 7B model: "
                "the decode step (bf16 weights and KV cache, 2048 tokens a sequence) compiled "
                "for the H100 and timed by the step-time model, as it times the published "
                "decode points, with as many sequences as fit beside the weights (at most 256); "
                "within a factor of 2",
                if_off="decode is priced by bytes, not FLOPs: the batch a server keeps in "
                "flight (how many caches fit beside the weights) sets the price",
                name="7B $ per M output tokens",
            ),
            Stated(
                "usd_per_m_output_tokens_70b",
                "Self-hosted (70B): ~$1 input / $3 output per 1M tokens",
                "003",
                "$",
                **about(3.0, 2),
                backends=("gpu",),
                reading="the same for a 70B model on as many H100s as its bf16 weights need; "
                "within a factor of 2",
                if_off="decode is priced by bytes, not FLOPs: the batch a server keeps in "
                "flight (how many caches fit beside the weights) sets the price",
                name="70B $ per M output tokens",
            ),
        ),
    ),
    Claim(
        "C19",
        "A TPU underperforms an H100 alone but a TPU cluster is efficient; MI300X is close to H100",
        ("003",),
        "hardware",
        "the same experiments on each backend, merged into one side-by-side table",
        (
            Stated(
                "tpu_over_h100",
                "Single TPU underperforms H100, but cluster efficiency is high",
                "003",
                "×",
                lo=0,
                hi=1,
                strict=True,
                backends=MULTI,
                reading="training tokens/s per TPU chip over per H100, the same model, from two "
                "result folders merged by experiments.compare: below 1",
                name="TPU ÷ H100 speed",
            ),
            Stated(
                "tpu_scaling_efficiency",
                "Single TPU underperforms H100, but cluster efficiency is high",
                "003",
                "×",
                lo=0.8,
                hi=1.05,
                backends=("tpu",),
                reading="per-chip training throughput on every chip present over one chip's: "
                "at least 0.8 reads as 'high'; above 1 only by a measurement's noise or a "
                "compiler estimate's rounding (up to 1.05)",
                name="TPU slice scaling efficiency",
            ),
            Stated(
                "mi300x_over_h100",
                "AMD GPU (MI300X): Performance close to H100",
                "003",
                "×",
                **about(1.0),
                backends=MULTI,
                reading="bf16 matmul FLOP/s of an MI300X over an H100, from merged result "
                "folders: 1 ± 25%",
                name="MI300X ÷ H100 speed",
            ),
        ),
    ),
    Claim(
        "C20",
        "H100 has 16,896 (000) or 18,432 (003) CUDA cores; 96 KB shared memory per SM; 40–50 MB "
        "L2; the largest H100 has 192 GB",
        ("000", "003"),
        "hardware",
        "what the device itself reports (SM count, memory, L2 and shared memory per SM) against "
        "the spec table",
        (
            Stated(
                "cuda_cores",
                "An NVIDIA H100 has 16,896 CUDA cores (000); H100: 18,432 CUDA cores (003)",
                "000, 003",
                "cores",
                backends=("gpu",),
                devices={"h100": (16896, 18432)},
                reading="streaming multiprocessors the device reports × 128 FP32 cores per "
                "Hopper SM",
                name="CUDA cores",
            ),
            Stated(
                "device_memory",
                "Largest: 192GB (H100 with HBM3)",
                "000",
                "B",
                backends=("gpu",),
                devices={"h100": _r(192e9, 1.05)},
                reading="memory the H100 present reports (bytes_limit of its allocator) "
                "against 192 GB ± 5%",
                if_off="no H100 has 192 GB: the SXM and PCIe cards have 80 GB, the NVL 94 GB; "
                "192 GB is an MI300X or B200",
                name="device memory",
            ),
            Stated(
                "shared_memory_per_sm",
                "Shared memory: 96 KB/SM (003)",
                "003",
                "B",
                backends=("gpu",),
                **about(96 * 1024, 1.05),
                reading="the most shared memory one streaming multiprocessor offers, as the "
                "CUDA driver reports it (cuDeviceGetAttribute), against 96 KiB ± 5%",
                if_off="96 KB is a V100's SM; an A100's offers up to 164 KB and an H100's up to "
                "228 KB of its 256 KB L1, set per kernel",
                name="shared memory per SM",
            ),
            Stated(
                "l2_cache",
                "L2 cache: 40-50 MB (003)",
                "003",
                "B",
                lo=40e6,
                hi=50 * 2**20,
                backends=("gpu",),
                reading="the L2 cache the CUDA driver reports, against 40 MB to 50 MiB (an "
                "A100's and an H100's)",
                if_off="the L2 differs by chip: an RTX 4090 has 72 MB, a T4 4 MB",
                name="L2 cache",
            ),
        ),
    ),
    Claim(
        "C21",
        "Self-hosted output tokens cost ~3× input tokens ($0.1 in / $0.3 out for 7B; $1 / $3 for "
        '70B); "Inference needs low latency + high throughput + low cost"',
        ("003",),
        "inference",
        "prefill (input) and decode (output) tokens/s of the same model on the backend present, "
        "their ratio, and $/1M output tokens from them; decode's achieved bandwidth against the "
        "memory roof",
        (
            Stated(
                "output_input_cost_ratio",
                "Self-hosted (7B): ~$0.1 input / $0.3 output per 1M tokens; Self-hosted (70B): "
                "~$1 input / $3 output",
                "003",
                "×",
                **about(3.0, 1.5),
                backends=ACCELERATORS,  # self-hosted serving costs: a GPU's, not a CPU's
                reading="device time per output token over device time per input token of the "
                "same model on one accelerator: prefill tokens/s over decode tokens/s, each at "
                "its best batch of the sweep (measured there), or predicted for a 7B model on "
                "an H100 from the same inputs as C18; '~3×' read as 2–4.5. A CPU's ratio is "
                "shown beside it and judges nothing: the prices are GPU servers'",
                if_off="the ratio is not a constant: prefill is compute-bound and decode "
                "memory-bound, so it is their rates' ratio at the batch a server runs — large "
                "at batch 1, falling as batching amortises the weights' bytes",
                name="output ÷ input token cost",
            ),
        ),
    ),
    Claim(
        "C22",
        '"Every trick that fits a 70B model on one card (quantization, CPU offloading, '
        'PagedAttention)"; "deep learning bottleneck is usually VRAM, not compute"',
        ("003",),
        "inference",
        "serving memory of a 70B-shaped model (weights + KV cache at a stated batch and context) "
        "at bf16, int8 and int4, with offloading, on one 80 GB card: compiled plans where the "
        "planner can, the calculator elsewhere",
        (
            Stated(
                "serving_memory_70b_int8",
                "Every trick that fits a 70B model on one card (quantization, CPU offloading, "
                "PagedAttention)",
                "003",
                "B",
                hi=80e9,
                reading="a Llama-2-70B-shaped model served with int8 weights (one scale per "
                "output channel) and an int8 KV cache, batch 1, 4096 tokens of context: bytes "
                "on one 80 GB H100, compiled for it where the plan ran (size=full), the "
                "calculator otherwise; at most 80 GB fits the card (JAX's allocator takes "
                "75% of the 84.9 GB it reports by default, 63.7 GB, which lab.serve's plan "
                "judges against: "
                "XLA_PYTHON_CLIENT_MEM_FRACTION raises it)",
                if_off="int8 weights alone are 69 GB: a long context or a bigger batch adds "
                "cache bytes until int4 or offloading is needed",
                name="70B int8 serving memory",
            ),
            Stated(
                "decode_intensity_over_ridge",
                "The deep learning bottleneck is usually VRAM, not compute",
                "003",
                "×",
                lo=0,
                hi=1,
                strict=True,
                backends=ACCELERATORS,  # VRAM: an accelerator's memory
                reading="a decode step at batch 1 of the lab's model on the accelerator "
                "present: its FLOPs per byte moved over the measured ridge point (compute roof "
                "/ memory roof); below 1 it waits on memory (VRAM's bandwidth), not on "
                "arithmetic. A CPU's figure is shown beside it and judges nothing",
                name="decode intensity ÷ ridge",
            ),
        ),
    ),
)

BY_ID: dict[str, Claim] = {c.id: c for c in CLAIMS}


def get(claim_id: str) -> Claim:
    try:
        return BY_ID[claim_id.upper()]
    except KeyError:
        raise KeyError(f"unknown claim {claim_id!r}; claims are {', '.join(BY_ID)}") from None
