"""What a serving study measured (lab.studies.serving), as frozen types: the roofs, a prefill
point, a decode point, the PyTorch peer's point, int8's error, the derived summary, the whole
study and a decode step compiled for a target.

They sit here, below lab.report, so the renderers (lab/report/tables/serving.py) take the
types instead of dicts whose keys they must know. Derived figures are properties computed
from the measured ones, so each has one definition. `record_config()` gives the fields a
record carries, in the order the JSON records have always had them: the ledger and the tests
read those records by key.
"""

import dataclasses
import math

from lab.measure import roofline, timing

NOISY_ROOF = 0.15  # a copy figure that moved more than this during a run is called out


@dataclasses.dataclass(frozen=True)
class Roofs:
    """This device's measured roofs: the best bandwidth measured (the copy kernel's unless a
    decode step moved bytes faster: the ledger's definition, lab.measure.ceilings.roofs) and
    the matmul peak at `dtype`."""

    bandwidth: float  # bytes/s: the memory roof
    peak_flops: float  # FLOP/s of a matmul at `dtype`: the compute roof
    dtype: str  # the compute dtype the peak was measured at
    copy: dict  # lab.measure.ceilings.copy_bandwidth's result
    how: str = "the copy kernel (x ← x·s)"  # what set the memory roof
    read: dict | None = None  # lab.measure.ceilings.read_bandwidth's result: a read stream
    # the copy and the read stream measured again after the sweep (a shared host's memory
    # bandwidth moves from minute to minute: the two say by how much it did during the run)
    copy_after: dict | None = None
    read_after: dict | None = None
    peak_n: int | None = None  # the n of the n×n matmul the peak was measured on

    @property
    def peak_name(self) -> str:
        """Which op the compute roof is: '<dtype> matmul, n=<n>'."""
        return f"{self.dtype} matmul" + (f", n={self.peak_n}" if self.peak_n else "")

    @property
    def ridge(self) -> float:
        return roofline.ridge_point(self.peak_flops, self.bandwidth)

    @property
    def best_read(self) -> float | None:
        """The best read stream measured (bytes/s), before or after the sweep."""
        rates = [r["bytes_per_s"] for r in (self.read, self.read_after) if r]
        return max(rates) if rates else None

    @property
    def copy_moved(self) -> float | None:
        """How far the copy figure moved between the two measurements: the larger over the
        smaller, minus one (None without a second one)."""
        if not self.copy_after:
            return None
        a, b = self.copy["bytes_per_s"], self.copy_after["bytes_per_s"]
        return max(a, b) / min(a, b) - 1

    @property
    def copy_noisy(self) -> bool:
        """Whether the copy figure moved more than NOISY_ROOF during the run: every share of
        the memory roof moved with it (lab.serve and the ledger call it out)."""
        moved = self.copy_moved
        return moved is not None and moved > NOISY_ROOF


@dataclasses.dataclass(frozen=True)
class PrefillPoint:
    """The whole batch of prompts through the model at once, timed."""

    batch: int  # prompts prefilled together
    prompt_len: int  # tokens per prompt
    bench: timing.BenchResult  # seconds per prefill
    flops: float  # model FLOPs of one prefill (lab.measure.cost.prefill_flops)

    @property
    def median_s(self) -> float:
        return self.bench.median_s

    @property
    def tokens_per_s(self) -> float:
        return self.batch * self.prompt_len / self.bench.median_s

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.bench.median_s

    def record_config(self) -> dict:
        return {
            "batch": self.batch,
            "prompt_len": self.prompt_len,
            **self.bench.as_dict(),
            "tokens_per_s": self.tokens_per_s,
            "flops": self.flops,
            "flops_per_s": self.flops_per_s,
        }


# a decode step reaching under this share of both the memory and the compute roof is bound
# by neither: its time goes to overhead (DecodePoint.bound)
OVERHEAD_SHARE = 0.1


@dataclasses.dataclass(frozen=True)
class DecodePoint:
    """One decode batch size: seconds per step (one token for every sequence), the bytes the
    step must move and its FLOPs, against the memory roof `roof_bandwidth`."""

    batch: int  # sequences decoded together
    int8_weights: bool  # the matmul weights are int8 (lab.quant.Int8Weight)
    int8_cache: bool  # the KV cache is int8
    matmul: str  # how the weights were multiplied (lab.decode.MATMULS)
    bench: timing.BenchResult  # seconds per decode step
    weight_bytes: int  # weights a step reads (lab.measure.cost.weight_read_bytes)
    cache_bytes: int  # cache a step reads (every slot, or up to each length)
    flops: float  # model FLOPs of a step (lab.measure.cost.step_flops)
    slots_read: int  # cache slots attention reads per sequence
    context: int  # cache slots per sequence
    roof_bandwidth: float  # bytes/s of the memory roof the share is taken against
    matmuls: tuple[tuple[str, float], ...] = ()  # (matmul, tokens/s) of every one tried

    @property
    def median_s(self) -> float:
        return self.bench.median_s

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.bench.median_s

    @property
    def ms_per_token(self) -> float:
        return 1e3 * self.bench.median_s

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.cache_bytes

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.bench.median_s

    @property
    def memory_roof_share(self) -> float:
        return self.bytes / self.bench.median_s / self.roof_bandwidth

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.bench.median_s

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes

    def bound(self, peak_flops: float) -> str:
        """What bounds the step: 'overhead' where it reaches under OVERHEAD_SHARE of both
        roofs (dispatch, the host, small kernels: neither roof is near), else the roof its
        FLOPs per byte put it under ('memory' below the ridge, 'compute' above)."""
        compute_share = self.flops_per_s / peak_flops
        if max(self.memory_roof_share, compute_share) < OVERHEAD_SHARE:
            return "overhead"
        ridge = roofline.ridge_point(peak_flops, self.roof_bandwidth)
        return "memory" if self.intensity < ridge else "compute"

    def record_config(self) -> dict:
        out = {
            "batch": self.batch,
            "int8_weights": self.int8_weights,
            "int8_cache": self.int8_cache,
            "matmul": self.matmul,
            **self.bench.as_dict(),
            "tokens_per_s": self.tokens_per_s,
            "ms_per_token": self.ms_per_token,
            "weight_bytes": self.weight_bytes,
            "cache_bytes": self.cache_bytes,
            "bytes": self.bytes,
            "bytes_per_s": self.bytes_per_s,
            "memory_roof_share": self.memory_roof_share,
            "flops": self.flops,
            "flops_per_s": self.flops_per_s,
            "intensity": self.intensity,
            "slots_read": self.slots_read,
            "context": self.context,
        }
        if self.matmuls:
            out["matmuls"] = dict(self.matmuls)
        return out


@dataclasses.dataclass(frozen=True)
class Int8MatmulError:
    """int8 weights multiplied one way (a decode speed row's matmul) against float: the loss
    of the full forward pass, and the logits of prefill + decode steps with an int8 cache."""

    matmul: str  # how the int8 weights were multiplied (lab.decode.MATMULS): w8a8 also
    # quantizes the activations; xla, native and native1 are weight-only
    loss_int8: float  # loss of the full forward pass with int8 weights multiplied this way
    logits_rel_rms: float  # decode logits (int8 weights and cache) against float: RMS / RMS
    logits_max_abs: float  # max |difference| of those logits
    top1_same: int  # decode positions whose top token is float's
    positions: int  # decode positions compared (windows × steps)
    # standard error of the loss change over the windows (their changes' spread / √windows):
    # a change within about two of it is noise; None for one window
    loss_change_se: float | None = None

    @property
    def top1_agreement(self) -> float:
        return self.top1_same / self.positions


@dataclasses.dataclass(frozen=True)
class Int8Error:
    """What int8 costs in accuracy on the bundled text, for each way the int8 weights were
    multiplied (`matmuls`, in the order timed), and what it saves in bytes."""

    prompt_len: int  # tokens of each text window before the decode steps (at most the text's)
    loss_float: float  # loss of the full forward pass, float weights
    logits_scale: float  # max |logit| of the float decode, the scale of logits_max_abs
    weight_bytes_float: int  # bytes of the float weights
    weight_bytes_int8: int  # bytes of the int8 weights (codes and scales)
    window_len: int  # tokens of each text window the loss is taken over: prompt + steps
    matmuls: tuple[Int8MatmulError, ...]  # one per int8 matmul whose speed was measured
    windows: int = 1  # text windows the figures rest on, spread over the whole text

    @property
    def bytes_saved(self) -> int:
        return self.weight_bytes_float - self.weight_bytes_int8

    def of(self, matmul: str) -> Int8MatmulError:
        """The error of the int8 weights multiplied by `matmul`."""
        return next(m for m in self.matmuls if m.matmul == matmul)

    def loss_change(self, matmul: str) -> float:
        return self.of(matmul).loss_int8 - self.loss_float

    def record_config(self, matmul: str | None = None) -> dict:
        """The fields a record carries: the shared ones, and `matmul`'s own where given."""
        shared = {k: v for k, v in dataclasses.asdict(self).items() if k != "matmuls"}
        return shared if matmul is None else {**shared, **dataclasses.asdict(self.of(matmul))}


@dataclasses.dataclass(frozen=True)
class PeerPoint:
    """The PyTorch decoder of the same shape and weights at one decode batch
    (lab.studies.torch_decoder.time_decode's figures), beside the lab's float point."""

    batch: int  # sequences decoded together
    median_s: float  # seconds per decode step, at the faster thread count
    tokens_per_s: float  # batch / median_s
    threads: int  # PyTorch's threads at the faster count
    tokens_per_s_by_threads: dict  # tokens/s at each thread count tried
    torch: str  # PyTorch's version
    lab_over_torch: float  # the lab's float tokens/s at this batch over PyTorch's
    steps: int = 0  # decode steps per timed sample (fewer than asked where budget= cut them)
    samples: int = 0  # the fewest timed samples a thread count got

    def record_config(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Summary:
    """The derived figures of a serving study: the ridge and critical batch, batch 1 against
    the roofs, the best rates and the output/input price ratio on this device."""

    ridge: float  # FLOP/B where the compute roof meets the memory roof
    critical_batch: float  # batch where decode's intensity reaches the ridge; inf: never
    # % the critical batch moves per 1% of the ridge (cost.critical_batch_sensitivity)
    critical_batch_sensitivity: float
    cache_intensity: float  # FLOPs per cache byte: decode's intensity as the batch grows
    batch1_roof_share: float  # the smallest batch's share of the memory roof
    batch1_intensity: float  # the smallest batch's FLOPs per byte
    best_decode: DecodePoint  # the float decode point with the most tokens/s
    smallest: DecodePoint  # the float decode point at the smallest batch (batch1_* are its)
    best_prefill: PrefillPoint | None = None  # the prefill point with the most tokens/s
    int8_speedup: tuple[tuple[int, float], ...] = ()  # (batch, int8 tokens/s over float)
    # self-hosted price ∝ device time per token: output over input at the best rates, and
    # against decode at the smallest batch; None without a prefill point
    output_input_cost_ratio: float | None = None
    output_input_cost_ratio_batch1: float | None = None

    @property
    def critical_batch_or_none(self) -> float | None:
        """The critical batch as a record holds it: None for never (JSON has no inf)."""
        return None if math.isinf(self.critical_batch) else self.critical_batch


@dataclasses.dataclass(frozen=True)
class Study:
    """Everything one serving study measured and derived."""

    roofs: Roofs  # the best memory roof measured and the matmul peak
    prefill: tuple[PrefillPoint, ...]  # one per prefill batch
    decode: tuple[DecodePoint, ...]  # float weights and cache, one per decode batch
    decode_int8: tuple[DecodePoint, ...]  # int8 weights and cache; empty without int8
    int8: Int8Error | None  # None without int8
    summary: Summary
    torch: tuple[PeerPoint, ...] = ()  # the PyTorch peer at each decode batch, where it runs
    peer_note: str = ""  # why the peer was skipped or stopped, where it was


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """The decode step compiled for a target (compiled, not run): the compiler's memory per
    device beside the calculator's, against the chip's memory."""

    target: str  # the target= it was compiled for
    device_kind: str  # the target's device kind
    devices: int  # devices of the mesh
    batch: int  # sequences decoded together
    context: int  # cache slots per sequence
    int8: bool  # int8 weights and cache
    compiled: dict  # lab.measure.memory.compiled_memory per device; empty when refused
    predicted: dict  # lab.measure.memory.predict_serving_memory per device
    capacity_bytes: float | None  # the chip's memory, where known
    compile_s: float  # seconds the compile (or its refusal) took
    refused: str | None  # the compiler's refusal (the program does not fit), or None

    @property
    def compiled_bytes(self) -> float | None:
        return (self.compiled or {}).get("total_bytes")

    def record_config(self) -> dict:
        """The row's fields but `compiled`, which a record carries as compiled_memory."""
        out = dataclasses.asdict(self)
        out.pop("compiled")
        return out
