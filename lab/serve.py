"""`python -m lab.serve key=value ...`: serve the transformer and measure what a token costs.

Loads a trained run's newest checkpoint (`run=NAME`, from out_dir) or random weights of a
preset (`model=base`, the default: its weights are several times a CPU's last-level cache),
then measures on this machine: prefill latency and tokens/s; decode ms/step and tokens/s over
a batch sweep; the bytes a decode step must move (weights + KV cache), the bandwidth that
achieves and its share of the best copy bandwidth measured (before the sweep and again after
it: a shared host's bandwidth moves); the step's FLOPs per byte and the batch
where it crosses the ridge; int8 weights and an int8 cache (error on the bundled text, bytes,
speed). A trained byte-level model (data=text) also prints a generated sample. With
`target=tpu:...` or `target=gpu:...` the decode step is compiled for that slice instead
(weights + cache per device against HBM, float and int8): compiled, not run.

Takes lab.run's model and mesh keys (model, mesh, dtype, attention, ...); its training-only
keys (steps, lr, batch_size, seq_len, ...) are refused. See lab/studies/serving/.
"""

import dataclasses
import sys
from pathlib import Path

from rich.markup import escape

from lab import data, decode, rundir, startup
from lab.config import check_name, cli, did_you_mean, field, given_options, model_changes
from lab.errors import ConfigError
from lab.measure import memory
from lab.measure import records as rec
from lab.report import plots, progress, tables
from lab.session import open_session
from lab.studies.serving import compiled, sample, study, weights
from lab.studies.serving import records as serving_records

SAMPLE_MAX = 4096  # the sample is generated in one compiled call: seconds, never an hour
# the sample's prompt is prefilled in one compiled call too, which no signal interrupts and
# whose attention grows with the square of its length: bytes (a byte-level model's tokens)
PROMPT_MAX = 4096


@dataclasses.dataclass(frozen=True)
class Options:
    run: str = field(
        "",
        "a trained run's name under out_dir (its newest checkpoint; out_dir= is read only "
        "with run=); empty = random weights",
    )
    batches: tuple = field((1, 2, 4, 8, 16, 32, 64), "decode batch sizes", kind="ints", min=1)
    prefill_batches: tuple = field((1, 4), "prefill batch sizes", kind="ints", min=1)
    prompt_len: int = field(128, "prompt tokens per sequence", min=1, max=2**20)
    decode_steps: int = field(
        32,
        "decode steps per timed call, repeated until budget= is spent (the cache holds them)",
        min=1,
    )
    context: int = field(
        0, "cache slots per sequence; 0 = prompt_len + decode_steps + 3 warm-up steps", min=0
    )
    budget: float = field(
        1.0,
        "seconds of timed calls per point and per matmul variant it compares (on CPU XLA's, "
        "the native kernel's and more), compiles and warm-up apart: it bounds the timing, not "
        "the command's wall time",
        min=0.01,
    )
    int8: bool = field(True, "also measure int8 weights + int8 KV cache (error, bytes, speed)")
    sample: int = field(
        200,
        "tokens of generated text for a trained byte-level model; 0 = none (at most "
        f"{SAMPLE_MAX}: one compiled call, which no signal interrupts)",
        min=0,
        max=SAMPLE_MAX,
    )
    prompt: str = field(
        "",
        f"the sample's prompt (at most {PROMPT_MAX} bytes: prefilled in one compiled call, "
        "which no signal interrupts); empty = the start of the bundled text",
    )
    temperature: float = field(0.8, "sampling temperature of the sample (0 = greedy)", min=0.0)
    plan_batch: int = field(
        8,
        "target= plans: sequences decoded together (at most 2^20: past it the compilers' "
        "launch grids overflow)",
        min=1,
        max=2**20,
    )
    plan_context: int = field(
        4096,
        "target= plans: cache slots per sequence (at most 2^24: a batch × cache the compilers "
        "index)",
        min=1,
        max=2**24,
    )
    results: str = field("results", "folder for the records and the PNG", kind="path")
    plot: bool = field(True, "write the decode PNG (of this machine's sweep; a plan has none)")
    seed: int = field(0, "random weights and sampling (at most 2^32-1)", min=0, max=2**32 - 1)


# lab.run's keys that only training reads: given to lab.serve they would do nothing
TRAINING_ONLY = (
    "steps",
    "lr",
    "warmup_steps",
    "min_lr_ratio",
    "weight_decay",
    "grad_clip",
    "loss_scale",
    "accumulate",
    "offload_optimizer",
    "log_every",
    "checkpoint_every",
    "resume",
    "overwrite",
    "compile_only",
    "explain",
    "profile",
    "name",
    "pack",
    "batch_size",
    "seq_len",
)
# what lab.serve takes instead, where it has its own key
SERVING_INSTEAD = {
    "steps": "the tokens decoded per timed call are decode_steps=",
    "name": "a trained run is served with run=NAME",
    "batch_size": "the batches served are batches= and prefill_batches=",
    "seq_len": "the lengths served are prompt_len= and context=",
}


def _check_serving_keys(keys: dict) -> None:
    given = [k for k in TRAINING_ONLY if k in keys]
    if not given:
        return
    instead = [SERVING_INSTEAD[k] for k in given if k in SERVING_INSTEAD]
    hint = f" ({'; '.join(instead)})" if instead else ""
    them = "it" if len(given) == 1 else "them"
    raise ConfigError(
        f"{', '.join(f'{k}={keys[k]}' for k in given)}: lab.serve trains nothing, so "
        f"{'this training key' if len(given) == 1 else 'these training keys'} would do "
        f"nothing: leave {them} out{hint}"
    )


# lab.serve's own keys that only one of its two modes reads: this machine's sweep, or a plan
SWEEP_ONLY = (
    "batches",
    "prefill_batches",
    "prompt_len",
    "decode_steps",
    "context",
    "budget",
    "sample",
    "prompt",
    "temperature",
    "plot",
    "seed",  # a plan compiles the step for abstract weights: none are drawn
)
PLAN_ONLY = ("plan_batch", "plan_context")


def _shown(value) -> str:
    """A value as the command line types it: 4,8 for a list, false for False."""
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value).lower() if isinstance(value, bool) else str(value)


def _check_mode_keys(o: Options, keys: dict) -> None:
    """Options the mode asked does not read (typed, even at their defaults) are one line
    before anything loads: a plan (target=) compiles one decode step of plan_batch= ×
    plan_context= and measures nothing; this machine's sweep reads no plan_ keys."""
    plan = bool(keys.get("target"))
    typed = given_options(o)  # None for options made in code: then those not at their defaults
    unread = [
        k
        for k in (SWEEP_ONLY if plan else PLAN_ONLY)
        if (k in typed if typed is not None else getattr(o, k) != _default(k))
    ]
    if not unread:
        return
    given = ", ".join(f"{k}={_shown(getattr(o, k))}" for k in unread)
    one = len(unread) == 1
    these, them = ("this key", "it") if one else ("these keys", "them")
    if plan:
        raise ConfigError(
            f"{given}: target= compiles one decode step for the target and measures nothing "
            f"here, so {these} would do nothing: leave {them} out (a plan's batch and cache "
            "are plan_batch= and plan_context=)"
        )
    raise ConfigError(
        f"{given}: only a plan for an accelerator (target=) reads {these}, so here "
        f"{'it' if one else 'they'} would do nothing: give target= or leave {them} out (this "
        "machine's sweep is batches=, prompt_len= and context=)"
    )


def _default(key: str):
    return Options.__dataclass_fields__[key].default


def _session(o: Options, keys: dict):
    if o.run:
        try:
            check_name(o.run)
        except ConfigError as e:  # name='…': why → run='…': why (the key as typed here)
            why = str(e).split(": ", 1)[1].replace("choose the location", "say where runs are")
            why = why.replace(
                "a run name is one folder name", "a run is one folder name under out_dir"
            )
            raise ConfigError(f"run={o.run!r}: {why}") from None
        run_dir = Path(keys.get("out_dir", "runs")) / o.run
        if run_dir.exists() and not run_dir.is_dir():
            raise ConfigError(f"run={o.run}: {run_dir} is a file, not a run folder")
        if not run_dir.is_dir():
            try:
                there = [d.name for d in run_dir.parent.iterdir() if d.is_dir()]
            except OSError:
                there = []
            hint = did_you_mean(o.run, there)
            raise ConfigError(
                f"run={o.run}: no run folder {run_dir}{hint} (out_dir= says where runs are)"
            )
        request = weights.serving_request(run_dir, keys)
        # the trainer a run's weights are restored into (its layout, on the serving mesh, or
        # a target's for a plan): built to restore, no training batch of its own to split;
        # the batches served split (for_decoding: batches=, prefill_batches= or plan_batch=)
        try:
            return open_session(request=request, purpose="restore"), run_dir
        except ConfigError as e:  # a rule broken by the run's own config.json names the run
            raise weights.blame_run(e, run_dir, request, keys) from None
    keys = {"preset": "base", **keys, "steps": 0}
    # random weights: nothing restores into a training layout, so the request is resolved
    # once, for decoding the batches asked (a plan's: plan_batch=), no training batch split
    batches = (o.plan_batch,) if keys.get("target") else (*o.batches, *o.prefill_batches)
    return open_session(keys=keys, purpose="decode", batches=batches), None


def _plan(o: Options, s, con) -> int:
    rows = []
    for int8 in (False, True) if o.int8 else (False,):
        con.print(f"compiling the decode step for {s.cfg.target} ({'int8' if int8 else 'float'}) …")
        rows.append(compiled.plan_serving(s, batch=o.plan_batch, context=o.plan_context, int8=int8))
    r = rows[0]
    title = (
        f"serving plan · {s.cfg.target} ({r.device_kind} × {r.devices}) · "
        f"model={s.cfg.preset} params {s.cfg.model.param_dtype} · compiled, not run"
    )
    con.print(tables.serving_plans(rows, title))
    if not r.device_kind.startswith("TPU"):
        share = memory.gpu_allocator_fraction()
        con.print(
            f"usable: {share:.0%} of the memory the GPU reports, what JAX's allocator takes "
            "(XLA_CLIENT_MEM_FRACTION or XLA_PYTHON_CLIENT_MEM_FRACTION)"
        )
    elif r.capacity_bytes:
        con.print(
            "usable: what XLA:TPU lets a program hold of each chip's HBM, as its compiler "
            "reports it (a little under the datasheet's: the runtime keeps the rest)"
        )
    config = {"preset": s.cfg.preset, "mesh": s.cfg.mesh, "target": s.cfg.target}
    if m := model_changes(s.cfg):  # the model fields that differ from the preset's
        config["model"] = m
    recs = serving_records.plan_records(rows, config)
    stem = rec.output_stem(o.results, "serve-plan", backend=s.cfg.target.split(":")[0])
    with startup.held():  # whole lines: a signal waits for the records
        con.print(f"records → {rec.write_records(stem.with_suffix('.jsonl'), recs)}", markup=False)
    return 0


def _check_prompt(prompt: str) -> None:
    """A prompt longer than PROMPT_MAX bytes is one line, before anything loads."""
    n = len(prompt.encode("utf-8", "surrogateescape"))
    if n > PROMPT_MAX:
        raise ConfigError(
            f"prompt= is {n:,} bytes: at most {PROMPT_MAX} (the sample's prompt is prefilled "
            "in one compiled call, which no signal interrupts)"
        )


def _peer_note_line(note: str, *, timed: bool) -> str:
    """The line (rich markup) saying why the PyTorch decoder was skipped (`timed` false) or
    where it stopped (study.torch_peer's note); the note is text, never markup."""
    hint = " (pip install -e '.[peers]' adds it)" if "not installed" in note else ""
    return f"  peer    {'' if timed else 'none: '}{escape(note + hint)}"


def _drop_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()  # only an empty folder: anything written there stays
    except OSError:
        pass


def _unused_sample_keys(o: Options, trained_text: bool) -> str | None:
    """Why the sample's keys given (typed, or set in code away from their defaults) make
    nothing, where no sample is generated (a sample needs a trained byte-level text run), or
    None. sample=0 asks for none, so it is not named."""
    typed = given_options(o)  # None for options made in code
    sample_given = "sample" in typed if typed is not None else o.sample != Options.sample
    unused = [
        k
        for k, given in (
            ("sample", o.sample and sample_given),
            ("prompt", o.prompt),
            ("temperature", o.temperature != Options.temperature),
        )
        if given
    ]
    if not unused or (o.sample and trained_text):
        return None
    why = "sample=0" if not o.sample else "the weights are not a byte-level text run's"
    return f"no sample is generated ({why}): {' and '.join(f'{k}=' for k in unused)} unused"


def run(o: Options, keys: dict) -> int:
    _check_prompt(o.prompt)  # before anything loads: a long prefill is one call
    _check_serving_keys(keys)
    _check_mode_keys(o, keys)
    if not keys.get("target"):  # the sweep's batches and cache: before anything loads
        study.check_plan(_sweep_plan(o))
    if "out_dir" in keys and not o.run:
        raise ConfigError(
            f"out_dir={keys['out_dir']}: lab.serve reads out_dir= only to find run=NAME's "
            "folder, and no run= was given, so it would do nothing: records go to results= "
            f"({o.results}); leave out_dir= out or add run="
        )
    # The libraries' own logging (absl, orbax, TensorStore, asyncio: a damaged checkpoint makes
    # them print thousands of lines) goes to lab.log in the results folder, as lab.run sends
    # it to the run folder's; the lab says what went wrong in one line.
    made = not Path(o.results).exists()
    results = rec.writable_dir(o.results)

    def tidy() -> None:  # a command refused or stopped before it wrote anything leaves no
        if made:  # empty folder behind (a signal's exit runs no finally: on_stop does)
            rec.drop_empty_reservations(results)
            _drop_if_empty(results)

    startup.on_stop(tidy)
    try:
        return _run(o, keys, results)
    finally:
        tidy()


def _sweep_plan(o: Options) -> study.Plan:
    """What this machine's sweep measures, as the options ask it."""
    return study.Plan(
        o.batches,
        o.prefill_batches,
        o.prompt_len,
        o.decode_steps,
        o.budget,
        o.int8,
        o.seed,
        context=o.context,
    )


def _run(o: Options, keys: dict, results: Path) -> int:
    rundir.quiet_libraries(results, delay=True)
    s, run_dir = _session(o, keys)
    con = progress.console()
    used = s.trainer.mesh.size  # a mesh may use fewer of the devices than there are
    of = f" ({used} of {s.info.count} devices)" if used < s.info.count else ""
    con.print(
        f"[bold]lab.serve[/bold] {s.info.header()} · model={s.cfg.preset} mesh={s.cfg.mesh}{of} "
        f"compute {s.cfg.model.dtype}, attention {s.cfg.model.attention}"
    )
    if s.trainer.attention_note:  # why the dispatch passed over the kernel it prefers there
        con.print(f"  attention [yellow]{s.trainer.attention_note}")
    if not s.cfg.target:
        con.print(f"  decode    attention {decode.decode_kernel_line(s.cfg.model, s.info.backend)}")
    if not s.cfg.target and (busy := rec.busy_note()):
        con.print(f"[yellow]{busy}")
    if s.cfg.target:
        rec.writable_dir(o.results)  # refused before the compile, not after
        # resolved for decoding plan_batch= (it splits over the target's mesh) before compiling
        return _plan(o, weights.for_decoding(s, (o.plan_batch,)), con)
    # resolved for decoding these batches (every rule: one line each) before any weights
    decoding = weights.for_decoding(s, (*o.batches, *o.prefill_batches))
    stem = rec.output_stem(o.results, "serve")  # a folder that cannot be written: refused now
    plan = _sweep_plan(o)
    study.check_memory(s, plan)  # before weights, cache or prompts are made
    # a damaged step's line is a warning: stderr, as lab.run's resume says it
    warn = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    s, params, source = weights.load_params(s, run_dir, o.seed, warn, decoding=decoding)
    con.print(f"  weights   {escape(source)}")
    changed = weights.changed_from_run(run_dir, keys) if run_dir is not None else []
    if changed:  # the run's weights, computed as another model: said, and recorded below
        con.print(
            f"  note      [yellow]served with other model keys than the run trained with: "
            f"{escape(', '.join(changed))}: its outputs are not the trained model's"
        )
    trained_text = run_dir is not None and s.cfg.data == "text" and s.cfg.model.vocab_size == 256
    unused = _unused_sample_keys(o, trained_text)
    if unused:
        con.print(f"  note      {unused}")
    if o.sample and trained_text:
        prompt = o.prompt or bytes(data.corpus_bytes()[:64]).decode("utf-8", "replace")
        text = sample.sample_text(
            s, params, prompt=prompt, tokens=o.sample, temperature=o.temperature, seed=o.seed
        )
        # the prompt as the sample's text is shown: control characters escaped (an ESC
        # would drive the terminal), never read as markup ([/b], [red])
        shown = sample.printable(
            prompt.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        )
        con.print(  # apart: without colour, nothing else tells the prompt from the text
            f"[bold]sample[/bold] (temperature {o.temperature}):\n"
            f"[dim]prompt:[/dim]    {escape(shown)}\n"
            f"[dim]generated:[/dim] {escape(text)}\n"
        )
    config = {
        "preset": s.cfg.preset,
        # the model fields that differ from the preset's: a d_model=32 model is not tiny's
        **({"model": m} if (m := model_changes(s.cfg)) else {}),
        **({"changed_from_run": changed} if changed else {}),
        "mesh": s.cfg.mesh,
        "dtype": s.cfg.model.dtype,
        "weights": source,
        "prompt_len": o.prompt_len,
    }
    finished = {}

    def keep() -> None:  # a stop keeps the points measured so far
        recs = serving_records.finished_records(finished, config)
        if len(recs) > 1:  # more than the roof: at least one point
            path = rec.write_records(stem.with_suffix(".jsonl"), recs)
            n = len(recs) - 1
            points = (
                "the 1 point measured so far is"
                if n == 1
                else f"the {n} points measured so far are"
            )
            startup.note(f"{points} in {path}")

    startup.on_stop(keep)
    n = study.ticks(s, plan)
    with progress.tasks(con) as bar:
        task = bar.add_task("serving", total=n)

        def tick(label):
            # A label the bar cuts (a long prefill's FLOPs and minutes) is printed whole; where
            # the output is a file or a pipe, the bar itself prints each label as a line.
            if len(label) > 28 and con.is_terminal:
                con.print(f"  {label}", soft_wrap=True)
            shown = label[:28] if con.is_terminal else label
            bar.update(task, description=shown, advance=0 if label.startswith("roofs") else 1)

        out = study.measure(s, params, plan, progress=tick, finished=finished)
        bar.update(task, completed=n)
    finished.clear()  # measured whole: the records below are the study's
    what = f"model={s.cfg.preset}, prompt {o.prompt_len}, {s.info.header()}"
    con.print(tables.serving_prefill(out.prefill, f"prefill · {what}"))
    rows = out.decode + out.decode_int8
    con.print(tables.serving_decode(rows, f"decode · {what}", peak_flops=out.roofs.peak_flops))
    for line in tables.serving_matmuls(rows):  # which matmul each point kept, and the others
        con.print(f"  matmul  {line}")
    for line in tables.serving_peers(out.torch, o.decode_steps):  # the peer, where it ran
        con.print(f"  peer    {line}")
    if out.peer_note:
        con.print(_peer_note_line(out.peer_note, timed=bool(out.torch)))
    if out.int8:
        con.print(tables.serving_int8(out.int8, out.summary.int8_speedup, out.decode_int8))
    con.print(tables.serving_summary(out.summary, out.roofs))
    recs = serving_records.to_records(out, config)
    with startup.held():  # whole lines: a signal waits for the records
        con.print(f"records → {rec.write_records(stem.with_suffix('.jsonl'), recs)}", markup=False)
    if o.plot:
        con.print(f"plot    → {plots.decode(recs, stem.with_suffix('.png'))}", markup=False)
    return 0


def main(argv=None) -> int:
    return cli(Options, run, prog="python -m lab.serve", doc=__doc__, argv=argv, run_keys=True)


if __name__ == "__main__":
    from lab.report.progress import survive_lost_output

    survive_lost_output()
    sys.exit(main())
