"""Memory, measured and predicted: what the compiler allocates, what the device saw, and a
calculator that says what a transformer's training step *should* need before compiling it.

Measured: `compiled_memory` (XLA's buffer assignment for one device), `device_memory_stats`
(the allocator's peak, GPU/TPU only), `process_rss_bytes` (the host process, for CPU).
Predicted: `predict_training_memory`, plain arithmetic over a model's shape with every term
written out, so a claim like "weights 40 GB + activations 20 GB + gradients 40 GB + optimizer
80 GB" can be recomputed, and the same arithmetic checked against `compiled_memory` of the
lab's real step (tests/test_memory.py).
"""

import dataclasses
import os
import resource
import sys

import jax

# --- measured ----------------------------------------------------------------------------

HOST_FIELDS = ("argument", "output", "alias", "temp")  # memory_analysis() host_*_size_in_bytes


@dataclasses.dataclass(frozen=True)
class MemorySplit:
    """One device's bytes three ways, side by side (lab.run explain=true): exact from the
    shardings, predicted by the calculator, allocated by the compiler. A renderer reads the
    fields; `record()` is the dict form an explanation keeps, `from_record()` reads it back."""

    params: int  # from the shardings, exact
    grads: int  # as the params: the same shardings
    optimizer: int  # from the shardings, exact
    predicted: dict | None  # predict_lab_step; {"error": …} where the calculator has none
    compiled: dict | None  # compiled_memory; None: not compiled, or not XLA's figures

    def record(self) -> dict:
        return {
            "sharded": {"params": self.params, "grads": self.grads, "optimizer": self.optimizer},
            "predicted": self.predicted,
            "compiled": self.compiled,
        }

    @classmethod
    def from_record(cls, d: dict) -> "MemorySplit":
        return cls(**d["sharded"], predicted=d["predicted"], compiled=d["compiled"])


def compiled_memory(compiled) -> dict | None:
    """Bytes one device needs for a compiled program, from `compiled.memory_analysis()`.

    total_bytes = arguments + outputs − aliased + temporaries: outputs that reuse a donated
    argument's buffer (`alias`) are not allocated twice. Generated code is reported apart
    (on CPU it lives in host memory, on GPU it is a few MB at most). What the program keeps in
    host memory (memory kind pinned_host: offloaded activations and optimizer state) is in the
    host_* fields, where the backend reports them, not in total_bytes. None when the backend
    has no memory analysis.
    """
    try:
        m = compiled.memory_analysis()
    except (NotImplementedError, RuntimeError):  # backends without it (XlaRuntimeError is a
        return None  # RuntimeError); anything else is a bug and should surface
    if m is None:
        return None
    out = {
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
        "alias_bytes": int(m.alias_size_in_bytes),
        "temp_bytes": int(m.temp_size_in_bytes),
        "generated_code_bytes": int(m.generated_code_size_in_bytes),
    }
    out["total_bytes"] = (
        out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] + out["temp_bytes"]
    )
    if hasattr(m, "host_temp_size_in_bytes"):
        host = {f: int(getattr(m, f"host_{f}_size_in_bytes")) for f in HOST_FIELDS}
        out.update({f"host_{f}_bytes": v for f, v in host.items()})
        out["host_total_bytes"] = host["argument"] + host["output"] - host["alias"] + host["temp"]
    return out


def device_memory_stats(device) -> dict | None:
    """The allocator's own counters (bytes_in_use, peak_bytes_in_use, bytes_limit) or None.

    GPU and TPU report them; the CPU backend returns None (use `process_rss_bytes` there).
    """
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 — unimplemented on some backends
        return None
    if not stats:
        return None
    keep = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit", "largest_alloc_size")
    return {k: int(stats[k]) for k in keep if k in stats}


def process_rss_bytes() -> int:
    """Resident memory of this process now (Linux /proc), else its peak (getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return process_peak_rss_bytes()


def process_peak_rss_bytes() -> int:
    """Peak resident memory of this process (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def host_memory_bytes() -> int | None:
    """Physical memory of the host."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def host_available_bytes() -> int | None:
    """Memory the host can give this process now: MemAvailable of /proc/meminfo (free memory
    and the caches the kernel can drop, less what other processes hold), else, where the OS
    does not say, its physical memory (`host_memory_bytes`). On a host shared with other work
    the total overstates what a run can take: one that passed a check against it was killed
    at the memory the others left."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return host_memory_bytes()


def gpu_allocator_fraction() -> float:
    """The share of a GPU's total memory JAX's allocator may use: XLA_CLIENT_MEM_FRACTION (or
    its older name XLA_PYTHON_CLIENT_MEM_FRACTION) as set here (the run on the GPU would set
    it too), else JAX's default, 0.75."""
    given = os.environ.get("XLA_CLIENT_MEM_FRACTION") or os.environ.get(
        "XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"
    )
    try:
        share = float(given)
    except ValueError:
        return 0.75
    return share if 0 < share <= 1 else 0.75


def gpu_allocator_fraction_source() -> str:
    """Where `gpu_allocator_fraction` took its share from: the variable set here, by the name
    the user gave it, or JAX's default (and the variable that changes it)."""
    for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        if os.environ.get(name):
            return name
    return "JAX's default; XLA_CLIENT_MEM_FRACTION sets it"


def usable_bytes(spec_bytes: float, device_kind: str, reported_bytes: float | None = None) -> float:
    """What a run on that hardware can allocate: a TPU's HBM (the spec's), or the share JAX's
    allocator takes (`gpu_allocator_fraction`) of the total memory a GPU reports
    (`reported_bytes`, where known: JAX's share is of that, not of the datasheet's round
    figure), else of the spec's."""
    if device_kind.startswith("TPU"):
        return spec_bytes
    return (reported_bytes or spec_bytes) * gpu_allocator_fraction()


def check_fits(what: str, per_device: float, key: str, devices=None, fits=None) -> None:
    """ConfigError (one line, before anything is allocated) where `per_device` bytes on each
    device would not fit: on CPU the simulated devices share the host's available memory
    (`host_available_bytes`; at most 80% of it is asked for), elsewhere each device's own.
    `key` names the settings that set the size ("seqs=4096", or several: "head_dim=4096
    seqs=512"); the advice names each. `fits(limit_bytes)`, where given, names a size that
    fits the limit ("seqs=12,288"; None where none does), which the line then says."""
    import jax

    from lab.errors import ConfigError

    devices = list(devices if devices is not None else jax.devices())
    cpu = devices[0].platform == "cpu"
    capacity = host_available_bytes() if cpu else device_capacity_bytes(devices[0])
    if capacity is None:
        return
    need = per_device * (len(devices) if cpu else 1)
    if need > 0.8 * capacity:
        where, has = "a device has", ""
        if cpu:
            where = (
                f"{len(devices)} simulated devices share" if len(devices) > 1 else "the host has"
            )
            has = " available"
        advice = f"choose a smaller {_either(key)}"
        size = fits(0.8 * capacity / (len(devices) if cpu else 1)) if fits else None
        if size:
            advice += f" ({size} fits)"
        raise ConfigError(
            f"{key}: {what} would take {_gib(need)}, and {where} {_gib(capacity)}{has}; {advice}"
        )


def _gib(n: float) -> str:
    """Bytes in GiB, to a tenth below 100 GiB and whole above (12.3 GiB, 4,096 GiB)."""
    return f"{n / 2**30:,.{1 if n < 100 * 2**30 else 0}f} GiB"


def _either(key: str) -> str:
    """The names in `key` ("a=1 b=2 c=3") as advice: a=, b= or c=."""
    names = [k.split("=")[0] + "=" for k in key.split()]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def device_capacity_bytes(device) -> int | None:
    """Memory one device can allocate: the allocator's bytes_limit, host RAM on CPU, or for
    a TPU plan's abstract device what its compiler lets one program hold (`compiler_hbm`)."""
    stats = device_memory_stats(device)
    if stats and stats.get("bytes_limit"):
        return stats["bytes_limit"]
    if device.platform == "cpu":
        return host_memory_bytes()
    if device.platform == "tpu":
        return compiler_hbm(device)
    return None


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_HBM_PROBES: dict = {}


def compiler_hbm(device) -> int | None:
    """The HBM XLA:TPU lets one program of `device`'s chip hold, in bytes: the chip's memory
    less what the runtime keeps, which no spec sheet states. Read from the compiler's own
    refusal of a program that needs 1 TiB ("exceeds available HBM (15.75G)"; G is GiB):
    15.75 GiB of a v5e's 16, 30.75 of a v4's 32 (libtpu 0.0.42 and 0.0.50). Compiled once per
    chip kind, in about a second; None where the compiler compiles it or says nothing of the
    kind."""
    import re

    import jax.numpy as jnp

    kind = device.device_kind
    if kind in _HBM_PROBES:
        return _HBM_PROBES[kind]
    found = None
    where = jax.sharding.SingleDeviceSharding(device)
    need = jax.jit(lambda x: jnp.broadcast_to(x, (2**38,)) + 1, out_shardings=where)
    try:
        need.lower(jax.ShapeDtypeStruct((), jnp.float32, sharding=where)).compile()
    except Exception as e:  # noqa: BLE001 — the runtime's error types differ by version
        m = re.search(r"available HBM \(([\d.]+)([KMGT]?)\)", str(e))
        if m:
            found = int(float(m.group(1)) * _UNITS[m.group(2)])
    _HBM_PROBES[kind] = found
    return found


# --- predicted ---------------------------------------------------------------------------

OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "lion": 1, "momentum": 1, "sgd": 0}
REMATS = ("none", "full", "dots", "offload")  # lab.names.REMATS
F32 = 4
ATTENTION_KINDS = ("naive", "flash", "blockwise")


@dataclasses.dataclass(frozen=True)
class LayerCensus:
    """What one block keeps from its forward for its backward, read from its jaxpr
    (lab.model.layer_census): bytes per token, split by how the lab's tensor parallelism lays
    them out (`replicated`: the [B, L, D] residual stream, whole on every device of the model
    axis; `split`: heads and MLP columns, divided over it), under the model's remat policy
    (`saved`) and with none (`full`: a block recomputed during its backward), and the bytes per
    layer of weight copies kept (casts to the compute dtype).

    Under a scan over the layers the loop writes every one of these into a stacked buffer,
    so the compiled step holds them all; unrolled, XLA recomputes cheap elementwise ones inside
    its fusions, which is why the itemised formula (`_layer_activation_bytes`) serves there."""

    saved_replicated: float
    saved_split: float
    full_replicated: float
    full_split: float
    weights: float = 0.0

    def saved(self, model: int = 1) -> float:
        return self.saved_replicated + self.saved_split / model

    def full(self, model: int = 1) -> float:
        return self.full_replicated + self.full_split / model


def naive_score_bytes(backend: str, c: int) -> tuple[float, float]:
    """Bytes per score element (one of B·H·L·S) of naive attention's softmax in one block:
    (kept from the forward for the backward, transient during that block's backward).

    What XLA keeps differs by backend, as its buffer assignment of the compiled step shows
    (the lab's small model, batch 16 × 1024, compute bf16, 2 and 6 layers; the temp bytes'
    slope over the layers is the kept share, the rest the transient):
      cpu: scores, masked scores and probabilities in float32, plus the probabilities cast to
           the compute dtype when it is not float32; the backward's gradient of the scores
           and of the probabilities and the re-formed softmax, three float32 more;
      gpu: two float32 [B, H, L, S] buffers a block (XLA:GPU fuses the mask and the cast
           into their consumers) and nothing transient beyond them: the backward's buffers
           take the places its own block's kept ones free;
      tpu: one float32 buffer a block, and one more during its backward."""
    if backend in ("gpu", "cuda", "rocm"):
        return 2 * F32, 0.0
    if backend == "tpu":
        return F32, F32
    return 3 * F32 + (c if c != F32 else 0), 3 * F32


def _layer_activation_bytes(
    d, d_kv, f, h, s, c, *, model: int, attention: str, tile: int = 256, backend: str = "cpu"
) -> tuple[float, float, float]:
    """Bytes per token of one block: (saved with no remat, saved under remat=dots, transient).

    Saved for the backward, per token (c = compute-dtype bytes; the lab's block is pre-norm
    attention + SwiGLU, softmax in float32):
      residual stream, replicated over the model axis: block input, first norm's output,
        the residual after attention, second norm's output: 4·D
      split over the model axis (heads / MLP columns): q, k, v as the kernel sees them
        (naive attention repeats k and v to all heads: 3·D; flash keeps D + 2·D_kv), the
        attention output (D), gate, up, silu(gate) and their product (4·F)
      naive attention, split over heads: H·S score elements at `naive_score_bytes` each (on
        CPU: scores, masked scores and probabilities in float32, plus the probabilities cast
        to c when c is not float32)
      flash attention (fused or blockwise): one float32 log-sum-exp per head instead.
    remat=dots keeps only matmul outputs (jax's dots_with_no_batch_dims_saveable): the block
      input, q, k, v before any repeat, both projections back to D, gate and up.
    Transient (one block at a time, during its backward): naive attention's, H·S elements at
      the transient `naive_score_bytes` (on CPU the gradient of the scores and of the
      probabilities and the re-formed softmax, 3·H·S·4 bytes). A fused
      flash kernel keeps its tiles on chip (0); blockwise flash in plain JAX writes one
      `tile`×`tile` tile of the same three to device memory, 3·H·tile²/S·4 bytes per token, and
      accumulates dq, dk and dv in float32, 4·(D + 2·D_kv).
    """
    naive = attention == "naive"
    qkv = 3 * d if naive else d + 2 * d_kv
    split = c * (qkv + d + 4 * f)
    kept, passing = naive_score_bytes(backend, c)
    split += h * s * kept if naive else h * F32
    saved = c * 4 * d + split / model
    dots = c * 3 * d + c * (d + 2 * d_kv + 2 * f) / model
    transient = 0.0
    if naive:
        transient = h * s * passing / model
    elif attention == "blockwise":
        t = min(tile, s)
        transient = (3 * h * t * t / s * F32 + F32 * (d + 2 * d_kv)) / model
    return saved, dots, transient


def predict_training_memory(
    *,
    n_params: float,
    n_layers: int,
    d_model: int,
    n_heads: int,
    seq_len: int,
    batch_size: int,
    vocab_size: int,
    d_ff: int | None = None,
    n_kv_heads: int | None = None,
    param_bytes: int = 4,
    compute_bytes: int = 4,
    grad_bytes: int | None = None,
    optimizer: str = "adam",
    opt_state_bytes: int | None = None,
    master_bytes: int = 0,
    remat: str = "none",
    attention: str = "naive",
    attention_tile: int = 256,
    tie_embeddings: bool = False,
    data: int = 1,
    fsdp: int = 1,
    model: int = 1,
    stage: int = 1,
    microbatches: int = 1,
    pipeline_repeats: int = 1,
    accumulate: int = 1,
    offload_optimizer: bool = False,
    backend: str = "cpu",
    census: LayerCensus | None = None,
) -> dict:
    """Bytes per device of one training step of a decoder-only transformer, by component.

    The shape takes the lab's config field names (lab.config.ModelConfig and Config):
    `n_params` (all weights), the global `batch_size` of `seq_len`-token sequences, storage
    dtypes in bytes (`param_bytes`; `grad_bytes` defaults to it, as jax.grad returns the
    parameters' dtype; Adam moments default to it too, as optax keeps them; `master_bytes`=4
    adds an fp32 master copy for the mixed-precision recipe that stores bf16 weights),
    `compute_bytes` for activations, `remat` in none | full | dots | offload, `attention`
    naive | flash (fused kernel) | blockwise (flash in plain JAX, `attention_tile`-sized tiles
    in device memory), a mesh of `data` × `stage` × `fsdp` × `model`; a pipeline of
    `microbatches` (and `pipeline_repeats`) over `stage`; `accumulate` = K microbatches per
    update; `offload_optimizer` keeps the optimizer state in host memory; `backend` (cpu,
    gpu, tpu) the compiler whose buffer assignment is predicted, which decides how much of
    naive attention's softmax is kept (`naive_score_bytes`).

    Formulas (all per device, P = stage·fsdp·model, T = batch_size·seq_len / (data·stage·fsdp·K)
    tokens of one accumulation microbatch):
      params     = n_params·param_bytes / P          (ZeRO-3 / tensor parallel / pipeline
                                                      split weights)
      grads      = n_params·grad_bytes / P
      optimizer  = n_params·(states·opt_state_bytes + master_bytes) / P, states: adam 2, sgd 0
                   (in host memory with offload_optimizer: `host`, not in the total)
      activations= T·n_layers·A_layer                    remat=none
                 = T·(n_layers·c·D + A_layer)            remat=full (block inputs, then one
                                                         block recomputed during its backward)
                 = T·(n_layers·A_dots + A_layer)         remat=dots
                 = T·A_layer                             remat=offload (block inputs in host
                                                         memory: T·n_layers·c·D in `host`)
                   With a pipeline of S = stage stages, M microbatches, R repeats, a stage
                   keeps the residuals of its n_layers/S layers for a microbatch of T·S/M
                   tokens at every tick, bubble ticks included: n_layers → n_layers·ticks/M,
                   ticks = R·M + S - 1, and the one recomputed block sees T·S/M tokens.
                   Circular (R > 1): each tick is recomputed in the backward, so a stage
                   keeps each tick's input and its stacked output (2·T·ticks·S/M·c·D), stage
                   0's M held microbatches (T·S·c·D) and one tick's n_layers/(S·R) layers as
                   above (never more than their whole residuals). GPipe (R = 1, layers
                   scanned) on XLA:CPU and XLA:GPU: the backward also copies one tick's
                   residuals of the stage's n_layers/S layers out of the stack
                   (T·S/M·n_layers/S·A_kept, A_kept what each layer keeps under the remat
                   policy).
      workspace  = T·transient (one block's attention backward; on XLA:CPU with layers
                   unrolled, at least the MLP's three gradients and the input's,
                   c·(3·F/model + D))
                 + 2·T·vocab_size·4 / model (float32 logits and the softmax the loss gradient
                   needs)
                 + vocab_size·D·grad_bytes / P with tied embeddings (the lookup's scatter and
                   the output head each produce a full embedding gradient before they are
                   summed)
                 + under fsdp > 1, the all-gathered weights in compute dtype: every layer's
                   with remat=none unscanned (kept from the forward for the backward), else
                   two layers'
                 + with K > 1, the float32 gradient accumulator, n_params·4 / P
                 + GPipe with scanned layers on XLA:CPU and XLA:GPU: a second sum of the
                   stage's layers' weight gradients (the layer loop's, apart from the tick
                   loop's)
      total      = params + grads + optimizer + activations + workspace (device memory)
      host       = what offloading keeps in host memory instead
    A_layer, A_dots and transient are per-token bytes of one block, itemised in
    `_layer_activation_bytes`. Layers scanned (`census`, lab.model.layer_census): A_layer is
    the census's block with no remat, and what each layer keeps (A_layer, c·D or A_dots
    above) the census's block under the remat policy; remat=none adds T·A_layer more on
    XLA:CPU and XLA:GPU (the layer being differentiated: its gradients in fresh buffers, as
    the stack lives until the backward loop ends), remat=dots recomputes A_layer − A_dots,
    not A_layer (what the policy kept is read from the stack); the weight copies the census
    counts add n_layers/stage of them (divided over `model`; under fsdp the gathered weights
    above are those copies). A scan writes every residual of its jaxpr into a stacked buffer, so
    the compiled step holds them all (small, 8 layers, batch 32 × 128, compiled for one H100:
    662.6 MiB scanned, 355.1 MiB unrolled, where XLA recomputes elementwise values inside
    its fusions and the itemised formula is the better account). What is left out: the int32
    batch, XLA's fusion scratch and layout copies, allocator fragmentation — the compiled
    figure is usually a few % higher.

    On TPU every buffer is predicted as if in HBM, and `compiled_memory` counts HBM only:
    XLA:TPU's memory-space assignment moves temporaries into on-chip VMEM, how many by its
    cost model (the overlap of each buffer's live range with its copies), not by a capacity.
    On small steps that reads far over: small, batch 8 × 256, v5e 2x2 dp=4, predicted 82.3 MiB
    against 45.3 MiB compiled (1.82×), 42.7 MiB of the buffer assignment in VMEM; compiled with
    LIBTPU_INIT_ARGS=--xla_vf_vmem_memory_space_assignment=false (everything in HBM) the same
    step is 74.6 MiB (1.10×); over six such plans, 0.89–1.41×. Batch 16 × 256 under naive
    attention, the same v5e plan reads 131.3 MiB against 45.3 MiB (2.90×), and 1.15× against
    the 114.0 MiB it compiles to with VMEM assignment off. What VMEM takes is no fixed
    share: 7–112 MiB of the buffer assignment on twelve v5e plans (1.30–2.55× over on eleven
    of them, a GPipe plan 1.34×), and a cap on it fitted to five (58 MiB) read 0.79–1.27×
    there and 0.02–1.27× on six held out, so the calculator carries no VMEM term: on TPU its
    figure reads over on small steps. Scanned layers at seq_len 512 under blockwise attention
    read under instead (0.84× of small on a v5e 2x2), and not for want of a buffer: the HBM
    buffer assignment XLA:TPU dumps holds exactly the census's stacks (six MLP-wide bf16 and
    four float32 stream values a layer), and against it (its temporaries plus the arguments)
    the calculator reads 1.02–1.11× on five scanned v5e plans of 2–8 layers. It is
    `memory_analysis` that counts 10–49 MiB of temporaries more than that assignment places
    in HBM, 0.35–0.50 of the stacked residuals (9.5 MiB on the same step unscanned), VMEM
    assignment on or off; the dumps do not say what those bytes are, so no term stands for them.
    """
    if remat not in REMATS:
        raise ValueError(f"remat={remat!r}: expected one of {', '.join(REMATS)}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer={optimizer!r}: expected one of {', '.join(OPTIMIZER_STATES)}")
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"attention={attention!r}: expected one of {', '.join(ATTENTION_KINDS)}")
    d_ff = 4 * d_model if d_ff is None else d_ff
    n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
    grad_bytes = param_bytes if grad_bytes is None else grad_bytes
    opt_state_bytes = param_bytes if opt_state_bytes is None else opt_state_bytes
    c, shards, batch_shards = compute_bytes, fsdp * model * stage, data * fsdp * stage
    tokens = batch_size * seq_len / batch_shards / accumulate

    d_kv = n_kv_heads * (d_model // n_heads)
    a_layer, a_dots, transient = _layer_activation_bytes(
        d_model,
        d_kv,
        d_ff,
        n_heads,
        seq_len,
        c,
        model=model,
        attention=attention,
        tile=attention_tile,
        backend=backend,
    )
    if census is None and backend == "cpu":
        # XLA:CPU's backward of an unrolled block holds the MLP's gradients (gate, up and
        # their product, split over `model`) and the block's input gradient at once; where
        # the attention's own backward holds less (a kernel whose tiles XLA never sees) that
        # is the block's transient. Read from compiled CPU steps: the step's bytes beyond its
        # layers' slope were the same for naive, blockwise and cpu_flash attention, and grew
        # with d_ff by 3.25 float32 values a column (small, 2 and 4 layers, d_ff 768 and 1536).
        transient = max(transient, c * (3 * d_ff / model + d_model))
    kept_input = c * d_model  # what remat=full keeps of a layer: its input
    differentiated = 0.0  # the layer in its backward: what it holds beyond its kept share
    recomputed_dots = a_layer
    if census is not None:
        a_layer = census.full(model)
        a_dots = kept_input = census.saved(model)
        # the stacked residuals live until the backward loop ends, so on XLA:CPU and XLA:GPU
        # the layer being differentiated writes its gradients to fresh buffers, about one
        # layer's residuals (XLA:TPU reuses its own: its compiled steps hold n layers, not
        # n + 1, read from v5e plans of 2, 4 and 8 layers); under dots only what the policy
        # did not keep is recomputed
        tpu = backend == "tpu"
        differentiated = a_layer if remat == "none" and not tpu else 0.0
        recomputed_dots = a_layer - a_dots
    ticks = pipeline_repeats * microbatches + stage - 1 if stage > 1 else 1
    resident = n_layers * ticks / microbatches if stage > 1 else n_layers
    tick = stage / microbatches if stage > 1 else 1  # a microbatch's tokens over T
    per_token = {
        "none": resident * a_layer + tick * differentiated,
        "full": resident * kept_input + tick * a_layer,
        "dots": resident * a_dots + tick * recomputed_dots,
        "offload": tick * a_layer,
    }[remat]
    host = tokens * resident * c * d_model if remat == "offload" else 0.0
    stage_grads = 0.0
    gpipe = stage > 1 and pipeline_repeats == 1 and census is not None
    if gpipe and remat != "offload" and backend != "tpu":
        # GPipe's backward tick loop differentiates one tick of its stage at a time: XLA:CPU
        # and XLA:GPU copy that tick's residuals of the stage's n_layers/S layers out of the
        # stacked buffers into the layer loop's carry, and that loop sums the stage's weight
        # gradients apart from the tick loop's own sum (both read from the compiled CPU
        # step's loops; an H100 plan agrees). XLA:TPU reuses the stack in place, as it holds
        # no extra layer above: a v5e GPipe plan read 1.52x with these terms.
        layers = n_layers / stage
        per_token += tick * layers * {"none": a_layer, "full": kept_input, "dots": a_dots}[remat]
        head_dim = d_model // n_heads
        per_layer = 2 * d_model + d_model * head_dim * 2 * (n_heads + n_kv_heads)
        per_layer += 3 * d_model * d_ff
        stage_grads = layers * per_layer * grad_bytes / (fsdp * model)
    if stage > 1 and pipeline_repeats > 1:
        # The circular schedule recomputes each tick in its backward (lab/kernels/pipeline.py
        # checkpoints the stage): it keeps every tick's input, the M microbatches stage 0
        # holds for their next repeat, and one tick's chunk of n_layers/(S·R) layers
        # recomputed at a time (under remat, that chunk's own policy).
        chunk = n_layers / (stage * pipeline_repeats)
        recomputed = min(
            chunk * a_layer + differentiated,  # no policy keeps more than the chunk's whole
            {
                "none": chunk * a_layer + differentiated,
                "full": chunk * kept_input + a_layer,
                "dots": chunk * a_dots + recomputed_dots,
                "offload": a_layer,
            }[remat],
        )
        # each tick's input, and its output stacked by the tick loop for the last stage
        per_token = 2 * ticks * tick * c * d_model + stage * c * d_model + tick * recomputed
        if remat == "offload":  # only the recomputed chunk's block inputs go to the host
            host = tokens * tick * chunk * c * d_model
    gathered = 0.0
    if fsdp > 1:
        # a scan gathers each layer's weights again in its backward, as remat does
        layers_kept = n_layers if remat == "none" and census is None else min(2, n_layers)
        gathered = n_params * c / model * layers_kept / n_layers
    elif census is not None:
        gathered = census.weights * n_layers / (stage * model)
    if tie_embeddings:
        gathered += vocab_size * d_model * grad_bytes / shards
    if accumulate > 1:
        gathered += n_params * F32 / shards
    states = OPTIMIZER_STATES[optimizer]
    optimizer_bytes = n_params * (states * opt_state_bytes + master_bytes) / shards
    out = {
        "params": n_params * param_bytes / shards,
        "grads": n_params * grad_bytes / shards,
        "optimizer": 0.0 if offload_optimizer else optimizer_bytes,
        "activations": tokens * per_token,
        "workspace": tokens * (tick * transient + 2 * vocab_size * F32 / model)
        + gathered
        + stage_grads,
    }
    out["total"] = sum(out.values())
    out["host"] = host + (optimizer_bytes if offload_optimizer else 0.0)
    out["devices"] = data * fsdp * model * stage
    out["tokens_per_device"] = tokens
    return out


def lab_param_count(model_cfg) -> int:
    """Parameters of lab/model.py's transformer for a ModelConfig, without building it."""
    m = model_cfg
    d, k = m.d_model, m.d_model // m.n_heads
    per_layer = 2 * d + d * k * (2 * m.n_heads + 2 * m.n_kv_heads) + 3 * d * m.d_ff
    head = 0 if m.tie_embeddings else m.vocab_size * d
    return m.vocab_size * d + head + m.n_layers * per_layer + d


def lab_axes(strategy: str, sizes: dict[str, int]) -> dict[str, int]:
    """The calculator's data/fsdp/model (and stage) split for the lab's rule tables
    (lab/mesh.py).

    dp and fsdp put the batch over every mesh axis; tp splits heads over `model` only and
    leaves `fsdp` as more data parallelism; fsdp+tp uses the three axes as named; the
    pipelines split the layers over `stage` and, inside a stage, are dp, fsdp or tp.
    """
    a, s, b, m = (sizes.get(k, 1) for k in ("data", "stage", "fsdp", "model"))
    return {
        "dp": dict(data=a * b * m, fsdp=1, model=1),
        "fsdp": dict(data=a, fsdp=b * m, model=1),
        "tp": dict(data=a * b, fsdp=1, model=m),
        "fsdp+tp": dict(data=a, fsdp=b, model=m),
        "cp": dict(data=a * b * m, fsdp=1, model=1),  # tokens split over every axis
        "pp": dict(data=a * b * m, fsdp=1, model=1, stage=s),
        "pp+fsdp": dict(data=a, fsdp=b, model=1, stage=s),
        "pp+tp": dict(data=a * b, fsdp=1, model=m, stage=s),
    }[strategy]


def lab_attention_kind(impl: str, backend: str) -> str:
    """The calculator's attention kind for a `lab.kernels.attention` impl on `backend`:
    naive and xla form the L×S scores; blockwise and ring (whose local blocks are plain JAX)
    write tiles to device memory; fused kernels (pallas, cudnn, and the native cpu_flash,
    whose tiles live in its threads' own buffers, outside XLA's) keep them out of XLA's
    buffers. `auto` is read as a fused kernel, what the dispatch picks on GPU and TPU and, on
    CPU, where the native cpu_flash is built; where it may pick blockwise (a CPU without a C++
    compiler, a sequence split over devices) pass the resolved impl, as a resolved config
    names it (this layer cannot ask the kernels which they picked)."""
    if impl == "auto":
        return "flash"
    if impl in ("naive", "xla"):
        return "naive"
    return "blockwise" if impl in ("blockwise", "ring") else "flash"


def predict_lab_step(
    cfg, *, sizes=None, backend: str | None = None, census: LayerCensus | None = None
) -> dict:
    """`predict_training_memory` for the lab's own step of a run config (lab.config.Config:
    batch_size, seq_len, strategy and the model, compute dtype resolved, not "auto"): AdamW,
    dtypes and remat from the model, the attention kind its `attention=` runs on `backend`
    (default: JAX's; pass the target's for ahead-of-time plans), the mesh `sizes`, the
    pipeline, gradient accumulation and offloading the config asks for; `census`
    (lab.model.layer_census of the model) where its layers are scanned, ignored where not.

    The compute dtype and the strategy depend on the platform, so a config straight from
    lab.config.make_config (both "auto") is refused with a ValueError: pass the resolved one,
    `open_session(...).cfg` or `lab.resolve.resolve(...).cfg` (Resolved.cfg)."""
    m = cfg.model
    unresolved = [
        f"{name}={value!r}"
        for name, value in (("dtype", m.dtype), ("strategy", cfg.strategy))
        if value == "auto"
    ]
    if unresolved:
        raise ValueError(
            f"{', '.join(unresolved)}: predict_lab_step needs a resolved config (the compute "
            "dtype and the strategy depend on the platform): pass open_session(...).cfg or "
            "lab.resolve.resolve(...).cfg"
        )
    backend = backend or jax.default_backend()
    kind = lab_attention_kind(m.attention, backend)
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}
    return predict_training_memory(
        n_params=lab_param_count(m),
        n_layers=m.n_layers,
        d_model=m.d_model,
        n_heads=m.n_heads,
        n_kv_heads=m.n_kv_heads,
        d_ff=m.d_ff,
        seq_len=cfg.seq_len,
        batch_size=cfg.batch_size,
        vocab_size=m.vocab_size,
        param_bytes=itemsize[m.param_dtype],
        compute_bytes=itemsize[m.dtype],
        optimizer="adamw",
        remat=m.remat,
        tie_embeddings=m.tie_embeddings,
        attention=kind,
        microbatches=max(m.microbatches, 1),
        pipeline_repeats=m.pipeline_repeats,
        accumulate=cfg.accumulate,
        offload_optimizer=cfg.offload_optimizer,
        backend=backend,
        census=census if m.scan_layers else None,
        **lab_axes(cfg.strategy, sizes or {}),
    )


# ------------------------------------------------------------------------------- serving


def kv_cache_bytes(
    *,
    n_layers: int,
    n_kv_heads: int,
    head_dim: int,
    context: int,
    batch: int,
    bytes_per_value: float = 2,
    int8_scales: bool = False,
) -> float:
    """Keys and values of every layer for `batch` sequences of `context` tokens:
    2 · layers · kv heads · head_dim · context · batch · bytes. An int8 cache (lab/quant.py)
    adds one float32 scale per (layer, k or v, kv head, token, sequence)."""
    values = 2 * n_layers * n_kv_heads * head_dim * context * batch
    scales = 2 * n_layers * n_kv_heads * context * batch * F32 if int8_scales else 0
    return values * bytes_per_value + scales


def predict_serving_memory(
    model_cfg,
    *,
    batch: int,
    context: int,
    weight_bytes: float = 2,
    cache_bytes: float = 2,
    devices: int = 1,
    offload_fraction: float = 0.0,
    weight_split: float | None = None,
    cache_split: float | None = None,
) -> dict:
    """Bytes per device to serve `model_cfg` (a lab.config.ModelConfig or anything with its
    field names): the weights (`weight_bytes` per parameter: 2 for bf16, 1 for int8, 0.5 for
    int4; int8/int4 add one float32 scale per output channel, ignored here: < 0.1 %), the KV
    cache at `batch` × `context` (`cache_bytes` per value; 1 = int8 with its per-token
    scales), both split evenly over `devices` (tensor parallel: heads and MLP columns), and
    `offload_fraction` of the weights held in host memory instead (streamed in per step).
    `weight_split` and `cache_split`, where given, are the ways each is split instead (a
    mesh's data axis splits the cache's sequences and keeps a whole copy of the weights on
    each device). Activations of one decode step are a few vectors per sequence: not
    counted."""
    m = model_cfg
    weights = lab_param_count(m) * weight_bytes
    cache = kv_cache_bytes(
        n_layers=m.n_layers,
        n_kv_heads=m.n_kv_heads,
        head_dim=m.d_model // m.n_heads,
        context=context,
        batch=batch,
        bytes_per_value=cache_bytes,
        int8_scales=cache_bytes == 1,
    )
    host = weights * offload_fraction
    w_split = devices if weight_split is None else weight_split
    out = {
        "weights": (weights - host) / w_split,
        "kv_cache": cache / (devices if cache_split is None else cache_split),
        "host_weights": host / w_split,
    }
    out["total"] = out["weights"] + out["kv_cache"]
    return out
