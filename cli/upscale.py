"""`sdfarm upscale IMAGE --upscaler NAME [--factor N] [--tile-size N] -o OUT`: one upscale, in
this process (`--in-process`) or as a job on the farm (a private local farm when none runs),
like `generate`. The flags come from the upscale job's schema (sdfarm.native.upscale_params);
with --json, stdout carries exactly one JSON document."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from sdfarm.cli.main import add_one_job_flags, run_one_job
from sdfarm.cli.options import add_option_flags, add_upscale_flags, given_options, given_upscale


def add_upscale_command(sub: Any) -> None:
    p = sub.add_parser("upscale", help="upscale one image with an ESRGAN upscaler")
    add_upscale_flags(p)
    p.add_argument(
        "--models",
        action="append",
        default=[],
        help="a directory of models whose upscalers/ folder holds the upscaler "
        "(also $SDFARM_MODELS; more upscaler folders in $SDFARM_UPSCALERS)",
    )
    p.add_argument("-o", "--output", default="upscaled.png")
    add_option_flags(p, "log_level", "priority", "deadline_s")
    add_one_job_flags(p)
    p.set_defaults(func=cmd_upscale)


def cmd_upscale(args: argparse.Namespace) -> int:
    from sdfarm.native import upscale_params

    def checked() -> Any:
        values = upscale_params.read_image_file(given_upscale(args))
        return upscale_params.validate(upscale_params.from_mapping(values))

    def summary(doc: dict[str, Any]) -> str:
        return (
            f"{doc['output']}: {doc['input_size'][0]}x{doc['input_size'][1]} -> "
            f"{doc['output_size'][0]}x{doc['output_size'][1]} ({doc['upscaler']}, x"
            f"{doc['factor']}), {doc['timings'].get('upscale_s', '?')} s on {doc['device']}"
        )

    return run_one_job(args, checked, _in_process, _on_farm, summary)


def _write(path: str, png: bytes) -> str:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(png)
    return str(out)


def _in_process(args: argparse.Namespace, params: Any) -> dict[str, Any]:
    """Resolve the upscaler in the model directories' upscalers/ folders, load, upscale."""
    from sdfarm.native.catalog import model_dirs
    from sdfarm.native.engine import LogConfig
    from sdfarm.native.png import png_bytes
    from sdfarm.native.upscale import Upscaler
    from sdfarm.native.upscalers import UpscalerCatalog, upscaler_dirs

    file = UpscalerCatalog(upscaler_dirs(model_dirs(args.models))).load(params.upscaler)
    log = LogConfig(level=args.log_level or "none")
    t0 = time.monotonic()
    with Upscaler.load(
        file,
        tile_size=params.tile_size,
        device=args.device,
        check_memory=not args.no_check_memory,
        log=log,
        threads=args.threads,
    ) as up:
        load_s = time.monotonic() - t0
        result = up.upscale(params)
        records = up.drain_load_records() + result.records
    meta = {**result.metadata, "model": params.upscaler}
    output = _write(args.output, png_bytes(result.image, meta))
    meta["timings"] = {**meta["timings"], "load_s": round(load_s, 4)}
    for r in records:
        print(f"[{r.level}] {r.message}", file=sys.stderr)
    return {"output": output, **meta, "records": [r.as_dict() for r in records]}


def _on_farm(args: argparse.Namespace, params: Any) -> dict[str, Any]:
    """One upscale job at interactive priority on the running farm (else a private one)."""
    from sdfarm.cli.farm import _connect, _models_dirs, farm_url

    options = {"priority": 0, **given_options(args)}
    with farm_url(args.redis, _models_dirs(args.models), args.threads) as url:
        job = _connect(url).upscale(
            params.image, params.upscaler, factor=params.factor, tile_size=params.tile_size,
            **options,
        )  # fmt: skip
        result = job.result(args.timeout)
    output = _write(args.output, result.png)
    return {"output": output, "job": job.id, "redis_url": url, **result.metadata,
            "records": list(result.records or [])}  # fmt: skip
