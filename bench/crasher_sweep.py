"""Crasher sweep: every sampler x scheduler x steps x size on the real runtime, tiny model.

The runtime (stable-diffusion.cpp master-596) kills the whole process on some parameter
combinations (a SIGSEGV, an abort) instead of returning an error. This sweep finds them: a
child process loads the tiny test model once and runs many combinations in that engine,
reporting each one on its stdout (the runtime's own printing goes to stderr); when the child
dies by a signal or exits non-zero, the parent records the combination in flight as a crasher,
with the signal and the last lines the child printed on stderr, and starts a new child from
the next combination. A combination that runs past `--timeout` seconds is recorded as a hang
(the child is killed). So a crash costs one child, never the sweep. Children run with the
stack limit Linux gives a process by default (8 MiB, so a stack overflow happens where it would
in a worker) and an address-space limit (`--memory-limit-gb`), so a combination that would
take the machine's memory fails in its child instead.

Besides the grid of the short prompt, each extra prompt of `--prompts` (PROMPTS: a long one
the old 20,000-character limit let through) runs once, with the runtime's default sampler
and scheduler, 1 step, at the first size.

With validation (the default) each combination goes through `Engine.generate`, which runs
`sdfarm.native.params.validate` first: a refused combination costs no native call. With
`--no-validate` the child replaces the engine's `validate` by a pass-through, so every
combination reaches the runtime: that is how the crashers are found.

    python bench/crasher_sweep.py [--no-validate] [--samplers all|a,b] [--schedulers all|a,b]
        [--steps 1,2,3,4] [--sizes 64x64,128x64] [--prompts short,cjk-9000] [--jobs 1]
        [--model DIR] [--memory-limit-gb 8]
        [--out bench/results/crasher_sweep-DATE.json]

`tests/e2e/test_crasher_sweep.py` runs a grid of it with validation and asserts nothing
crashes; docs/crashers.md holds the table of what `--no-validate` found.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import queue
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

from sdfarm.native.params import SAMPLERS, SCHEDULERS

ALL_SAMPLERS = ("default", *SAMPLERS)
ALL_SCHEDULERS = ("default", *SCHEDULERS)
DEFAULT_STEPS = (1, 2, 3, 4)
DEFAULT_SIZES = ((64, 64), (128, 64))
PROMPT = "a lighthouse at dusk"
# Prompts by name. cjk-9000: 9,000 CJK ideographs, 27,000 bytes in UTF-8; the old limit
# (20,000 characters) let it through, and the runtime's prompt-weight parser overflows the
# stack on it (docs/crashers.md).
PROMPTS = {
    "short": PROMPT,
    "cjk-9000": "".join(chr(0x4E00 + (i * 7919) % 20902) for i in range(9000)),
}
STACK_BYTES = 8 * 1024 * 1024  # Linux's default stack limit
MEMORY_LIMIT_GB = 8.0
SEED = 1
TIMEOUT_S = 120.0
STDERR_TAIL = 6  # lines of a dead child's stderr kept with its crasher
STATUSES = ("generated", "refused", "crashed", "hang", "error")


@dataclass(frozen=True)
class Combo:
    """One point of the grid."""

    sampler: str
    scheduler: str
    steps: int
    width: int
    height: int
    prompt: str = "short"  # a name in PROMPTS

    @property
    def label(self) -> str:
        text = f"{self.sampler}/{self.scheduler}/{self.steps} steps/{self.width}x{self.height}"
        return text if self.prompt == "short" else f"{text}/prompt {self.prompt}"


@dataclass
class Outcome:
    """What one combination did: generated, refused (by validation), crashed (the child died:
    `signal` names it, or `exit_code` when it exited non-zero), hang (killed after the
    timeout) or error (the runtime returned an error, the process lived)."""

    combo: Combo
    status: str
    seconds: float = 0.0
    message: str = ""
    signal: str | None = None
    exit_code: int | None = None
    stderr_tail: list[str] = field(default_factory=list)
    blank: bool = False  # generated, but every pixel has the same value (NaN latents)

    def as_dict(self) -> dict:
        d = {**asdict(self.combo), "status": self.status, "seconds": round(self.seconds, 3)}
        for key in ("message", "signal", "exit_code", "stderr_tail", "blank"):
            value = getattr(self, key)
            if value not in ("", None, [], False):
                d[key] = value
        return d


def grid(
    samplers: Iterable[str] = ALL_SAMPLERS,
    schedulers: Iterable[str] = ALL_SCHEDULERS,
    steps: Iterable[int] = DEFAULT_STEPS,
    sizes: Iterable[tuple[int, int]] = DEFAULT_SIZES,
    prompts: Iterable[str] = ("short",),
) -> list[Combo]:
    """The product for the short prompt, sizes outermost so one child's consecutive runs share
    a size; then each other prompt once, at a point that generates with the short one (the
    runtime's default sampler and scheduler, 1 step, the first size), so a crash there is the
    prompt's."""
    samplers, schedulers, steps, sizes = (tuple(x) for x in (samplers, schedulers, steps, sizes))
    combos = [
        Combo(sa, sc, st, w, h)
        for (w, h), st, sa, sc in itertools.product(sizes, steps, samplers, schedulers)
    ]
    w, h = sizes[0]
    extra = [Combo("default", "default", 1, w, h, name) for name in prompts if name != "short"]
    return combos + extra


# -- the child -----------------------------------------------------------------------------


def child_main(model: str, validate: bool, threads: int) -> int:
    """Read combinations (JSON lines) from stdin, run each in one engine, write one JSON line
    per combination to the original stdout: {"i": n, "start": true} before the native call
    and {"i": n, "status": ...} after. fd 1 is pointed at stderr first, so nothing the
    runtime prints can be taken for a report."""
    report = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    import sdfarm.native.engine as engine_mod
    from sdfarm.native.errors import EngineError, InvalidParameterError
    from sdfarm.native.params import GenerationParams

    if not validate:
        engine_mod.validate = lambda params: params  # every combination reaches the runtime
    engine = engine_mod.Engine.load(model, threads=threads)

    def send(**kw: object) -> None:
        report.write(json.dumps(kw) + "\n")

    for line in sys.stdin:
        job = json.loads(line)
        i, c = job.pop("i"), Combo(**job)
        send(i=i, start=True)
        started = time.monotonic()
        try:
            result = engine.generate(
                GenerationParams(
                    prompt=PROMPTS[c.prompt],
                    width=c.width,
                    height=c.height,
                    steps=c.steps,
                    seed=SEED,
                    sampler=c.sampler,
                    scheduler=c.scheduler,
                )
            )
        except InvalidParameterError as e:
            send(i=i, status="refused", seconds=time.monotonic() - started, message=str(e))
            continue
        except EngineError as e:
            send(i=i, status="error", seconds=time.monotonic() - started, message=str(e))
            continue
        blank = all(lo == hi for lo, hi in result.image.getextrema())
        send(i=i, status="generated", seconds=time.monotonic() - started, blank=blank)
    engine.dispose()
    return 0


# -- the parent ----------------------------------------------------------------------------


def _signal_name(returncode: int) -> str | None:
    if returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def _tail(path: Path, n: int = STDERR_TAIL) -> list[str]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [ln.strip()[:300] for ln in lines if ln.strip()][-n:]


def _read(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    """Every line of a child's reports, then None at its end."""
    for ln in stream:
        lines.put(ln)
    lines.put(None)


def _feed(stdin: IO[str], jobs: list[tuple[int, Combo]]) -> None:
    """The combinations a child is to run, one JSON line each."""
    try:
        for i, c in jobs:
            stdin.write(json.dumps({"i": i, **asdict(c)}) + "\n")
        stdin.close()
    except OSError:
        pass  # the child died; the parent notices on its stdout


def _limits(memory_limit_gb: float) -> Callable[[], None]:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_STACK, (STACK_BYTES, STACK_BYTES))
        if memory_limit_gb > 0:
            cap = int(memory_limit_gb * 1024**3)
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    return apply


def _run_shard(
    combos: Sequence[tuple[int, Combo]],
    model: str,
    validate: bool,
    threads: int,
    timeout: float,
    memory_limit_gb: float,
    on_outcome: Callable[[int, Outcome], None],
    children: list[int],
) -> None:
    """Run `combos` (index, combo) through as many children as crashes need."""
    pending = list(combos)
    while pending:
        with tempfile.NamedTemporaryFile(prefix="crasher-sweep-", suffix=".err") as err:
            proc = subprocess.Popen(
                [sys.executable, __file__, "--child", model, "--threads", str(threads)]
                + ([] if validate else ["--no-validate"]),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                bufsize=1,
                preexec_fn=_limits(memory_limit_gb),
            )
            children.append(proc.pid)
            lines: queue.Queue[str | None] = queue.Queue()
            threading.Thread(target=_read, args=(proc.stdout, lines), daemon=True).start()
            threading.Thread(target=_feed, args=(proc.stdin, list(pending)), daemon=True).start()

            by_index = dict(pending)
            in_flight: int | None = None
            started = time.monotonic()
            hung = False
            while True:
                limit = timeout if in_flight is not None else timeout + 60.0  # + the load
                try:
                    ln = lines.get(timeout=max(0.1, started + limit - time.monotonic()))
                except queue.Empty:
                    hung = True
                    proc.kill()
                    break
                if ln is None:
                    break
                msg = json.loads(ln)
                if msg.get("start"):
                    in_flight, started = msg["i"], time.monotonic()
                    continue
                out = Outcome(
                    by_index[msg["i"]],
                    msg["status"],
                    msg.get("seconds", 0.0),
                    msg.get("message", ""),
                    blank=msg.get("blank", False),
                )
                on_outcome(msg["i"], out)
                pending = [(i, c) for i, c in pending if i != msg["i"]]
                in_flight, started = None, time.monotonic()
            returncode = proc.wait()
            if not pending:
                break
            err.flush()
            tail = _tail(Path(err.name))
            if in_flight is None:
                # Died (or hung) while loading or between combinations: no combination to
                # blame, and another child would do the same. Record the rest as errors.
                why = "hung" if hung else f"exited with {returncode}"
                for i, c in pending:
                    on_outcome(i, Outcome(c, "error", message=f"child {why} before it ran"))
                return
            c = by_index[in_flight]
            seconds = time.monotonic() - started
            if hung:
                out = Outcome(c, "hang", seconds, f"no answer after {timeout:g} s; killed")
            else:
                out = Outcome(
                    c,
                    "crashed",
                    seconds,
                    signal=_signal_name(returncode),
                    exit_code=returncode if returncode > 0 else None,
                    stderr_tail=tail,
                )
            on_outcome(in_flight, out)
            pending = [(i, ic) for i, ic in pending if i != in_flight]


@dataclass
class SweepResult:
    combos: list[Combo]
    outcomes: list[Outcome]
    validate: bool
    seconds: float
    children: int

    def counts(self) -> dict[str, int]:
        n = Counter(o.status for o in self.outcomes)
        return {"tried": len(self.outcomes), **{s: n.get(s, 0) for s in STATUSES}}

    def crashers(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status in ("crashed", "hang")]

    def table(self) -> str:
        """The summary table: combinations tried, refused, generated, crashed."""
        c = self.counts()
        rows = [
            ("validation", "on" if self.validate else "off"),
            ("combinations tried", c["tried"]),
            ("refused by validation", c["refused"]),
            ("generated", c["generated"]),
            ("  of which blank images", sum(o.blank for o in self.outcomes)),
            ("crashed (signal or exit)", c["crashed"]),
            ("hung (killed)", c["hang"]),
            ("runtime errors (no crash)", c["error"]),
            ("child processes", self.children),
            ("wall seconds", f"{self.seconds:.1f}"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"| {'':{width}} | value |", f"|{'-' * (width + 2)}|-------|"]
        lines += [f"| {k:{width}} | {v} |" for k, v in rows]
        return "\n".join(lines)

    def crasher_table(self) -> str:
        """A markdown table of the crashers, one row per combination."""
        lines = [
            "| sampler | scheduler | steps | size | prompt | what happened |",
            "|---|---|---|---|---|---|",
        ]
        for o in self.crashers():
            what = o.signal or (f"exit {o.exit_code}" if o.exit_code else o.status)
            lines.append(
                f"| {o.combo.sampler} | {o.combo.scheduler} | {o.combo.steps} "
                f"| {o.combo.width}x{o.combo.height} | {o.combo.prompt} | {what} |"
            )
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {
            "date": datetime.date.today().isoformat(),
            "host": {"machine": platform.machine(), "cpus": os.cpu_count()},
            "validate": self.validate,
            "seconds": round(self.seconds, 1),
            "children": self.children,
            "prompt": PROMPT,
            "seed": SEED,
            "grid": {
                "samplers": sorted({c.sampler for c in self.combos}, key=_order(ALL_SAMPLERS)),
                "schedulers": sorted(
                    {c.scheduler for c in self.combos}, key=_order(ALL_SCHEDULERS)
                ),
                "steps": sorted({c.steps for c in self.combos}),
                "sizes": sorted({f"{c.width}x{c.height}" for c in self.combos}),
                "prompts": {
                    name: {"chars": len(PROMPTS[name]), "bytes": len(PROMPTS[name].encode())}
                    for name in sorted({c.prompt for c in self.combos})
                },
            },
            "counts": self.counts(),
            "crashers": [o.as_dict() for o in self.crashers()],
            # Refused combinations by the error's text; blank ones by label.
            "refused": _grouped(o for o in self.outcomes if o.status == "refused"),
            "errors": [o.as_dict() for o in self.outcomes if o.status == "error"],
            "blank": [o.combo.label for o in self.outcomes if o.blank],
            "mean_generate_s": round(
                sum(o.seconds for o in self.outcomes if o.status == "generated")
                / max(1, self.counts()["generated"]),
                3,
            ),
        }


def _grouped(outcomes: Iterable[Outcome]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for o in outcomes:
        groups.setdefault(o.message, []).append(o.combo.label)
    return groups


def _order(names: Sequence[str]) -> Callable[[str], int]:
    return lambda n: names.index(n) if n in names else len(names)


def sweep(
    combos: Sequence[Combo],
    model: str | os.PathLike[str],
    *,
    validate: bool = True,
    jobs: int = 1,
    threads: int = 1,
    timeout: float = TIMEOUT_S,
    memory_limit_gb: float = MEMORY_LIMIT_GB,
    progress: Callable[[int, Outcome], None] | None = None,
) -> SweepResult:
    """Run every combination in child processes (`jobs` of them at a time, each with its
    share of the grid) and return each one's outcome, in grid order."""
    started = time.monotonic()
    outcomes: dict[int, Outcome] = {}
    lock = threading.Lock()
    children: list[int] = []

    def record(i: int, out: Outcome) -> None:
        with lock:
            outcomes[i] = out
            if progress is not None:
                progress(len(outcomes), out)

    indexed = list(enumerate(combos))
    shards = [indexed[k::jobs] for k in range(max(1, jobs))]
    workers = [
        threading.Thread(
            target=_run_shard,
            args=(shard, str(model), validate, threads, timeout, memory_limit_gb, record, children),
        )
        for shard in shards
        if shard
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return SweepResult(
        list(combos),
        [outcomes[i] for i in range(len(combos))],
        validate,
        time.monotonic() - started,
        len(children),
    )


# -- command line --------------------------------------------------------------------------


def _names(text: str, known: Sequence[str], what: str) -> tuple[str, ...]:
    if text == "all":
        return tuple(known)
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in known]
    if bad:
        raise SystemExit(f"unknown {what} {', '.join(bad)}; known: {', '.join(known)}")
    return names


def _sizes(text: str) -> tuple[tuple[int, int], ...]:
    out = []
    for part in text.split(","):
        w, _, h = part.strip().partition("x")
        out.append((int(w), int(h or w)))
    return tuple(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    p.add_argument(
        "--no-validate",
        dest="validate",
        action="store_false",
        help="bypass sdfarm's validation: every combination reaches the runtime",
    )
    p.add_argument("--samplers", default="all", help="comma-separated, or all (with default)")
    p.add_argument("--schedulers", default="all", help="comma-separated, or all (with default)")
    p.add_argument("--steps", default=",".join(map(str, DEFAULT_STEPS)))
    p.add_argument("--sizes", default=",".join(f"{w}x{h}" for w, h in DEFAULT_SIZES))
    p.add_argument(
        "--prompts",
        default="short",
        help=f"comma-separated, of {', '.join(PROMPTS)}; extra ones run once",
    )
    p.add_argument(
        "--memory-limit-gb",
        type=float,
        default=MEMORY_LIMIT_GB,
        help="address-space limit of each child (0: none)",
    )
    p.add_argument("--jobs", type=int, default=1, help="child processes at a time")
    p.add_argument("--threads", type=int, default=1, help="runtime threads per child")
    p.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per combination")
    p.add_argument("--model", help="a model folder (default: the tiny test model, made now)")
    p.add_argument("--out", help="JSON result file (default: print only)")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)  # fmt: skip
    if args.child:
        return child_main(args.child, args.validate, args.threads)

    combos = grid(
        _names(args.samplers, ALL_SAMPLERS, "sampler"),
        _names(args.schedulers, ALL_SCHEDULERS, "scheduler"),
        tuple(int(s) for s in args.steps.split(",")),
        _sizes(args.sizes),
        _names(args.prompts, tuple(PROMPTS), "prompt"),
    )
    with tempfile.TemporaryDirectory(prefix="crasher-sweep-model-") as tmp:
        model = args.model
        if model is None:
            from sdfarm.native.testmodel import make_test_model

            model = str(make_test_model(tmp)[0])

        def progress(done: int, out: Outcome) -> None:
            if out.status in ("crashed", "hang", "error") or not args.quiet:
                extra = out.signal or out.message or ("blank" if out.blank else "")
                print(
                    f"[{done}/{len(combos)}] {out.combo.label}: {out.status} "
                    f"{out.seconds:.2f}s {extra}".rstrip(),
                    flush=True,
                )

        result = sweep(
            combos,
            model,
            validate=args.validate,
            jobs=args.jobs,
            threads=args.threads,
            timeout=args.timeout,
            memory_limit_gb=args.memory_limit_gb,
            progress=progress,
        )
    print(result.table())
    if result.crashers():
        print(result.crasher_table())
    if args.out:
        doc = result.as_dict()
        doc["model"] = Path(model).name
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
