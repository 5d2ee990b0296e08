"""`sdfarm generate --in-process`: one engine in this process, no Redis, no farm.

This is the baseline the farm is measured against, and the quickest way to try a model.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from sdfarm.cli.options import given_params
from sdfarm.native.catalog import model_dirs, resolve
from sdfarm.native.controlnets import ControlNetCatalog, controlnet_dirs
from sdfarm.native.embeddings import EmbeddingCatalog, embedding_dirs
from sdfarm.native.engine import Engine, LogConfig
from sdfarm.native.enginekey import key_of
from sdfarm.native.loras import LoraCatalog, lora_dirs
from sdfarm.native.params import GenerationParams, from_mapping, read_image_files, validate
from sdfarm.native.png import png_bytes
from sdfarm.native.upscalers import UpscalerCatalog, upscaler_dirs


def params_from_args(args: argparse.Namespace) -> GenerationParams:
    """Every generation parameter from its flag (sdfarm.cli.options)."""
    return from_mapping(read_image_files({"prompt": args.prompt, **given_params(args)}))


def _progress_printer(enabled: bool):
    if not enabled:
        return None

    def show(step: int, steps: int, seconds: float) -> None:
        print(f"\rstep {step}/{steps} ({seconds:.2f} s/it)", end="", file=sys.stderr, flush=True)

    return show


def generate_in_process(args: argparse.Namespace) -> dict[str, Any]:
    """Validate (before anything native), load, generate, write the PNG(s); return the JSON
    document that `--json` prints."""
    params = validate(params_from_args(args))
    log = LogConfig(level=args.log_level or "none", log_prompts=args.log_prompts)
    model = resolve(args.model, args.models)
    folders = [*model_dirs(args.models), *([model.directory.parent] if model.directory else [])]
    catalog = LoraCatalog(lora_dirs(dict.fromkeys(folders)))
    loras = {name: catalog.load(name) for name, _ in params.loras}
    upscalers = UpscalerCatalog(upscaler_dirs(dict.fromkeys(folders)))
    hires = {n: upscalers.load(n) for n in [params.hires_upscaler] if n}
    key = key_of(model.name, {"control_net": params.control_net, "embeddings": params.embeddings})
    controlnets = ControlNetCatalog(controlnet_dirs(dict.fromkeys(folders)))
    control_net = controlnets.load(key.control_net) if key.control_net else None
    embeddings = EmbeddingCatalog(embedding_dirs(dict.fromkeys(folders)))
    embedding_files = [embeddings.load(n) for n in key.embeddings]
    t0 = time.monotonic()
    engine = Engine.load(
        model,
        device=args.device,
        check_memory=not args.no_check_memory,
        log=log,
        threads=args.threads,
        control_net=control_net,
        embeddings=embedding_files,
        decoder=params.decoder,
    )
    load_s = time.monotonic() - t0
    records = engine.drain_load_records()
    try:
        result = engine.generate(
            params, progress=_progress_printer(not args.json), loras=loras, upscalers=hires
        )
        if not args.json:
            print(file=sys.stderr)
        records += result.records
    finally:
        records += engine.dispose()
    t1 = time.monotonic()
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    outputs = []
    for i, image in enumerate(result.images):
        path = out if i == 0 else out.with_name(f"{out.stem}-{i}{out.suffix}")
        path.write_bytes(png_bytes(image, {**result.metadata, "seed": result.metadata["seeds"][i]}))
        outputs.append(str(path))
    meta = dict(result.metadata)
    meta["timings"] = {
        **meta["timings"],
        "load_s": round(load_s, 4),
        "encode_s": round(time.monotonic() - t1, 4),
    }
    return {
        "output": outputs[0],
        "outputs": outputs,
        **meta,
        "capabilities": engine.capabilities.as_dict(),
        "records": [r.as_dict() for r in records],
    }
