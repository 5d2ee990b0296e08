"""`sdfarm video MODEL PROMPT --frames N --out DIR`: one video (frames as PNGs and the video
file: an animated WebP, or an MP4 with `--format mp4` and the `video` extra), in this process
(`--in-process`) or as a job on the farm (a private local farm when none runs), like
`generate` and `upscale`. The flags come from the video job's schema
(sdfarm.native.video_params); with --json, stdout carries exactly one JSON document."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from sdfarm.cli.main import add_one_job_flags, run_one_job
from sdfarm.cli.options import _add, add_option_flags, given_options
from sdfarm.native.video_params import VIDEO_PARAMS


def add_video_command(sub: Any) -> None:
    p = sub.add_parser("video", help="make one video with a Wan model")
    p.add_argument("model", help="the model's name (a folder of --models) or folder")
    p.add_argument("prompt", help=VIDEO_PARAMS[0].help)
    for param in VIDEO_PARAMS:
        if param.name != "prompt":
            _add(p, param, None)
    p.add_argument(
        "--out", default="video", help="the folder for the frames and video.webp (or .mp4)"
    )
    p.add_argument(
        "--models", action="append", default=[], help="a directory of models (also $SDFARM_MODELS)"
    )
    add_option_flags(p, "log_level", "priority", "deadline_s")
    add_one_job_flags(p)
    p.set_defaults(func=cmd_video)


def given_video(args: argparse.Namespace) -> dict[str, Any]:
    """The video parameters given as flags (those left out are absent), the prompt too."""
    values = {
        p.name: getattr(args, p.name)
        for p in VIDEO_PARAMS
        if p.name != "prompt" and getattr(args, p.name, None) is not None
    }
    return {"prompt": args.prompt, **values}


def cmd_video(args: argparse.Namespace) -> int:
    from sdfarm.native import video_params

    def checked() -> Any:
        values = video_params.read_image_files(given_video(args))
        return video_params.validate(video_params.from_mapping(values))

    def summary(doc: dict[str, Any]) -> str:
        return (
            f"{doc['video']}: {doc['frames']} frames of {doc['width']}x{doc['height']} "
            f"({doc['model']}), {doc['timings'].get('generate_s', '?')} s on "
            f"{doc.get('device', '?')}"
        )

    return run_one_job(args, checked, _in_process, _on_farm, summary)


def _written(folder: Path, frames: list[bytes], video: bytes, fmt: str) -> dict[str, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, png in enumerate(frames):
        (target := folder / f"frame-{i:04d}.png").write_bytes(png)
        paths.append(str(target))
    (target := folder / f"video.{fmt}").write_bytes(video)
    files = {"frame_files": paths, "video": str(target)}
    return {**files, fmt: str(target)}  # `webp` (or `mp4`) too, as before the choice


def _in_process(args: argparse.Namespace, params: Any) -> dict[str, Any]:
    """Resolve the model in the model directories (or a folder), load, make the video."""
    from sdfarm.native.catalog import resolve
    from sdfarm.native.engine import Engine, LogConfig
    from sdfarm.native.png import png_bytes
    from sdfarm.native.videofile import check_format

    check_format(params.format)  # this process encodes it: before the model loads
    log = LogConfig(level=args.log_level or "none")
    t0 = time.monotonic()
    with Engine.load(
        resolve(args.model, args.models),
        device=args.device,
        check_memory=not args.no_check_memory,
        log=log,
        threads=args.threads,
    ) as engine:
        load_s = time.monotonic() - t0
        result = engine.video(params)
        records = engine.drain_load_records() + result.records
    meta = result.metadata
    pngs = [png_bytes(f, {**meta, "frame": i}) for i, f in enumerate(result.frames)]
    files = _written(Path(args.out), pngs, result.video, params.format)
    meta["timings"] = {**meta["timings"], "load_s": round(load_s, 4)}
    for r in records:
        print(f"[{r.level}] {r.message}", file=sys.stderr)
    return {**files, **meta, "records": [r.as_dict() for r in records]}


def _on_farm(args: argparse.Namespace, params: Any) -> dict[str, Any]:
    """One video job at interactive priority on the running farm (else a private one)."""
    from sdfarm.cli.farm import _connect, _models_dirs, farm_url
    from sdfarm.native import video_params

    options = {"priority": 0, **given_options(args)}
    fields = {k: v for k, v in params.as_dict().items() if k != "prompt"}
    for name in video_params.VIDEO_IMAGES:
        fields[name] = getattr(params, name)
    with farm_url(args.redis, _models_dirs(args.models), args.threads) as url:
        job = _connect(url).video(args.model, params.prompt, **fields, **options)
        result = job.result(args.timeout)
    assert result.video is not None and result.video_format is not None
    files = _written(Path(args.out), result.frames, result.video, result.video_format)
    return {**files, "job": job.id, "redis_url": url, **result.metadata,
            "records": list(result.records or [])}  # fmt: skip
