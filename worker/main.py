"""`sdfarm worker`: one Celery worker for one device of this host.

The parent process reads the host's figures in a subprocess (querying a GPU initialises its
driver, which must never happen before a fork), resolves the device, pins the runtime to it
through the environment (master-596 picks devices only from environment variables), then
runs a Celery prefork pool that consumes only this device's queue: one process, or with
`--engines N` N processes (engine slots) that run N jobs at once on the one device, sharing its
figure (sdfarm.worker.slots). Engines, the heartbeat and the uploader live in the pool
processes (sdfarm.worker.hooks).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sdfarm.native.devices import Device, HostFigures, choose_compute_device
from sdfarm.store import transport
from sdfarm.worker.slots import ENGINES_ENV, auto_engines, parse_engines

SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """ "8GiB", "8G", "512MiB", "1.5 GiB", "1000000" -> bytes (K/M/G/T are powers of 1024)."""
    m = SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 8GiB, 512MiB)")
    power = " KMGT".index(m.group(2).upper() or " ")
    return int(float(m.group(1)) * 1024**power)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `sdfarm worker` (the CLI wires them; `python -m sdfarm.worker.main` too)."""
    parser.add_argument(
        "--device",
        default="auto",
        help="device name as `sdfarm devices` lists it (CPU, Vulkan0, CUDA1), or auto (the "
        "discrete GPU with the most free memory), gpu or cpu (default auto)",
    )
    parser.add_argument(
        "--redis",
        default=os.environ.get("SDFARM_REDIS_URL"),
        help="Redis URL of the farm (default $SDFARM_REDIS_URL)",
    )
    parser.add_argument(
        "--models",
        action="append",
        default=[],
        metavar="DIR",
        help="a models directory (repeatable; default $SDFARM_MODELS); jobs name models only "
        "inside these",
    )
    parser.add_argument(
        "--lora-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="a folder of LoRA files besides each models directory's loras/ (repeatable; "
        "default $SDFARM_LORAS)",
    )
    parser.add_argument(
        "--upscaler-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="a folder of upscaler (ESRGAN) files besides each models directory's upscalers/ "
        "(repeatable; default $SDFARM_UPSCALERS)",
    )
    parser.add_argument(
        "--controlnet-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="a folder of ControlNet files besides each models directory's controlnets/ "
        "(repeatable; default $SDFARM_CONTROLNETS)",
    )
    parser.add_argument(
        "--embedding-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="a folder of textual-inversion embeddings besides each models directory's "
        "embeddings/ (repeatable; default $SDFARM_EMBEDDINGS)",
    )
    parser.add_argument(
        "--results",
        default=os.environ.get("SDFARM_RESULTS") or "redis",
        metavar="URL",
        help="where finished images go: redis (small results, capped), file:///shared/dir or "
        "s3://bucket/prefix (credentials and endpoint from the AWS settings) (default "
        "$SDFARM_RESULTS, else redis)",
    )
    parser.add_argument(
        "--host", default=None, help="host name in the farm (default: this machine's hostname)"
    )
    parser.add_argument(
        "--memory-limit",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="cap what this worker's engines may hold, e.g. 8GiB (default: the device's figure)",
    )
    parser.add_argument(
        "--keep-alive",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="unload a model idle this long (default 300)",
    )
    parser.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="MODEL",
        help="load MODEL at start and never unload it (repeatable)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU threads per engine (default: all cores)"
    )
    parser.add_argument(
        "--engines",
        type=parse_engines,
        default=os.environ.get(ENGINES_ENV) or "1",
        metavar="N|auto",
        help="engine slots on the device: N pool processes, each with its own engines, run N "
        "jobs at once; every engine and running job counts against the device's one figure. "
        "auto: 1 on the CPU, 2 on a discrete GPU (fewer when two engines of the largest model "
        "do not fit) (default $SDFARM_ENGINES, else 1)",
    )
    parser.add_argument(
        "--backend",
        default=None,
        help="runtime build to use: cpu, vulkan, cuda, metal (default $SDFARM_BACKEND or cpu)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus /metrics for this device on PORT (deploy/ uses 9102 for a "
        "host's first worker; default $SDFARM_WORKER_METRICS_PORT, else off)",
    )
    parser.add_argument("--metrics-addr", default="0.0.0.0", help="the address /metrics listens on")
    parser.add_argument(
        "--json", action="store_true", help="print one JSON line describing the worker at start"
    )


def pin_environment(
    device: Device, figs: HostFigures, environ: dict[str, str] | Any = os.environ
) -> str:
    """Point the runtime at `device` through the environment (inherited by the pool process
    and the probes it runs) and return the name that process's runtime will see it by."""
    name = device.name
    digits = name[len(name.rstrip("0123456789")) :]
    if name.startswith("Vulkan") and digits:
        environ["SD_VK_DEVICE"] = digits
        return name
    if name.startswith("CUDA") and digits:
        visible = [v.strip() for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v]
        environ["CUDA_VISIBLE_DEVICES"] = (
            visible[int(digits)] if int(digits) < len(visible) else digits
        )
        return "CUDA0"
    if device.type == "cpu":
        # The runtime computes on the first GPU it finds: hide them from a CPU worker.
        if any(d.name.startswith("Vulkan") for d in figs.devices):
            environ["GGML_VK_VISIBLE_DEVICES"] = ""
        if any(d.name.startswith("CUDA") for d in figs.devices):
            environ["CUDA_VISIBLE_DEVICES"] = ""
    return name


def build_config(args: argparse.Namespace) -> Any:
    """Probe (in a subprocess), choose and pin the device: the WorkerConfig for the pool."""
    from sdfarm.native.catalog import model_dirs
    from sdfarm.native.probe import read_host_figures
    from sdfarm.worker.hooks import WorkerConfig

    if args.backend:
        os.environ["SDFARM_BACKEND"] = args.backend
    figs = read_host_figures(args.backend)
    try:
        device = choose_compute_device(figs, args.device)
    except ValueError as exc:
        raise SystemExit(f"sdfarm worker: {exc}") from None
    engine_device = pin_environment(device, figs)
    host = args.host or socket.gethostname()
    if not args.redis:
        raise SystemExit("sdfarm worker: no farm given (--redis URL or $SDFARM_REDIS_URL)")
    dirs = [str(d) for d in model_dirs(args.models)]
    if not dirs:
        raise SystemExit("sdfarm worker: no models directory (--models DIR or $SDFARM_MODELS)")
    results = check_results(args.results)
    config = WorkerConfig(
        redis_url=args.redis,
        host=host,
        device=device,
        engine_device=engine_device,
        models=dirs,
        figures=figs,
        memory_limit=args.memory_limit,
        keep_alive=args.keep_alive,
        pins=list(args.pin),
        lora_dirs=list(args.lora_dir),
        upscaler_dirs=list(args.upscaler_dir),
        controlnet_dirs=list(args.controlnet_dir),
        embedding_dirs=list(args.embedding_dir),
        threads=args.threads,
        backend=args.backend or os.environ.get("SDFARM_BACKEND"),
        celery_hostname=f"sdfarm.{device.name}@{host}",
        results=results,
    )
    engines = args.engines if isinstance(args.engines, int) else parse_engines(args.engines)
    if engines == "auto":
        engines = auto_engines(
            device.type, cache_capacity(config), largest_model(config), mps=cuda_mps(device)
        )
    config.engines = int(engines)
    return config


def _touch(path: Path) -> None:
    try:
        path.touch()
    except OSError as exc:  # the folder went with a worker already ending
        logging.getLogger("sdfarm.worker").warning("stop file %s not written: %s", path, exc)


def cuda_mps(device: Any) -> bool:
    """Whether `device` is a CUDA GPU whose processes would be MPS clients (`--engines
    auto` then runs more engines: sdfarm.worker.slots.MPS_ENGINES)."""
    from sdfarm.native.mps import mps_active

    return str(device.name).upper().startswith("CUDA") and mps_active()


def cache_capacity(config: Any) -> int:
    from sdfarm.worker.heartbeat import cache_limits

    return cache_limits(config)[0]


def largest_model(config: Any) -> int:
    """The largest resident estimate of the models this worker lists (0 when none loads):
    what `--engines auto` must fit that many times."""
    from sdfarm.native.catalog import Catalog
    from sdfarm.native.estimate import model_facts

    catalog, largest = Catalog(config.models), 0
    for name in catalog.names():
        try:
            largest = max(largest, model_facts(catalog.load(name), config.device).resident())
        except Exception:  # noqa: BLE001 - a broken model is the heartbeat's to report
            continue
    return largest


def check_results(url: str) -> str:
    """The result store's URL once it answered (a folder that takes a file, a bucket that
    answers with these credentials): a worker that could not store a single image must not
    take jobs."""
    from sdfarm.store.results import REDIS_URL, check_url, new_external

    try:
        if check_url(url) != REDIS_URL:
            new_external(url).check()
    except Exception as exc:  # noqa: BLE001 - any refusal stops the worker, saying why
        raise SystemExit(f"sdfarm worker: --results {url}: {exc}") from None
    return url


def run(args: argparse.Namespace) -> int:
    """Run the worker until it is stopped (SIGTERM: finish the running job, then exit)."""
    from sdfarm.worker import hooks, metrics
    from sdfarm.worker.app import make_app, prefetch
    from sdfarm.worker.heartbeat import cache_limits

    try:
        reserve = prefetch()
    except ValueError as exc:
        raise SystemExit(f"sdfarm worker: {exc}") from None

    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    config = build_config(args)
    board = None
    if config.engines > 1:
        from sdfarm.worker.slots import SlotBoard

        board = SlotBoard.create()
        config.slots_dir = str(board.root)
    # Touched on SIGTERM: a slot running a chain of jobs (sdfarm.worker.chain) takes no more.
    run_dir = Path(tempfile.mkdtemp(prefix="sdfarm-worker-"))
    config.run_dir = str(run_dir)
    config.stop_file = str(run_dir / "stopping")
    transport.on_worker_stopping(lambda: _touch(run_dir / "stopping"))
    hooks.configure(config)
    transport.on_pool_process(hooks.on_process_init, hooks.on_process_shutdown)
    app = make_app(config.redis_url, reserve)
    port = args.metrics_port if args.metrics_port is not None else metrics.default_port()
    if port:
        metrics.serve(config.redis_url, config.device_key, port, args.metrics_addr)
    capacity, overflow = cache_limits(config)
    doc = {
        "event": "worker",
        "host": config.host,
        "device": config.device.name,
        "key": config.device_key,
        "queue": config.queue,
        "type": config.device.type,
        "engine_device": config.engine_device,
        "results": config.results,
        "capacity": capacity,
        "overflow": overflow,
        "engines": config.engines,
        "prefetch": reserve,
        "mps": cuda_mps(config.device),
        "models": config.models,
        "pid": os.getpid(),
        "metrics_port": port or None,
    }
    if args.json:
        sys.stdout.write(json.dumps(doc) + "\n")
        sys.stdout.flush()
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # keep stdout to the one document
    else:
        print(
            f"sdfarm worker {config.device_key} ({config.device.type}) on queue {config.queue}, "
            f"{config.engines} engine slot(s){' (CUDA MPS)' if doc['mps'] else ''}",
            file=sys.stderr,
        )
    try:
        return transport.run_worker(
            app, config.celery_hostname, config.queue, concurrency=config.engines
        )
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        if board is not None:
            board.remove()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sdfarm worker", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
