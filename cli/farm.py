"""The farm's commands of the `sdfarm` CLI: up, worker, scheduler and gateway here, and their
parser with batch (cli/batch.py), status, cancel, models and `generate` without --in-process
(cli/jobs.py), plus the helpers those share: finding the farm, errors as JSON.

A command that needs a farm finds one the way `state.find_redis_url` says (--redis, then
$SDFARM_REDIS_URL, then the local farm `sdfarm up` announced); `generate` and `batch` start a
private local farm for the call when none runs, so the single-machine case needs no setup.
With --json, stdout carries exactly one JSON document; progress and logs go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sdfarm.cli.main import EXIT_FARM, emit, error_doc, exit_code
from sdfarm.cli.options import add_option_flags, add_param_flags

EXIT_BATCH_FAILED = 1


class FarmNotFoundError(RuntimeError):
    """No farm to talk to, and not enough to start one."""


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _fail(args: argparse.Namespace, exc: BaseException, code: int | None = None) -> int:
    if getattr(args, "json", False):
        emit(error_doc(exc))
    else:
        _err(f"error: {exc}")
    if code is not None:
        return code
    rc = exit_code(exc)
    return EXIT_FARM if rc == 1 and isinstance(exc, FarmNotFoundError | ConnectionError) else rc


def _models_dirs(given: list[str]) -> list[Path]:
    from sdfarm.native.catalog import model_dirs

    return model_dirs(given)


def _split_model(model: str, dirs: list[Path]) -> tuple[str, list[Path]]:
    """`--model` may be a folder: the farm resolves names only inside its model directories
    (a safety rule), so a folder becomes its name plus its parent directory."""
    path = Path(model).expanduser()
    if os.sep in model or (path.is_dir() and not any((d / model).is_dir() for d in dirs)):
        path = path.resolve()
        return path.name, [*dirs, path.parent]
    return model, dirs


@contextlib.contextmanager
def farm_url(
    explicit: str | None, models_dirs: list[Path], threads: int | None = None
) -> Iterator[str]:
    """A running farm's URL, else a private LocalFarm's for the duration of the block."""
    from sdfarm.localfarm.state import find_redis_url

    url = find_redis_url(explicit)
    if url:
        yield url
        return
    if not models_dirs:
        raise FarmNotFoundError(
            "no farm running (no --redis, $SDFARM_REDIS_URL or `sdfarm up`) and no model "
            "directory to start one: give --models DIR or set SDFARM_MODELS"
        )
    from sdfarm.localfarm.farm import LocalFarm

    _err("no farm running: starting a local one for this command")
    with LocalFarm(models_dirs, threads=threads, announce=False) as farm:
        yield farm.url


def _connect(url: str) -> Any:
    from sdfarm.client.farm import Farm

    return Farm(url)


def _need_url(args: argparse.Namespace) -> str:
    from sdfarm.localfarm.state import find_redis_url

    url = find_redis_url(getattr(args, "redis", None))
    if not url:
        raise FarmNotFoundError(
            "no farm running: start one with `sdfarm up`, or give --redis URL "
            "(or set SDFARM_REDIS_URL)"
        )
    return url


# -- up / worker / scheduler ---------------------------------------------------------------------


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def cmd_up(args: argparse.Namespace) -> int:
    """The local farm in the foreground until Ctrl-C (or SIGTERM), then a clean stop. A
    process that exits or freezes is started again (localfarm/supervise.py); each restart is
    a line on stderr."""
    from sdfarm.localfarm.farm import LocalFarm
    from sdfarm.localfarm.state import state_dir, state_path

    dirs = _models_dirs(args.models)
    if not dirs:
        return _fail(args, FarmNotFoundError("give --models DIR (or set SDFARM_MODELS)"), 2)
    devices = [d for spec in args.device for d in spec.split(",") if d] or None
    # Ctrl-C and SIGTERM both stop cleanly; SIGINT is set explicitly because a shell starts
    # background jobs with it ignored, and `kill -INT` must still stop the farm.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    farm = LocalFarm(
        dirs,
        devices=devices,
        redis_url=args.redis,
        threads=args.threads,
        host=args.host,
        log_dir=args.log_dir or state_dir() / "logs",
        ready_timeout=args.timeout,
        schedulers=2,  # a standby takes over at once when the leader dies
        metrics_port=args.metrics_port,
        results=args.results,
        engines=args.engines,
        on_event=lambda kind, role, **info: _err(
            f"{role}: {kind} " + " ".join(f"{k}={v}" for k, v in info.items())
        ),
    )
    try:
        farm.start()
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - every start failure becomes a clear message
        return _fail(args, exc, EXIT_FARM)
    try:
        doc = {
            "redis_url": farm.url,
            "devices": farm.devices,
            "host": farm.host,
            "models_dirs": farm.models_dirs,
            "pids": {
                **({"redis": farm.redis.pid} if farm.redis is not None else {}),
                **{role: p.pid for role, p in farm.procs.items()},
            },
            "state_file": str(state_path()),
            "logs": str(farm.log_dir),
            "metrics": farm.metrics_ports(),
        }
        if args.json:
            emit(doc)
        else:
            print(f"farm up: {farm.url}")
            print(f"devices: {', '.join(farm.devices)} on {farm.host}")
            print(f"models: {', '.join(farm.models_dirs)}")
            print(f"logs: {farm.log_dir}")
            for role, port in farm.metrics_ports().items():
                print(f"metrics: {role} on http://127.0.0.1:{port}/metrics")
            print("Ctrl-C stops the farm", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        _err("stopping the farm")
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with contextlib.suppress(KeyboardInterrupt):
            farm.stop()


def _delegate(module: str, prog: str, argv: list[str]) -> int:
    import importlib

    mod = importlib.import_module(module)
    parser = argparse.ArgumentParser(prog=prog)
    mod.add_arguments(parser)
    return int(mod.run(parser.parse_args(argv)) or 0)


def cmd_worker(args: argparse.Namespace) -> int:
    return _delegate("sdfarm.worker.main", "sdfarm worker", args.argv)


def cmd_scheduler(args: argparse.Namespace) -> int:
    return _delegate("sdfarm.scheduler.service", "sdfarm scheduler", args.argv)


def cmd_gateway(args: argparse.Namespace) -> int:
    from sdfarm.gateway import main as gateway_main

    return gateway_main(args.argv)


# -- parser --------------------------------------------------------------------------------------


def _redis_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--redis", default=None, help="the farm's Redis URL (else $SDFARM_REDIS_URL, else `up`'s)"
    )


def _models_arg(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--models", action="append", default=[], metavar="DIR", help=help)


def add_farm_commands(sub: Any) -> None:
    """Register the farm's subcommands on `sdfarm`'s subparsers."""
    from sdfarm.cli import batch, jobs  # they use this module's helpers

    up = sub.add_parser("up", help="a local farm: redis-server, scheduler, a worker per device")
    _models_arg(up, "a directory of models (repeatable; also $SDFARM_MODELS)")
    up.add_argument(
        "--device", action="append", default=[], help="devices to run workers on (default: all)"
    )
    up.add_argument("--redis", default=None, help="use this Redis instead of a private one")
    up.add_argument("--threads", type=int, default=None, help="CPU threads per worker")
    up.add_argument(
        "--engines",
        default=None,
        metavar="N|auto",
        help="engine slots per worker: N jobs at once on a device, each engine counted against "
        "its figure (default $SDFARM_ENGINES, else 1)",
    )
    up.add_argument("--host", default=None, help="the host name in heartbeats")
    up.add_argument(
        "--results",
        default=None,
        metavar="URL",
        help="where the workers put images: redis, file:///shared/dir or s3://bucket/prefix "
        "(default $SDFARM_RESULTS, else redis)",
    )
    up.add_argument("--log-dir", default=None, help="where the children's logs go")
    up.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for workers")
    up.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus /metrics from PORT up: the schedulers, then a worker per device "
        "(default off)",
    )
    up.add_argument("--json", action="store_true")
    up.set_defaults(func=cmd_up)

    # Delegates parse their own flags, so `sdfarm worker --help` shows the worker's.
    for name, func, what in (
        ("worker", cmd_worker, "run one worker (one device) of a farm"),
        ("scheduler", cmd_scheduler, "run the scheduler of a farm"),
        ("gateway", cmd_gateway, "HTTP gateway: OpenAI images API, jobs API, metrics"),
    ):
        p = sub.add_parser(name, help=what, add_help=False, prefix_chars="\x00")
        p.add_argument("argv", nargs=argparse.REMAINDER)
        p.set_defaults(func=func)

    b = sub.add_parser("batch", help="render a file of prompts into a folder (resumable)")
    b.add_argument("file", help="prompts: .txt (a line each), .csv or .jsonl")
    b.add_argument("--out", required=True, help="the output folder")
    b.add_argument("--model", required=True)
    _models_arg(b, "model directories, used only to start a local farm when none runs")
    b.add_argument("--format", choices=("text", "csv", "jsonl"), default=None)
    add_param_flags(b, defaults=False)
    add_option_flags(b, "priority", "submitter", "deadline_s", "webhook")
    b.add_argument(  # checked by cmd_batch, so that --json still answers with one document
        "--in-flight", type=int, default=8, help="jobs queued on the farm at once (1 or more)"
    )
    b.add_argument("--threads", type=int, default=None, help="for a local farm started here")
    b.add_argument(
        "--save-frames",
        action="store_true",
        help="also write each video line's frames, as OUT/NAME/frame-0000.png, ...",
    )
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    _redis_arg(b)
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=batch.cmd_batch)

    s = sub.add_parser("status", help="hosts, devices, memory, loaded models, queues")
    _redis_arg(s)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=jobs.cmd_status)

    c = sub.add_parser("cancel", help="cancel a queued or running job")
    c.add_argument("id")
    _redis_arg(c)
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=jobs.cmd_cancel)

    d = sub.add_parser("delete", help="delete a job and its images (a live one is cancelled first)")
    d.add_argument("id")
    _redis_arg(d)
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=jobs.cmd_delete)

    r = sub.add_parser("results", help="result store upkeep: sweep a folder's old images")
    r.add_argument("action", choices=("sweep",))
    r.add_argument("url", help="the store, file:///shared/dir")
    r.add_argument(
        "--older-than",
        type=float,
        default=None,
        metavar="SECONDS",
        help="remove job folders last written this long ago (default $SDFARM_RESULT_TTL)",
    )
    r.add_argument("--json", action="store_true")
    r.set_defaults(func=jobs.cmd_results_sweep)

    m = sub.add_parser("models", help="the models and upscalers the farm's workers can load")
    _redis_arg(m)
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=jobs.cmd_models)

    # `generate` (defined in cli.py) gets a timeout for the farm path.
    gen = sub.choices.get("generate")
    if gen is not None:
        gen.add_argument(
            "--timeout", type=float, default=600.0, help="seconds to wait for the farm's result"
        )
