"""`sdfarm batch FILE --out DIR`: a file of prompts rendered into a folder on the running farm
(else a private local one), with a progress bar; finished images are never redone."""

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
from sdfarm.cli.main import emit
from sdfarm.cli.options import given_params


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
    from sdfarm.client.batch import (
        BatchInputError,
        existing_files,
        read_items,
        run_batch,
        split_done,
    )

    try:
        items = read_items(args.file, args.format)
    except (OSError, BatchInputError) as exc:
        return _fail(args, exc, 2)
    out = Path(args.out)
    todo, _ = split_done(items, existing_files(out))
    model, dirs = _split_model(args.model, _models_dirs(args.models))
    if not todo:
        # Nothing to render: no farm is needed (and none is started) to say so.
        from sdfarm.client.batch import Summary

        summary = Summary(total=len(items), skipped=len(items), out=str(out), model=model)
        _report(args, summary)
        return 0
    try:
        with farm_url(args.redis, dirs, args.threads) as url:
            farm = _connect(url)
            with _progress(not args.quiet, len(todo), len(items) - len(todo)) as bar:
                task = bar.add_task(f"{model}", total=len(todo), failed=0)
                failed = 0

                def on_progress(kind: str, item: Any, n: int) -> None:
                    nonlocal failed
                    failed += kind == "failed"
                    bar.update(task, completed=n, failed=failed)

                summary = run_batch(
                    farm,
                    items,
                    out,
                    model,
                    common=given_params(args),
                    priority=9 if args.priority is None else args.priority,
                    in_flight=args.in_flight,
                    on_progress=on_progress,
                    submitter=args.submitter,
                )
    except KeyboardInterrupt:
        _err("interrupted: finished images are kept; run the same command again to resume")
        return 130
    except Exception as exc:  # noqa: BLE001 - farm start or connection failures
        return _fail(args, exc)
    _report(args, summary)
    return EXIT_BATCH_FAILED if summary.failed else 0


def _report(args: argparse.Namespace, summary: Any) -> None:
    if args.json:
        emit(summary.to_dict())
    else:
        print(summary.text())
