"""`sdfarm batch FILE --out DIR`: a file of prompts rendered into a folder on the running farm
(else a private local one), with a progress bar; finished images are never redone.

Every job option the user gave (priority, submitter, deadline_s, webhook: `given_options`) goes
to each job; a batch's priority is 9 unless given. The file is streamed twice, never held: a
first pass checks every line (nothing is queued from a bad file), the second feeds the farm.
Exit codes: 0 every item rendered (or already there); 1 some items failed (each for its own
reason, listed in the summary); 2 the input or the flags are invalid (nothing queued); 6
(EXIT_FARM) the farm could not be reached, or the batch stopped because it could not go on
(Redis away past the retry budget, or full); 7 (EXIT_OUTPUT) the batch stopped because the
output folder refused a write (a full disk). A stopped batch cancels what it had in flight and
keeps every image written: run the same command again to resume. With --json, stdout carries
exactly one JSON document (the summary, with an `error` when it stopped).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from sdfarm.cli.farm import (
    EXIT_BATCH_FAILED,
    _connect,
    _err,
    _fail,
    _models_dirs,
    _split_model,
    farm_url,
)
from sdfarm.cli.main import EXIT_FARM, emit, error_doc
from sdfarm.cli.options import given_options, given_params

EXIT_OUTPUT = 7
"""The batch stopped: its output folder refused a write (a full disk, no permission)."""


def in_flight_type(text: str) -> int:
    """The argparse type of `--in-flight`: a whole number of jobs, at least 1 (0 would never
    queue anything)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a whole number of jobs, 1 or more; got {text!r}"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"must be at least 1 (jobs queued on the farm at once: 1 or more); got {value}"
        )
    return value


def _progress(enabled: bool, total: int, skipped: int) -> Any:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[failed]} failed"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not enabled,
        transient=False,
    )


def cmd_batch(args: argparse.Namespace) -> int:
    from sdfarm.client.batch import BatchStopped, Summary, batch_options, run_batch
    from sdfarm.client.batch_input import BatchInputError, iter_items, scan_items
    from sdfarm.client.batch_output import is_done
    from sdfarm.native.errors import InvalidParameterError

    try:  # the parser's type may be a plain int: the range is checked here either way
        in_flight = in_flight_type(str(args.in_flight))
    except argparse.ArgumentTypeError as exc:
        return _fail(args, ValueError(f"argument --in-flight: {exc}"), 2)
    try:
        options = batch_options(given_options(args))
    except InvalidParameterError as exc:
        return _fail(args, exc, 2)
    out = Path(args.out)
    try:  # the whole file is checked first, streaming; then streamed again into the farm
        scan = scan_items(args.file, args.format, todo=lambda item: not is_done(out, item))
    except (OSError, BatchInputError) as exc:
        return _fail(args, exc, 2)
    model, dirs = _split_model(args.model, _models_dirs(args.models))
    if not scan.todo:
        # Nothing to render: no farm is needed (and none is started) to say so.
        summary = Summary(total=scan.total, skipped=scan.total, out=str(out), model=model)
        _report(args, summary)
        return 0
    try:
        with farm_url(args.redis, dirs, args.threads) as url:
            farm = _connect(url)
            with _progress(not args.quiet, scan.todo, scan.total - scan.todo) as bar:
                task = bar.add_task(f"{model}", total=scan.todo, failed=0)
                failed = 0

                def on_progress(kind: str, item: Any, n: int) -> None:
                    nonlocal failed
                    failed += kind == "failed"
                    bar.update(task, completed=n, failed=failed)

                summary = run_batch(
                    farm,
                    iter_items(args.file, args.format),
                    out,
                    model,
                    common=given_params(args),
                    options=options,
                    in_flight=in_flight,
                    on_progress=on_progress,
                    total=scan.total,
                    frames=args.save_frames,
                )
    except KeyboardInterrupt:
        _err("interrupted: finished images are kept; run the same command again to resume")
        return 130
    except BatchStopped as exc:
        _report(args, exc.summary, exc)
        return EXIT_OUTPUT if exc.kind == "output" else EXIT_FARM
    except Exception as exc:  # noqa: BLE001 - farm start or connection failures
        return _fail(args, exc)
    _report(args, summary)
    return EXIT_BATCH_FAILED if summary.failed else 0


def _report(args: argparse.Namespace, summary: Any, stopped: BaseException | None = None) -> None:
    """The summary: one JSON document with --json (with `error` when the batch stopped), else
    text on stdout and the reason it stopped on stderr."""
    if args.json:
        emit({**summary.to_dict(), **(error_doc(stopped) if stopped is not None else {})})
        return
    print(summary.text())
    if stopped is not None:
        _err(f"error: {stopped}")
