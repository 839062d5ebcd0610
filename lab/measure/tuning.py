"""What the tuners measured, as frozen types: a remat × batch candidate of lab.run's step
(lab.studies.step.tune), and the attention tile search's stages and static pass
(lab.studies.tune).

They sit here, below lab.report, so the renderers (lab/report/tables/tuning.py) take the
types instead of dicts whose keys they must know. Derived figures are properties computed
from the measured ones, so each has one definition; the records the studies write from them
keep the fields and values they have always had (the runbook and the tests read them by key).
"""

import dataclasses

from lab.measure import records as rec


def within_noise(spans, best: int) -> list[int]:
    """The indices of every span (low, high) other than `best`'s that shares a point with it:
    within the run's noise of the best, so a rerun may rank them either way. A None span (not
    timed) overlaps nothing. Both tuners name their ties with this (the attention tile
    search's stages here, lab.studies.step.as_good for tune_step)."""
    if best >= len(spans) or spans[best] is None:
        return []
    lo, hi = spans[best]
    return [
        i
        for i, s in enumerate(spans)
        if i != best and s is not None and max(lo, s[0]) <= min(hi, s[1])
    ]


@dataclasses.dataclass(frozen=True)
class StepCandidate:
    """One (remat, batch) of lab.run's step: its compiled memory and, where it fits and ran,
    its time; `skipped` says why it did not run (it does not fit, the mesh refuses the batch,
    the allocator ran out)."""

    remat: str  # remat policy (lab.names.REMATS)
    batch: int  # global batch size, sequences per step
    compile_s: float | None = None  # seconds to compile; None when refused before compiling
    memory_bytes: float | None = None  # compiled memory per device; None where not compiled
    skipped: str | None = None  # why it was not timed; None when it ran
    step_s: float | None = None  # median seconds per step (lab.measure.timing.bench)
    runs: int | None = None  # timed steps
    p10_s: float | None = None  # the timed steps' spread
    p90_s: float | None = None
    seq_len: int | None = None  # tokens per sequence
    model_flops_per_token: float | None = None  # lab.run's convention (6·N + attention)
    peak_flops: float | None = None  # FLOP/s of the mesh's devices; None: no figure
    peak_source: str | None = None  # where peak_flops comes from (spec table, measured)
    convention: str | None = None  # how model FLOPs are counted, as lab.run says it
    device: str | None = None  # "<device kind> × <devices>"

    @property
    def ran(self) -> bool:
        return self.skipped is None

    @property
    def tokens_per_s(self) -> float | None:
        """Global training tokens per second; None when it did not run."""
        return self.batch * self.seq_len / self.step_s if self.ran else None

    @property
    def mfu(self) -> float | None:
        """Model FLOPs per second over the devices' peak; None without a peak or a run."""
        if not self.ran or not self.peak_flops:
            return None
        return self.model_flops_per_token * self.tokens_per_s / self.peak_flops


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of the attention tile search: every candidate's score, and the one chosen."""

    stage: str  # fwd, bwd or variant (lab.studies.tune.spaces)
    mode: str  # what was timed: fwd, or fwd+bwd
    candidates: tuple  # the kernel's BlockSizes, in the order tried
    # per candidate, the geometric mean over the shapes of its time / the baseline's; inf for
    # one refused by the compiler, the static pass or the reference check
    scores: tuple[float, ...]
    best: int  # index of the chosen candidate: the lowest score
    # per candidate, the same geometric mean of its p10 and of its p90 times / the baseline's
    # median: the score's spread over the run's samples; None where it was not timed
    spans: tuple[tuple[float, float] | None, ...] = ()

    @property
    def chosen(self):
        return self.candidates[self.best]

    @property
    def within_noise_of(self) -> list[int]:
        """Every other scored candidate whose p10–p90 span overlaps the chosen one's: the
        medians' order alone named the best, and a rerun may name any of them; by score,
        lowest first; empty where every other is apart from it (or was not timed)."""
        tied = within_noise(self.spans, self.best) if len(self.spans) == len(self.scores) else []
        return sorted(tied, key=lambda i: self.scores[i])

    def record(self, **config) -> dict:
        """The stage's choice as a record (derived from the timed ratios): its score, the
        candidate, and `within_noise_of`: the fields of every candidate within the run's
        noise of it, lowest score first; empty where none is."""
        return rec.make_record(
            "tune stage best score",
            self.best_score,
            "x",
            label="derived",
            stage=self.stage,
            mode=self.mode,
            candidate=dataclasses.asdict(self.chosen),
            span=list(self.spans[self.best]) if self.spans and self.spans[self.best] else None,
            within_noise_of=[dataclasses.asdict(self.candidates[i]) for i in self.within_noise_of],
            **config,
        )

    @property
    def best_score(self) -> float:
        return self.scores[self.best]


@dataclasses.dataclass(frozen=True)
class TileSearch:
    """A tile search for one head_dim: its stages in order, each starting from the last's
    winner, all scored against one library baseline."""

    baseline: str  # the implementation every time is divided by (cudnn or xla)
    stages: tuple[Stage, ...]

    @property
    def best(self):
        """The winner: the last stage's chosen candidate."""
        return self.stages[-1].chosen

    @property
    def best_score(self) -> float:
        return self.stages[-1].best_score

    @property
    def candidates(self) -> int:
        """Candidates tried over all stages."""
        return sum(len(s.candidates) for s in self.stages)


@dataclasses.dataclass(frozen=True)
class KernelUse:
    """One compiled kernel of a candidate, as the compiler reports it (compiled, not run)."""

    causal: bool  # the case it was compiled for
    kernel: str  # the kernel's name in the compiled program
    registers: int  # per thread
    spill_bytes: int  # registers spilled to local memory
    smem: int  # bytes of shared memory per block
    blocks_per_sm: int  # resident blocks per SM the resources allow


@dataclasses.dataclass(frozen=True)
class StaticCandidate:
    """A candidate through the static pass: its kernels' resources and, if dropped, why."""

    candidate: object  # the kernel's BlockSizes
    kernels: tuple[KernelUse, ...]  # every kernel compiled, per causal case, in order
    dropped: str | None = None  # why it is not timed (spills, shared memory, refused)

    @property
    def kept(self) -> bool:
        return self.dropped is None

    @property
    def max_registers(self) -> int | None:
        return max((k.registers for k in self.kernels), default=None)

    @property
    def spill_bytes(self) -> int:
        return sum(k.spill_bytes for k in self.kernels)

    @property
    def max_smem(self) -> int | None:
        return max((k.smem for k in self.kernels), default=None)


@dataclasses.dataclass(frozen=True)
class StaticPass:
    """Every candidate of a stage compiled for a GPU before anything is timed (compiled, not
    run): which spill registers or overflow shared memory, and so are dropped."""

    target: str  # "here" (the GPU present) or a plan target such as gpu:h100:1; "" off
    mode: str  # what was compiled: fwd, or fwd+bwd
    candidates: tuple[StaticCandidate, ...]  # in the stage's order

    @property
    def dropped(self) -> dict[int, str]:
        """{index: reason} of the candidates dropped."""
        return {i: c.dropped for i, c in enumerate(self.candidates) if not c.kept}

    def records(self, **config) -> list[dict]:
        """One record per kernel of every candidate: its registers, with its spills, shared
        memory and blocks per SM in the config (the fields the tuner's records have always
        had); then one per candidate dropped, with why ("tune rejected"): a candidate the
        compiler refused has no kernel to record, and its refusal is the result. `config`
        joins each (the stage)."""
        kernels = [
            rec.make_record(
                "tune kernel registers",
                k.registers,
                "registers",
                label="compiled, not run",
                candidate=dataclasses.asdict(c.candidate),
                causal=k.causal,
                mode=self.mode,
                kernel=k.kernel,
                spill_bytes=k.spill_bytes,
                smem=k.smem,
                blocks_per_sm=k.blocks_per_sm,
                target=self.target,
                **config,
            )
            for c in self.candidates
            for k in c.kernels
        ]
        dropped = [
            rec.make_record(
                "tune rejected",
                c.dropped,
                "reason",
                label="compiled, not run",
                candidate=dataclasses.asdict(c.candidate),
                mode=self.mode,
                target=self.target,
                **config,
            )
            for c in self.candidates
            if not c.kept
        ]
        return kernels + dropped
