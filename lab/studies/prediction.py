"""How wrong the step-time model is: predictions of published measurements, compiled here.

Each point of `lab/predict/published.json` (a figure some publisher measured, the line it was
read from, the lab configuration that reproduces it and what differs) is compiled for its
target ahead of time — the training step of `lab.run`, a GEMM, a copy or an all-reduce — and
the model (lab/predict/model.py) predicts its time on the target's spec entry. The figure is
compared in the publisher's own unit (TFLOP/s per chip from the lab's analytic model FLOPs,
tokens/s per chip, MFU, bus bandwidth, TFLOP/s, GB/s).

Honest fitting: the model's free parameters (compute and memory efficiency, the fixed cost
per op, per collective and per call of the program) are fitted per vendor on the CALIBRATION
points only: for each (hardware, workload) group of usable points, the first by id. Every
other usable point is held out, and the error reported is the held-out one. Points the lab
cannot express stay in the file with their reason and are listed as dropped.

Compiled programs are cached as HLO text under `cache_dir`, keyed by the point, its lab
configuration, the jax version and what builds programs (the lab code but the timing model,
the reports and the command lines; the compilers' versions: `program_source`), so a second
run only re-predicts, and a change to the model, its kernels or its sharding compiles afresh.
"""

import dataclasses
import functools
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from lab import plans
from lab.config import did_you_mean, make_config
from lab.errors import ConfigError
from lab.measure import hlo, memory, records, specs
from lab.measure.cost import transformer_flops_per_token
from lab.model import count_nonembedding_params
from lab.parallel import collectives_hlo
from lab.predict import machines
from lab.predict.model import Schedule, predict
from lab.predict.step import FITS, attention_flops_per_device
from lab.resolve import defaults
from lab.session import open_session
from lab.summary import flops_per_token

POINTS = Path(__file__).resolve().parents[1] / "predict" / "published.json"
_HW = {
    "tpu-v4": "tpu-v4",
    "tpu-v5e": "tpu-v5e",
    "tpu-v5p": "tpu-v5p",
    "tpu-v6e": "tpu-v6e",
    "h100": "h100-sxm",
    "h200": "h200",
    "a100": "a100-sxm4-80gb",
    "mi300x": "mi300x",
}
CACHE_DIR = Path("results/prediction-cache")


def use_cache(folder) -> Path:
    """Keep the compiled programs in `folder` for the rest of this process (the ledger's
    cache_dir=, by default its out_dir's prediction-cache): nothing in the working folder."""
    global CACHE_DIR
    CACHE_DIR = Path(folder)
    return CACHE_DIR


@dataclasses.dataclass(frozen=True)
class Row:
    """One published point beside the model's prediction of it."""

    id: str
    publisher: str
    hardware: str  # e.g. tpu-v5p × 64
    workload: str
    unit: str
    published: float
    predicted: float | None
    role: str  # calibration | held-out | dropped
    note: str = ""  # why dropped, or what the comparison assumes

    @property
    def error(self) -> float | None:
        """predicted / published − 1."""
        if self.predicted is None or not self.published:
            return None
        return self.predicted / self.published - 1.0


@dataclasses.dataclass(frozen=True)
class Summary:
    rows: tuple[Row, ...]
    fits: dict  # vendor → fitted parameters
    held_out: dict  # vendor or 'all' → {"n", "median", "worst"}
    calibration: dict


def load_points(only: tuple[str, ...] = ()) -> list[dict]:
    points = json.loads(POINTS.read_text())["points"]
    if only:
        unknown = sorted(set(only) - {p["id"] for p in points})
        if unknown:
            hint = did_you_mean(unknown[0], [p["id"] for p in points])
            raise ConfigError(f"only={','.join(unknown)}: no such point in {POINTS.name}{hint}")
        points = [p for p in points if p["id"] in only]
    return points


def vendor(point: dict) -> str:
    return "tpu" if point["hardware"]["kind"].startswith("tpu") else "gpu"


def calibration_ids(points: list[dict]) -> set[str]:
    """The calibration set, by rule: the first usable point (by id) of each group of points
    the model sees alike: one workload on hardware whose datasheet figures that workload is
    predicted from are the same (`model_view`). Everything else usable is held out. Grouping
    by the hardware's name instead calibrated an H200 point and held out its H100 twin
    (same peaks, same NVLink): a "held-out" figure the calibration had already pinned."""
    first: dict[tuple, str] = {}
    for p in sorted(points, key=lambda p: p["id"]):
        if p.get("usable") and _expressible(p) is None:
            first.setdefault(model_view(p), p["id"])
    return set(first.values())


def model_view(point: dict) -> tuple:
    """What the model knows of a point's hardware for its workload: a product's peaks, a
    copy's memory bandwidth, an all-reduce's links, a whole step's all three. A product is
    taken as compute-bound: a thin one below its chip's ridge also reads the bandwidth, and
    two such on chips of other bandwidths would be grouped as alike when they are not (the
    published products with a twin on another chip are all above the ridge)."""
    spec = specs.SPECS[spec_key(point)]
    peaks = tuple(sorted(spec.peak_flops.items()))
    views = {
        "gemm": (peaks,),
        "copy": (spec.memory_bandwidth,),
        "all-reduce": (spec.interconnect_bandwidth,),
    }
    seen = views.get(point["workload"], (peaks, spec.memory_bandwidth, spec.interconnect_bandwidth))
    return point["workload"], vendor(point), seen


def _expressible(point: dict) -> str | None:
    """Why the lab cannot predict this point (None if it can)."""
    if not point.get("usable"):
        return point.get("why_not") or "not usable"
    if point["workload"] == "train" and not point.get("lab_config"):
        return "no lab configuration"
    return None


# ---------------------------------------------------------------------------- programs


def why_refused(point: dict, refusal: str) -> str:
    """A compiler's refusal with what the lab would need to express the published run: a
    training step that needs more HBM than the chip has under the lab's nearest remat option
    (MaxText's `minimal` saves fewer activations than the lab's `dots`, which saves every
    matmul output; `full` would fit but recompute more than the published run)."""
    if point["workload"] != "train" or "available" not in refusal:
        return refusal
    if not point["publisher"].endswith("MaxText"):
        lab = (point.get("lab_config") or {}).get("remat")
        return (
            f"{refusal}; the published run fits, so its memory plan (recompute, optimizer-state "
            f"and activation sharding) is not the lab's remat={lab} step, and the point is "
            "dropped, not bent"
        )
    stated = (point.get("setup") or {}).get("remat_policy")
    lab = (point.get("lab_config") or {}).get("remat")
    if stated == "minimal":
        why = (
            f"MaxText's remat_policy=minimal keeps less than the lab's nearest option "
            f"(remat={lab}); remat=full would recompute more than the published run, so the "
            "point is dropped, not bent"
        )
    elif stated:
        why = f"the lab's step under remat={lab} keeps more than MaxText's {stated} run did"
    else:
        why = f"MaxText's remat policy is not stated; the lab's remat={lab} keeps more"
    return f"{refusal}; {why}"


# lab's code that never changes a compiled program: the step-time model and its fits, the
# renderers, the command lines (lab/predict/step.py counts the kernels' FLOPs a cached
# program keeps: it is hashed)
_NOT_PROGRAM = ("predict/model.py", "predict/machines.py", "report/", "tools/")
_COMPILERS = ("jaxlib", "libtpu", "jax-cuda13-plugin", "jax-cuda13-pjrt")


@functools.lru_cache(maxsize=1)
def program_source() -> str:
    """A hash of what builds the points' programs: the lab code (lab/**/*.py and the native
    kernels' sources but `_NOT_PROGRAM`) and the compilers' versions installed (jaxlib,
    libtpu, the CUDA plugin): a cached program built otherwise is never reused."""
    from importlib import metadata

    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted([*root.rglob("*.py"), *root.rglob("*.cc")]):
        rel = f.relative_to(root).as_posix()
        if not rel.startswith(_NOT_PROGRAM):
            h.update(rel.encode() + b"\0" + f.read_bytes())
    for name in _COMPILERS:
        try:
            h.update(f"{name}={metadata.version(name)}".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{name}=none".encode())
    return h.hexdigest()[:16]


def _key(point: dict) -> str:
    what = json.dumps([point["id"], point.get("lab_config"), point.get("lab_program")], sort_keys=1)
    return hashlib.sha256(f"{what}|{jax.__version__}|{program_source()}".encode()).hexdigest()[:16]


def _train_program(point: dict) -> dict:
    cfg = make_config(**{**point["lab_config"], "compile_only": True})
    session = open_session(cfg)
    t = session.trainer
    compiled = t.lower().compile()
    fpt, _ = flops_per_token(t.cfg, t.abstract_state.params)
    # every (query, key) pair counted, as PaLM counts (the publisher's count where a point says
    # so: Predictor.model_flops); a property of the model, kept beside the causal count
    m = t.cfg.model
    n = count_nonembedding_params(t.abstract_state.params, m)
    all_pairs = transformer_flops_per_token(n, m.n_layers, t.cfg.seq_len, m.d_model)
    return {
        "hlo": compiled.as_text(),
        "mesh": dict(t.mesh.shape),
        "devices": t.mesh.size,
        "tokens": t.cfg.batch_size * t.cfg.seq_len,
        "model_flops": fpt * t.cfg.batch_size * t.cfg.seq_len,
        "model_flops_all_pairs": all_pairs * t.cfg.batch_size * t.cfg.seq_len,
        "custom_flops": attention_flops_per_device(t.cfg, t.mesh.size),
        # bytes one device needs (arguments + outputs - aliased + temporaries): XLA:GPU
        # compiles a step larger than the chip's HBM (it only warns), so run() checks it
        "memory_bytes": (memory.compiled_memory(compiled) or {}).get("total_bytes"),
        # what the target's compiler lets a program hold (a TPU's), where it says
        "capacity_bytes": memory.device_capacity_bytes(t.mesh.devices.flat[0]),
        "dtype": t.cfg.model.dtype,
        "device_kind": session.info.device_kind,
        "topology": t.cfg.target.split(":")[-1],
    }


SERVE_KEYS = ("module", "plan_batch", "plan_context", "prefill_batches", "prompt_len", "int8")


def _serve_program(point: dict) -> dict:
    """A serving point's program: lab.serve's decode step (one token for every sequence of the
    batch over a cache of `plan_context` slots) or its prefill (`prompt_len` tokens), compiled
    for the target with the weights sharded as lab.serve shards them (unscanned layers). The
    config is resolved for decoding that batch as lab.serve resolves it: a batch that does not
    split over the mesh is one line, before anything is built."""
    from lab import decode, quant

    lc = point["lab_config"]
    prefill = point["workload"] == "prefill"
    if prefill:
        batch, context = int(str(lc.get("prefill_batches", 1)).split(",")[0]), lc["prompt_len"]
    else:
        batch, context = int(lc["plan_batch"]), int(lc["plan_context"])
    keys = {k: v for k, v in lc.items() if k not in SERVE_KEYS}
    cfg = make_config(**{**keys, "compile_only": True, "scan_layers": False})
    session = open_session(cfg, purpose="decode", batches=(batch,))
    t = session.trainer
    abstract = t.abstract_state.params
    if lc.get("int8"):
        abstract = jax.eval_shape(quant.quantize_params, abstract)
    shardings = decode.param_shardings(t.state_shardings.params, abstract)
    sds = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)  # noqa: E731
    abstract = jax.tree.map(sds, abstract, shardings)
    dec = decode.make_decoder(t.cfg.model, t.mesh, t.rules, shardings, batch=batch, max_len=context)
    cache = jax.tree.map(sds, dec.abstract_cache, dec.cache_sharding)
    rows = dec.batch_sharding
    with jax.set_mesh(t.mesh):
        if prefill:
            prompts_sh = jax.sharding.NamedSharding(
                t.mesh, jax.sharding.PartitionSpec(*rows.spec, None)
            )
            prompts = jax.ShapeDtypeStruct((batch, context), jnp.int32, sharding=prompts_sh)
            lengths = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rows)
            compiled = dec.prefill.lower(abstract, prompts, lengths, cache).compile()
        else:
            tokens = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rows)
            compiled = dec.step.lower(abstract, tokens, cache).compile()
    return {
        "hlo": compiled.as_text(),
        "mesh": dict(t.mesh.shape),
        "devices": t.mesh.size,
        "batch": batch,
        "context": context,
        "dtype": t.cfg.model.dtype,
        "device_kind": session.info.device_kind,
        "topology": t.cfg.target.split(":")[-1],
    }


def _op_program(point: dict) -> dict:
    prog = point["lab_program"]
    target = prog["target"]
    plans.prepare_host(target)
    devices = plans.topology_devices(target)
    op = prog["op"]
    if op == "matmul":
        dtype = jnp.dtype(prog["dtype"])
        m, n, k = prog["m"], prog["n"], prog["k"]
        mesh = jax.sharding.Mesh(np.array(devices[:1]), ("data",))
        sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        a = jax.ShapeDtypeStruct((m, k), dtype, sharding=sh)
        b = jax.ShapeDtypeStruct((k, n), dtype, sharding=sh)
        # Accumulated in f32 and written in the benchmark's output dtype: the bytes written
        # decide a tall, thin product's time. (Asked for directly, an f16 result of fp8
        # operands compiles to an f16 product of converted operands, at f16's peak.)
        out = jnp.dtype(prog.get("out_dtype", "float32"))

        def fn(a, b):
            return jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(out)

        compiled = jax.jit(fn).lower(a, b).compile()
        return {"hlo": compiled.as_text(), "mesh": {"data": 1}, "flops": 2.0 * m * n * k}
    if op == "copy":
        n = (1 << 30) // 4  # 1 GiB of float32: far past any cache
        mesh = jax.sharding.Mesh(np.array(devices[:1]), ("data",))
        sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        x = jax.ShapeDtypeStruct((n,), jnp.float32, sharding=sh)
        compiled = jax.jit(lambda x: x * 1.0001).lower(x).compile()
        return {"hlo": compiled.as_text(), "mesh": {"data": 1}, "bytes": 2.0 * 4 * n}
    if op == "all-reduce":
        w = prog["devices"]
        mesh = jax.sharding.Mesh(np.array(devices[:w]), ("data",))
        per = prog["bytes"] // 4
        sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
        x = jax.ShapeDtypeStruct((per * w,), jnp.float32, sharding=sh)
        body = jax.shard_map(
            lambda x: jax.lax.psum(x, "data"),
            mesh=mesh,
            in_specs=jax.sharding.PartitionSpec("data"),
            out_specs=jax.sharding.PartitionSpec("data"),
        )
        # donated: reduced in place, as nccl-tests does (kept, XLA copies the whole input
        # first, a read and a write of the buffer that no all-reduce benchmark makes)
        compiled = jax.jit(body, donate_argnums=0).lower(x).compile()
        return {"hlo": compiled.as_text(), "mesh": {"data": w}, "bytes": float(prog["bytes"])}
    raise ConfigError(f"{point['id']}: unknown op {op!r}")


def program(point: dict, cache_dir: Path) -> dict:
    """The compiled program of a point (HLO text and what the comparison needs), cached."""
    path = Path(cache_dir) / f"{point['id']}-{_key(point)}.json"
    if path.exists() and (out := _read_cached(path)) is not None:
        if "hlo" not in out or "memory_bytes" in out or not _needs_memory(point):
            return out  # (a training step cached before its memory was kept: compiled again)
    t0 = time.perf_counter()
    try:
        build = {"train": _train_program, "decode": _serve_program, "prefill": _serve_program}
        out = build.get(point["workload"], _op_program)(point)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 — a compiler's refusal (memory, tiles) varies
        why = plans.refusal(e)
        if why is None and not isinstance(e, jax.errors.JaxRuntimeError):
            raise  # not the compiler's answer (e.g. the lab's own bug): never cached as one
        first = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        out = {"refused": f"the compiler refuses it here: {why or first}"}
    out["compile_s"] = time.perf_counter() - t0
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # whole or absent: a kill
        # mid-write leaves no half file for the next run; the digest tells an entry changed
        # since (a hand edit, a damaged disk) from the compiler's answer
        tmp.write_text(json.dumps({**out, "digest": _digest(out)}))
        tmp.replace(path)
    except OSError as e:  # a cache that cannot be written costs a compile next time, no more
        if not _unwritable_said.get(str(path.parent)):
            _unwritable_said[str(path.parent)] = True
            print(
                f"warning: compiled programs are not cached in {path.parent} "
                f"({e.strerror or e}): each is compiled again next time",
                file=sys.stderr,
            )
    return out


_unwritable_said: dict[str, bool] = {}  # one warning per cache folder and process


def _digest(out: dict) -> str:
    return hashlib.sha256(json.dumps(out, sort_keys=True).encode()).hexdigest()


def _read_cached(path: Path) -> dict | None:
    """A cached program as the compile wrote it, or None where the entry cannot be trusted:
    cut short by a kill, or changed since it was written (its digest differs: valid JSON of
    another shape would otherwise fail later, or drop a figure): compiled again."""
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(out, dict) or not isinstance(digest := out.pop("digest", None), str):
        return None
    return out if digest == _digest(out) else None


def _needs_memory(point: dict) -> bool:
    """A training step: compiled deviceless, XLA:GPU and XLA:TPU (JAX 0.12's libtpu compiled a
    v5e step of 18.2 GB for a 16 GB chip) may give a program the chip cannot hold, so its
    bytes are checked against the chip's HBM here."""
    return point["workload"] == "train"


def too_big(point: dict, prog: dict) -> str | None:
    """'needs 89.6 GB, 80 GB available' where the compiled step does not fit the chip: against
    what the target's compiler lets a program hold where it says (a TPU's), else the spec."""
    need = prog.get("memory_bytes")
    have = prog.get("capacity_bytes") or specs.SPECS[spec_key(point)].memory_bytes
    if need and need > have:
        return f"the compiled step needs {need / 1e9:.1f} GB, {have / 1e9:.0f} GB available"
    return None


# ---------------------------------------------------------------------------- prediction


def spec_key(point: dict) -> str:
    """The spec entry a point is predicted on: its hardware's, or `hardware.spec` where the
    program compiled for one chip is predicted on another chip's datasheet (MI300X from the
    H100's program: no compiler for it here)."""
    return point["hardware"].get("spec") or _HW[point["hardware"]["kind"]]


def _machine(point: dict, prog: dict, fit: dict | None):
    spec = specs.SPECS[spec_key(point)]
    if vendor(point) == "tpu":
        return machines.tpu_machine(spec, prog.get("topology", "1x1"), prog["mesh"], fit)
    return machines.gpu_machine(spec, prog["mesh"], fit=fit)


class Predictor:
    """A point's program parsed once, predicted under any fit (the fit re-times it only)."""

    def __init__(self, point: dict, prog: dict):
        self.point, self.prog = point, prog
        self.program = hlo.parse(prog["hlo"])
        found = collectives_hlo.parse(prog["hlo"], prog["mesh"])
        self.collectives = {c.name: c for c in found}
        self._schedule = None

    def prediction(self, **fit):
        """The model's full prediction (time, breakdown, top ops) under `fit`."""
        machine = _machine(self.point, self.prog, fit or None)
        return predict(
            self.program,
            machine,
            self.collectives,
            custom_flops=self.prog.get("custom_flops", 0.0),
        )

    def seconds(self, **fit) -> float:
        """`prediction(**fit).seconds` from the program's Schedule: a few array operations,
        not a walk of every op, which is what lets a fit and the leave-one-out try
        thousands of parameter sets."""
        if self._schedule is None:
            machine = _machine(self.point, self.prog, None)
            custom = self.prog.get("custom_flops", 0.0)
            self._schedule = Schedule(self.program, machine, self.collectives, custom_flops=custom)
        return self._schedule.seconds(**fit)

    @property
    def model_flops(self) -> float:
        """A step's model FLOPs as the publisher counted them: every (query, key) pair where
        the point says its attention FLOPs are non-causal (MaxText before its causal fix,
        Megatron-LM's count of the time), else the lab's causal count."""
        flag = str(self.point.get("setup", {}).get("attention_flops", ""))
        if flag.startswith("non-causal"):
            return self.prog["model_flops_all_pairs"]
        return self.prog["model_flops"]

    def figure(self, seconds: float) -> float:
        """The published figure's unit, from a predicted time."""
        unit = self.point["figure"]["unit"]
        prog, chips = self.prog, self.point["hardware"]["chips"]
        if self.point["workload"] == "train":
            if unit.startswith("TFLOP/s per chip"):
                return self.model_flops / seconds / chips / 1e12
            if unit.startswith("tokens/s per chip"):
                return prog["tokens"] / seconds / chips
            if unit == "MFU":
                spec = specs.SPECS[spec_key(self.point)]
                peak = spec.peak_flops.get(prog["dtype"]) or spec.peak_flops["bfloat16"]
                return self.model_flops / seconds / (chips * peak)
        if self.point["workload"] == "decode":  # one token per sequence per step
            per_chip = unit.startswith("tokens/s per chip")
            return prog["batch"] / seconds / (chips if per_chip else 1)
        if self.point["workload"] == "prefill" and unit.startswith("ms"):
            return seconds * 1e3
        if self.point["workload"] == "gemm":
            return prog["flops"] / seconds / 1e12
        if self.point["workload"] == "copy":
            return prog["bytes"] / seconds / 1e9
        if self.point["workload"] == "all-reduce":
            w = prog["mesh"]["data"]
            return prog["bytes"] / seconds * 2 * (w - 1) / w / 1e9
        raise ConfigError(f"{self.point['id']}: cannot compare in {unit!r}")

    def measured_seconds(self) -> float:
        """The published figure as the time of the same program (what the fit matches)."""
        value = float(self.point["figure"]["value"])
        if self.point["figure"]["unit"].startswith("ms"):  # a time, not a rate
            return value / 1e3
        return self.figure(1.0) / value  # figure ∝ 1 / time


def _stats(rows: list[Row]) -> dict:
    errs = [abs(r.error) for r in rows if r.error is not None]
    ratios = [max(r.predicted / r.published, r.published / r.predicted) for r in rows if r.error]
    if not errs:
        return {"n": 0}
    return {
        "n": len(errs),
        "median": float(np.median(errs)),
        "worst": float(max(ratios, default=1.0)),
        "what": "published points",
    }


NOT_COMPILED = "not compiled here: "  # a point this environment has no compiler for


def _predictors(points: list[dict], cache_dir: Path, tick) -> tuple[dict, dict]:
    """({id: Predictor} for every usable point, {id: why refused}): each point compiled or
    read from the cache."""
    predictors, refused = {}, {}
    for p in points:
        if _expressible(p):
            continue
        tick(f"compile {p['id']}")
        try:
            prog = program(p, cache_dir)
        except ConfigError as e:  # this environment cannot compile it (no plugin, no libtpu)
            refused[p["id"]] = f"{NOT_COMPILED}{e}"
            continue
        except Exception as e:  # noqa: BLE001 — shown, not cached: the next run tries again
            first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
            refused[p["id"]] = f"failed here ({type(e).__name__}: {first}); not cached"
            continue
        if "refused" in prog:  # e.g. the lab's step needs more HBM than the chip has
            refused[p["id"]] = why_refused(p, prog["refused"])
            continue
        if big := too_big(p, prog):  # the same, where the compiler does not refuse it
            refused[p["id"]] = why_refused(p, big)
            continue
        predictors[p["id"]] = Predictor(p, prog)
    return predictors, refused


def _calibrated_vendors(points: list[dict]) -> list[str]:
    """The vendors ("tpu", "gpu") with a calibration point among `points`: each gets a fit."""
    calib = calibration_ids(load_points())
    return [v for v in ("tpu", "gpu") if any(p["id"] in calib and vendor(p) == v for p in points)]


def ticks(points: list[dict], refit: bool = True) -> int:
    """How many steps `run` reports to its `progress`: a compile for each point the model can
    express and, with `refit` (no saved `fits`), a fit for each vendor calibrated among them."""
    fits = len(_calibrated_vendors(points)) if refit else 0
    return sum(_expressible(p) is None for p in points) + fits


def run(
    points: list[dict],
    cache_dir: Path,
    *,
    progress=None,
    write_fits: bool = False,
    fits: dict | None = None,
):
    """Every point compiled (or read from the cache), the fit per vendor on the calibration
    points, then every usable point predicted with it; `fits` (vendor → parameters, e.g.
    the saved ones) predicts with those instead of fitting on the points given."""
    tick = progress or (lambda label: None)
    calib = calibration_ids(load_points())  # the rule runs over the whole file, always
    predictors, refused = _predictors(points, cache_dir, tick)
    given, fits = fits is not None, dict(fits or {})
    for v in () if given else _calibrated_vendors(points):
        pts = [
            (pr.seconds, pr.measured_seconds())
            for i, pr in predictors.items()
            if i in calib and vendor(pr.point) == v
        ]
        if not pts:  # its calibration points did not compile here: the roofline's own
            tick(f"fit {v}: no calibration point compiled")
            continue
        tick(f"fit {v} on {len(pts)} calibration points")
        fits[v] = machines.fit(pts, params=machines.FIT_PARAMS)
    rows = []
    for p in points:
        pid = p["id"]
        fig = p["figure"]
        base = dict(
            id=pid,
            publisher=p["publisher"],
            hardware=f"{p['hardware']['kind']} × {p['hardware']['chips']}",
            workload=p["workload"],
            unit=fig["unit"],
            published=float(fig["value"]),
        )
        if pid not in predictors:
            why = refused.get(pid) or _expressible(p) or ""
            rows.append(Row(**base, predicted=None, role="dropped", note=why))
            continue
        pr = predictors[pid]
        fit = fits.get(vendor(p))
        rows.append(
            Row(
                **base,
                predicted=pr.figure(pr.seconds(**(fit or {}))),
                role="calibration" if pid in calib else "held-out",
            )
        )
    held = [r for r in rows if r.role == "held-out"]
    held_out = {"all": _stats(held)}
    for v in ("tpu", "gpu"):
        held_out[v] = _stats([r for r in held if r.hardware.startswith("tpu") == (v == "tpu")])
    calibration = _stats([r for r in rows if r.role == "calibration"])
    summary = Summary(tuple(rows), fits, held_out, calibration)
    # a fit is saved from every point, each compiled: where some failed to compile here (a
    # missing plugin, a folder that cannot be written) the saved fit is kept as it was
    if write_fits and len(points) == len(load_points()) and not failed_here(summary):
        save_fits(summary)
    return summary


def failed_here(summary: Summary) -> list:
    """The rows whose program could not be compiled in this environment (an error, or a
    missing compiler: the gpu-plan extra, libtpu)."""
    return [r for r in summary.rows if (r.note or "").startswith(("failed here", NOT_COMPILED))]


def leave_one_out(cache_dir: Path, *, progress=None) -> list[tuple[str, float]]:
    """(point id, predicted / published time) for each calibration point of a vendor with
    several, the free parameters fitted on that vendor's other calibration points
    (machines.leave_one_out): the model's error on points its fit did not see, measured
    without touching the held-out set, so a change to the model's form can be judged by it
    before the held-out error is looked at. One fit per point, each trial a program's
    Schedule: seconds in all."""
    tick = progress or (lambda label: None)
    calib = calibration_ids(load_points())
    predictors, _ = _predictors([p for p in load_points() if p["id"] in calib], cache_dir, tick)
    out = []
    for v in ("tpu", "gpu"):
        ids = sorted(i for i, pr in predictors.items() if vendor(pr.point) == v)
        if len(ids) < 2:
            continue
        pts = [(predictors[i].seconds, predictors[i].measured_seconds()) for i in ids]
        ratios = machines.leave_one_out(
            pts, params=machines.FIT_PARAMS, tick=lambda k, ids=ids: tick(f"fit without {ids[k]}")
        )
        out += zip(ids, ratios, strict=True)
    return out


def leave_one_out_ticks() -> int:
    """How many steps `leave_one_out` reports: a compile per calibration point the model can
    express, a fit per such point of a vendor with two or more (fewer where a compile is
    refused here)."""
    calib = [p for p in load_points() if p["id"] in calibration_ids(load_points())]
    usable = [p for p in calib if _expressible(p) is None]
    per_vendor = [sum(vendor(p) == v for p in usable) for v in ("tpu", "gpu")]
    return len(usable) + sum(n for n in per_vendor if n >= 2)


def leave_one_out_line(ratios: list[tuple[str, float]]) -> str:
    if not ratios:
        return "calibration leave-one-out: no vendor has two calibration points"
    errs = [abs(r - 1) for _, r in ratios]
    worst = max(max(r, 1 / r) for _, r in ratios)
    return (
        f"calibration leave-one-out: {len(ratios)} points, median |predicted / published time "
        f"− 1| {float(np.median(errs)):.0%}, worst {worst:.2f}×"
    )


def save_fits(summary: Summary) -> Path:
    """lab/predict/fits.json: what lab.run's predictions print as the model's error."""
    data = json.loads(FITS.read_text()) if FITS.exists() else {}
    for v in ("tpu", "gpu"):
        if v not in summary.fits:  # no calibration point usable: the roofline predicts
            data[v] = {
                "fit": None,
                "calibration": [],
                "held_out": summary.held_out[v] if summary.held_out[v].get("n") else None,
                "source": "python -m lab.tools.prediction (no usable calibration point: the "
                "roofline, efficiencies 1 and no fixed costs, predicts)",
            }
        else:
            data[v] = {
                "fit": summary.fits[v],
                "calibration": sorted(
                    r.id
                    for r in summary.rows
                    if r.role == "calibration" and r.hardware.startswith("tpu") == (v == "tpu")
                ),
                "held_out": summary.held_out[v] if summary.held_out[v].get("n") else None,
                "source": "python -m lab.tools.prediction (published points, held out)",
            }
    data["validation"] = {
        "rows": [{**dataclasses.asdict(r), "error": r.error} for r in summary.rows],
        "held_out": summary.held_out,
        "calibration": summary.calibration,
        "jax": jax.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "source": "python -m lab.tools.prediction",
    }
    FITS.write_text(json.dumps(data, indent=1) + "\n")
    return FITS


def saved_rows() -> list[Row]:
    """The validation table as last measured (lab/predict/fits.json), for the ledger."""
    from lab.predict.step import fits

    rows = (fits().get("validation") or {}).get("rows") or []
    return [Row(**{k: v for k, v in r.items() if k != "error"}) for r in rows]


def published_mfu(point: dict) -> float | None:
    """The MFU a published point's figure states or implies. Training: its MFU, or its TFLOP/s
    per chip over the chip's datasheet peak at bf16 (None for a unit that needs the
    publisher's FLOP count). Prefill: the forward's model FLOPs (`prefill_flops`) over the time
    to first token × the chips' peak at the point's dtype. None for anything else."""
    fig = point["figure"]
    if point["workload"] == "prefill":
        flops = prefill_flops(point)
        if flops is None or not fig["unit"].startswith("ms"):
            return None
        spec = specs.SPECS[spec_key(point)]
        dtype = point["lab_config"].get("dtype", "bfloat16")
        peak = spec.peak_flops.get(dtype) or spec.peak_flops["bfloat16"]
        return flops / (float(fig["value"]) / 1e3 * point["hardware"]["chips"] * peak)
    if point["workload"] != "train":
        return None
    if fig.get("mfu"):
        return float(fig["mfu"])
    if fig["unit"] == "MFU":
        return float(fig["value"])
    if fig["unit"].startswith("TFLOP/s per chip"):
        return float(fig["value"]) * 1e12 / specs.SPECS[spec_key(point)].peak_flops["bfloat16"]
    return None


def prefill_flops(point: dict) -> float | None:
    """Model FLOPs of a published prefill: batch × prompt tokens × the forward's FLOPs per
    token (lab.measure.cost, the PaLM convention: 2·N + 4·layers·seq·d_model, N without the
    embedding table), N the parameter count the model's paper states (lab.config
    STATED_PARAMS). None for a model with no stated count."""
    from lab.config import PRESETS, STATED_PARAMS
    from lab.measure import cost

    lc = point["lab_config"]
    if lc.get("model") not in STATED_PARAMS:
        return None
    m = PRESETS[lc["model"]]
    batch = int(str(lc.get("prefill_batches", 1)).split(",")[0])
    seq = int(lc["prompt_len"])
    nonembed = STATED_PARAMS[lc["model"]] - m["vocab_size"] * m["d_model"]
    per_token = cost.transformer_flops_per_token(
        nonembed, m["n_layers"], seq, m["d_model"], training=False
    )
    return batch * seq * per_token


WORKLOAD_NAMES = {"train": "training", "prefill": "prefill"}


def fallback_error(mfu: float, ids=None, workload: str = "train") -> dict:
    """The old rule's error on the same held-out points: an accelerator's step predicted as its
    datasheet peak × an MFU measured on this CPU, i.e. every point of the `workload`
    ("train": a training step's MFU; "prefill": a forward pass's) predicted at MFU `mfu`. The
    rule predicts nothing else, so only held-out points of that workload count (`ids`;
    default: those of the last validation, lab/predict/fits.json)."""
    if ids is None:
        ids = {r.id for r in saved_rows() if r.role == "held-out" and r.workload == workload}
    errs, ratios = [], []
    for p in load_points():
        pub = published_mfu(p) if p["id"] in ids and p["workload"] == workload else None
        if pub:
            errs.append(abs(mfu / pub - 1.0))
            ratios.append(max(mfu / pub, pub / mfu))
    if not errs:
        return {"n": 0}
    return {"n": len(errs), "median": float(np.median(errs)), "worst": float(max(ratios))}


def fallback_statement(mfu: float, workload: str = "train") -> str:
    """'fallback rule (datasheet peak × the 7.2% MFU measured here): its error 85% median, worst
    7×, on 5 held-out published training points', measured now for this `mfu` against the
    points of the workload whose MFU it is (a training step's against training points, a
    forward pass's against prefill points)."""
    e = fallback_error(mfu, workload=workload)
    kind = WORKLOAD_NAMES[workload]
    rule = f"fallback rule (datasheet peak × the {mfu:.1%} MFU measured here)"
    if not e["n"]:
        return f"{rule}: its error not measured (no held-out {kind} point)"
    if e["n"] == 1:  # one point has no median and no worst: its error
        return f"{rule}: its error {e['median']:.0%} on 1 held-out published {kind} point"
    return (
        f"{rule}: its error {e['median']:.0%} median, worst {e['worst']:.3g}×, on {e['n']} "
        f"held-out published {kind} points"
    )


def model_statement(vendor_name: str) -> str:
    """'predicted by the step-time model of the compiled program; model error …' for a
    machine class (gpu, tpu), read from lab/predict/fits.json."""
    from lab.predict.step import error_statement

    return f"step-time model of the compiled program; {error_statement(vendor_name)}"


def workload_error(workload: str, vendor_name: str = "gpu") -> dict:
    """The step-time model's error on the held-out published points of one workload ("decode",
    "prefill", ...) on one machine class, as last validated (lab/predict/fits.json): {"n",
    "median", "worst", "hardware" (the points' chips), "date" (of the validation)}. A figure the
    model predicts for that workload is as wrong as the model was on such points, not on the
    mix of every held-out point."""
    from lab.predict.step import fits

    rows = [
        r
        for r in saved_rows()
        if r.role == "held-out"
        and r.workload == workload
        and r.hardware.startswith("tpu") == (vendor_name == "tpu")
    ]
    date = (fits().get("validation") or {}).get("date")
    return {**_stats(rows), "hardware": sorted({r.hardware for r in rows}), "date": date}


def workload_statement(workload: str, vendor_name: str = "gpu") -> str:
    """'step-time model of the compiled decode step: its error 18% median, worst 2.03×, on 4
    held-out published decode points (a100 × 1, a100 × 8; validated 2026-11-30)', read from
    the last validation (`workload_error`)."""
    e = workload_error(workload, vendor_name)
    rule = f"step-time model of the compiled {workload} step"
    if not e["n"]:
        return f"{rule}: its error not measured (no held-out published {workload} point)"
    points = "point" if e["n"] == 1 else "points"
    size = f"{e['median']:.0%}"
    if e["n"] > 1:
        size += f" median, worst {e['worst']:.3g}×,"
    where = ", ".join(e["hardware"]) + (f"; validated {e['date']}" if e["date"] else "")
    return f"{rule}: its error {size} on {e['n']} held-out published {workload} {points} ({where})"


def predict_with_fit(point: dict, cache_dir=None) -> dict | None:
    """A figure outside the validation set (a ledger claim) predicted by the fitted model:
    the point's program compiled for its target (cached like the validation's) and timed with
    the vendor's fitted parameters. {"seconds", "breakdown", "collective_s", "figure" (the
    point's unit), "statement", "program"}; None where the compiler refuses it, the step does
    not fit the chip's memory, or the target cannot compile here."""
    try:
        prog = program(point, Path(cache_dir or CACHE_DIR))
    except ConfigError:
        return None
    if "refused" in prog or too_big(point, prog):
        return None
    pr = Predictor(point, prog)
    from lab.predict.step import fits

    v = vendor(point)
    p = pr.prediction(**((fits().get(v) or {}).get("fit") or {}))
    seconds = p.seconds
    return {
        "seconds": seconds,
        "breakdown": p.breakdown(),
        "collective_s": p.collective_s,
        "figure": pr.figure(seconds),
        "statement": model_statement(v),
        "program": {k: prog[k] for k in prog if k != "hlo"},
    }


def log_error(summary: Summary) -> str:
    s = summary.held_out["all"]
    if not s.get("n"):
        return "held-out: no points"
    return f"held-out: {s['n']} points, median |error| {s['median']:.0%}, worst {s['worst']:.2f}×"


# ---------------------------------------------------------------------------- this CPU

# lab.run configurations of the CPU self-check: models, meshes (1, 4x2, 2x2x2), strategies
# and attention impls. The first three calibrate the CPU's free parameters; the rest are held
# out.
CPU_CONFIGS = (
    dict(model="small", mesh="1"),
    dict(model="small", mesh="4x2"),
    dict(model="tiny", mesh="1"),
    dict(model="small", mesh="2x2x2", strategy="fsdp+tp"),
    dict(model="small", mesh="8", strategy="fsdp"),
    dict(model="small", mesh="1", seq_len=256),
    dict(model="small", mesh="1", attention="naive"),
    dict(model="small", mesh="1", remat="full"),
    dict(model="tiny", mesh="4x2"),
    dict(model="small", mesh="1", scan_layers=True),
)
CPU_CALIBRATION = 3


@dataclasses.dataclass(frozen=True)
class CpuRow:
    config: str  # the lab.run keys
    measured_s: float  # median step time
    predicted_s: float
    role: str  # calibration | held-out

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1.0


def measure_step(cfg_keys: dict, *, budget_s: float = 2.0):
    """(compiled step, mesh, median seconds of the real step) for a lab.run configuration."""
    from lab.measure import timing
    from lab.mesh import make_mesh
    from lab.train import make_trainer

    cfg = defaults(make_config(**cfg_keys))
    mesh = make_mesh(cfg.mesh)
    trainer = make_trainer(cfg, mesh)
    compiled = trainer.lower().compile()
    state = [trainer.init(jax.random.key(0))]
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.model.vocab_size, (cfg.batch_size, cfg.seq_len + 1))
    tokens = jax.device_put(tokens.astype(np.int32), trainer.batch_sharding)

    def step():  # the executable compiled above: one compilation, not a second for the jit
        with jax.set_mesh(mesh):
            state[0], metrics = compiled(state[0], tokens)
        return metrics

    result = timing.bench(step, warmup=2, min_runs=5, budget_s=budget_s)
    return compiled, mesh, trainer.cfg, result.median_s


# the CPU's free parameters (one host: no links; its calls are the ops' overhead)
CPU_FIT_PARAMS = ("compute_efficiency", "memory_efficiency", "op_overhead_s")


def cpu_check(
    configs=CPU_CONFIGS, calibration: int = CPU_CALIBRATION, *, budget_s=2.0, progress=None
):
    """The model on this CPU: every configuration measured and predicted (one process, one
    run), the CPU's free parameters fitted on the first `calibration` configurations, the
    error reported on the rest. Returns (rows, fit)."""
    from lab.predict.step import cpu_machine_measured

    tick = progress or (lambda label: None)
    measured = []
    for keys in configs:
        label = " ".join(f"{k}={v}" for k, v in keys.items())
        tick(f"measure {label}")
        compiled, mesh, cfg, seconds = measure_step(keys, budget_s=budget_s)
        text = compiled.as_text()
        pr = hlo.parse(text)
        found = {c.name: c for c in collectives_hlo.parse(text, dict(mesh.shape))}
        # the FLOPs of the attention kernel's custom calls, as lab.run's prediction counts them
        # (XLA counts none for them): the model fitted here is the one lab.run prints
        custom = attention_flops_per_device(cfg, mesh.size)
        measured.append((label, pr, found, mesh.size, cfg.model.dtype, custom, seconds))

    def predicted(entry, fit):
        _, pr, found, n, dtype, custom, _ = entry
        machine = cpu_machine_measured(dtype, n, fit or None)
        return predict(pr, machine, found, custom_flops=custom).seconds

    calib = measured[:calibration]
    fit = machines.fit(
        [(lambda e=e, **f: predicted(e, f), e[-1]) for e in calib],
        params=CPU_FIT_PARAMS,
    )
    rows = [
        CpuRow(e[0], e[-1], predicted(e, fit), "calibration" if i < calibration else "held-out")
        for i, e in enumerate(measured)
    ]
    return rows, fit


# lab.run configurations measured on a lent NVIDIA GPU (H100/H200): sizes that fill the chip
# (the base and 1b presets, bf16), XLA's and the Pallas kernel's attention, remat, a scanned
# stack and one small model whose step is mostly launch overhead. Nothing is fitted on them:
# the GPU's free parameters come from the published calibration points, so each is held out.
GPU_CONFIGS = (
    dict(model="base", mesh="1", batch_size=32, seq_len=1024, attention="xla"),
    dict(model="base", mesh="1", batch_size=32, seq_len=1024, attention="pallas"),
    dict(model="base", mesh="1", batch_size=8, seq_len=1024, attention="xla"),
    dict(model="base", mesh="1", batch_size=16, seq_len=2048, attention="xla", remat="full"),
    dict(model="base", mesh="1", batch_size=32, seq_len=1024, attention="xla", scan_layers=True),
    dict(model="base", mesh="1", batch_size=8, seq_len=4096, attention="pallas"),
    dict(model="1b", mesh="1", batch_size=8, seq_len=2048, attention="xla", remat="full"),
    dict(model="1b", mesh="1", batch_size=4, seq_len=1024, attention="pallas"),
    dict(model="small", mesh="1", batch_size=16, seq_len=512, attention="xla"),
)


# Single ops measured on a lent GPU before the steps: the matrix products and the copy that
# the published points time (their shapes and dtypes: the calibration set's FP8 and FP16
# GEMMs, the skinny 802816×192×768 and the wave-bound 1024×2145×1024, the H200's own FP8
# point) in bf16, fp16, fp8 and f32, small ones where the fixed cost of a call dominates, a
# decode-like product of 8 rows, and a 1 GiB copy. Each compiled for the device at hand and
# predicted from its own program with the published fit: a held-out check of the parts of
# the model (per-dtype efficiency, shape, the cost of a call) that the steps mix together.
GPU_OPS = (
    dict(op="matmul", m=8192, n=8192, k=8192, dtype="bfloat16"),
    dict(op="matmul", m=8192, n=8192, k=8192, dtype="float16"),
    dict(op="matmul", m=8192, n=8192, k=8192, dtype="float8_e4m3fn"),
    dict(op="matmul", m=6144, n=12288, k=12288, dtype="float8_e4m3fn"),
    dict(op="matmul", m=8192, n=8192, k=8192, dtype="float32"),
    dict(op="matmul", m=4096, n=4096, k=4096, dtype="bfloat16"),
    dict(op="matmul", m=2048, n=2048, k=2048, dtype="bfloat16"),
    dict(op="matmul", m=1024, n=1024, k=1024, dtype="bfloat16"),
    dict(op="matmul", m=1024, n=1024, k=1024, dtype="float8_e4m3fn"),
    dict(op="matmul", m=1024, n=2145, k=1024, dtype="bfloat16"),
    dict(op="matmul", m=802816, n=192, k=768, dtype="bfloat16"),
    dict(op="matmul", m=802816, n=192, k=768, dtype="float8_e4m3fn"),
    dict(op="matmul", m=8, n=8192, k=8192, dtype="bfloat16"),
    dict(op="copy", n=1 << 28, dtype="float32"),
)


@dataclasses.dataclass(frozen=True)
class HereRow:
    config: str  # the lab.run keys, or the op
    measured_s: float | None  # median step time (None: the configuration failed)
    predicted_s: float | None
    breakdown: dict
    error_text: str = ""  # why a configuration has no figures
    top_ops: tuple = ()  # the ops the prediction spends most on
    pipelined_s: float | None = None  # an op: seconds per call with calls queued back to back

    @property
    def error(self) -> float | None:
        """predicted / measured − 1: for an op, against its queued time (one program's time on
        the device, what the model predicts; a blocked call adds the host's round trip)."""
        measured = self.pipelined_s or self.measured_s
        if not (measured and self.predicted_s):
            return None
        return self.predicted_s / measured - 1.0


def here_check(
    configs, *, budget_s: float = 2.0, progress=None, on_row=None, deadline=None
) -> list[HereRow]:
    """The model against the accelerator at hand: each configuration's step compiled, timed
    and predicted from the same compiled program, with the machine's spec entry and the fit of
    the published calibration points (lab/predict/fits.json). Nothing is fitted here, so every
    row is held out. A configuration that fails (out of memory, an impl the device lacks) is a
    row with its reason; the others go on. `on_row(row)` sees each row as soon as it is known
    (so a run cut short keeps what it measured); none is started after `deadline`
    (time.monotonic())."""
    from lab.devices import describe
    from lab.predict.step import predict_step

    info = describe()
    tick = progress or (lambda label: None)
    rows = _Rows(on_row)
    for keys in configs:
        if deadline is not None and time.monotonic() > deadline:
            break
        label = " ".join(f"{k}={v}" for k, v in keys.items())
        tick(f"measure {label}")
        try:
            compiled, mesh, cfg, seconds = measure_step(keys, budget_s=budget_s)
            p = predict_step(compiled, cfg, info, mesh)
        except Exception as e:  # noqa: BLE001 - one configuration's failure is its row
            rows.append(HereRow(label, None, None, {}, f"{type(e).__name__}: {str(e)[:160]}"))
            continue
        if p is None:
            rows.append(HereRow(label, seconds, None, {}, f"no spec entry for {info.device_kind}"))
            continue
        top = tuple(p.record()["top_ops"][:5])
        rows.append(HereRow(label, seconds, p.seconds, dict(p.breakdown), top_ops=top))
    return list(rows)


def op_label(op: dict) -> str:
    """'matmul 8192×8192×8192 bfloat16', 'copy 1.07 GB float32'."""
    if op["op"] == "matmul":
        return f"matmul {op['m']}×{op['n']}×{op['k']} {op['dtype']}"
    size = op["n"] * np.dtype(op["dtype"]).itemsize
    return f"copy {size / 1e9:.2f} GB {op['dtype']}"


def _op_inputs(op: dict, key):
    """The op's function and fresh random inputs (never zeros) on the default device."""
    from lab.measure.timing import random_normal

    dtype = jnp.dtype(op["dtype"])
    if op["op"] == "matmul":
        ka, kb = jax.random.split(key)
        a = random_normal(ka, (op["m"], op["k"]), dtype)
        b = random_normal(kb, (op["k"], op["n"]), dtype)
        return (lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32)), (a, b)
    if op["op"] == "copy":
        return (lambda x: x * 1.0001), (random_normal(key, (op["n"],), dtype),)
    raise ConfigError(f"unknown op {op['op']!r}: matmul or copy")


def here_ops(
    ops=GPU_OPS, *, budget_s: float = 0.5, progress=None, on_row=None, deadline=None
) -> list[HereRow]:
    """Single ops on the device at hand, each compiled, timed (the median of blocked calls,
    as a step is timed, and the time per call queued back to back, which the row's error is
    taken against) and predicted from its own compiled program with the published fit.
    Nothing is fitted here: every row is held out. An op that fails (a dtype the device lacks,
    out of memory) is a row with its reason, and one the model cannot predict keeps its
    times; none is started after `deadline` (time.monotonic())."""
    from lab.devices import describe
    from lab.measure import timing
    from lab.predict.model import predict_compiled
    from lab.predict.step import machine_for

    info = describe()
    tick = progress or (lambda label: None)
    rows = _Rows(on_row)
    for i, op in enumerate(ops):
        if deadline is not None and time.monotonic() > deadline:
            break
        label = op_label(op)
        tick(f"measure {label}")
        args = None  # the last op's inputs are gone before this one's are drawn
        try:
            fn, args = _op_inputs(op, jax.random.key(i))
            compiled = jax.jit(fn).lower(*args).compile()
            result = timing.bench(compiled, *args, warmup=3, min_runs=10, budget_s=budget_s)
            # queued: calls back to back, one wait per run (the median of three runs). The
            # host's dispatch of the next call overlaps the device's work on this one, so it
            # is the device's time per call for an op longer than a dispatch from Python
            # (tens of µs), the dispatch's for a shorter one.
            calls = int(min(1000, max(10, budget_s / max(result.median_s, 1e-6))))
            queued = timing.bench(
                compiled, *args, warmup=0, min_runs=3, max_runs=3, budget_s=0.0, inner=calls
            ).median_s
        except Exception as e:  # noqa: BLE001 - one op's failure is its row
            rows.append(HereRow(label, None, None, {}, f"{type(e).__name__}: {str(e)[:160]}"))
            continue
        finally:
            del args
        times = dict(measured_s=result.median_s, pipelined_s=queued)
        try:
            machine = machine_for(info, "", {"data": 1}, op["dtype"])
            if machine is None:
                rows.append(
                    HereRow(
                        label,
                        **times,
                        predicted_s=None,
                        breakdown={},
                        error_text=f"no spec entry for {info.device_kind}",
                    )
                )
                continue
            p = predict_compiled(compiled, machine)
        except Exception as e:  # noqa: BLE001 - the times stand without a prediction
            why = f"not predicted: {type(e).__name__}: {str(e)[:140]}"
            rows.append(HereRow(label, **times, predicted_s=None, breakdown={}, error_text=why))
            continue
        top = tuple(p.as_dict(5)["top_ops"])
        rows.append(
            HereRow(label, **times, predicted_s=p.seconds, breakdown=p.breakdown(), top_ops=top)
        )
    return list(rows)


class _Rows(list):
    """A list that shows each appended row to a callback."""

    def __init__(self, on_row):
        super().__init__()
        self._on_row = on_row

    def append(self, row) -> None:
        super().append(row)
        if self._on_row:
            self._on_row(row)


def here_error_line(rows: list[HereRow], device_kind: str, what: str = "configurations") -> str:
    errs = [r.error for r in rows if r.error is not None]
    if not errs:
        return f"held-out: no {what} measured"
    worst = max(max(1 + e, 1 / (1 + e)) for e in errs)
    return (
        f"held-out on {device_kind}: {len(errs)} {what}, median |predicted/measured - 1| "
        f"{float(np.median(np.abs(errs))):.0%}, worst {worst:.2f}× (nothing fitted on them)"
    )


def save_cpu_fit(rows: list[CpuRow], fit: dict) -> Path:
    held = [r for r in rows if r.role == "held-out"]
    errs = [abs(r.error) for r in held]
    worst = max((max(1 + r.error, 1 / (1 + r.error)) for r in held), default=1.0)
    data = json.loads(FITS.read_text()) if FITS.exists() else {}
    data["cpu"] = {
        "fit": fit,
        "calibration": [r.config for r in rows if r.role == "calibration"],
        "held_out": {
            "n": len(held),
            "median": float(np.median(errs)) if errs else 0.0,
            "worst": float(worst),
            "what": "lab.run configurations on this CPU",
        },
        # the CPU the fit was measured on: another one (a VM moved to a new host) is named
        # beside the error wherever it is printed
        "host": records.cpu_model(),
        "date": time.strftime("%Y-%m-%d"),
        "source": "python -m lab.tools.prediction cpu=true",
    }
    FITS.write_text(json.dumps(data, indent=1) + "\n")
    return FITS


def cpu_records(rows: list[CpuRow], fit: dict) -> list[dict]:
    """One record per configuration: its step time measured here, with the prediction from
    the CPU fit of this run and whether it calibrated that fit or was held out."""
    return [
        records.make_record(
            "cpu self-check step time",
            r.measured_s,
            "s",
            label="measured",
            keys=r.config,
            predicted_s=r.predicted_s,
            role=r.role,
            fit=fit,
        )
        for r in rows
    ]


def cpu_error_line(rows: list[CpuRow]) -> str:
    held = [r for r in rows if r.role == "held-out"]
    if not held:
        return "held-out: no configurations"
    errs = [abs(r.error) for r in held]
    worst = max(max(1 + r.error, 1 / (1 + r.error)) for r in held)
    return (
        f"held-out: {len(held)} configurations, median |predicted/measured - 1| "
        f"{float(np.median(errs)):.0%}, worst {worst:.2f}×"
    )


def to_records(summary: Summary) -> list[dict]:
    """One record per predicted point (label predicted, the published figure beside it), and
    the held-out error as a derived record."""
    from lab.measure import records

    out = []
    for r in summary.rows:
        if r.predicted is None:
            continue
        out.append(
            records.make_record(
                "predicted published point",
                r.predicted,
                r.unit,
                label="predicted",
                point=r.id,
                publisher=r.publisher,
                hardware=r.hardware,
                workload=r.workload,
                published=r.published,
                role=r.role,
            )
        )
    s = summary.held_out["all"]
    if s.get("n"):
        out.append(
            records.make_record(
                "prediction held-out median |error|",
                s["median"],
                "fraction",
                label="derived",
                points=s["n"],
                worst_ratio=s["worst"],
            )
        )
    return out
