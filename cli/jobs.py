"""The commands that talk to a running farm: `status`, `cancel`, `models`, and `generate`
without --in-process (one job at interactive priority; a private local farm when none runs)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from sdfarm.cli.farm import (
    EXIT_FARM,
    _connect,
    _err,
    _fail,
    _models_dirs,
    _need_url,
    _split_model,
    farm_url,
)
from sdfarm.cli.main import emit, exit_code
from sdfarm.cli.options import given_options, given_params


def _fmt_bytes(n: Any) -> str:
    from sdfarm.native.devices import format_bytes

    return format_bytes(n) if isinstance(n, int) else "-"


def _print_status(doc: dict[str, Any]) -> None:
    """Human form of Farm.status(): a line per device, its loaded models, then the queues."""
    devices = doc.get("devices") or []
    leader = doc.get("leader") or "none (no scheduler running)"
    print(f"scheduler: {leader}")
    if not devices:
        print("no workers")
    for d in devices:
        where = d.get("key") or f"{d.get('host', '?')}/{d.get('device', '?')}"
        alive = "" if d.get("alive", True) else "  (no heartbeat)"
        slots = f", {d['slots']} engine slots" if int(d.get("slots") or 1) > 1 else ""
        print(
            f"{where:<28} {d.get('type', ''):<5} {d.get('state', ''):<8} "
            f"free {_fmt_bytes(d.get('free'))} of {_fmt_bytes(d.get('total'))}, "
            f"figure {_fmt_bytes(d.get('figure'))}, "
            f"MemAvailable {_fmt_bytes(d.get('mem_available'))}, "
            f"jobs {d.get('queued', 0)}{slots}{alive}"
        )
        for m in d.get("loaded") or []:
            if not isinstance(m, dict):
                continue
            state = "busy" if m.get("busy") else f"idle {m.get('idle_s') or 0:.0f} s"
            pinned = ", pinned" if m.get("pinned") else ""
            if slots and m.get("slot") is not None:
                pinned += f", slot {m['slot']}"
            print(
                f"    {m.get('name', '?'):<24} {state}{pinned}, "
                f"estimate {_fmt_bytes(m.get('estimate'))}"
            )
    queues = doc.get("queues") or {}
    depth = ", ".join(f"p{p}: {n}" for p, n in sorted(queues.items()) if n) or "empty"
    print(f"queue: {depth} (pending {doc.get('pending', 0)})")
    for job in doc.get("running") or []:
        print(
            f"    {job.get('id')} {job.get('state', '')} {job.get('model', '')} on "
            f"{job.get('device') or '-'} (p{job.get('priority', '?')}, {job.get('submitter', '')})"
        )


def cmd_status(args: argparse.Namespace) -> int:
    try:
        doc = _connect(_need_url(args)).status()
    except Exception as exc:  # noqa: BLE001
        return _fail(args, exc)
    if args.json:
        emit(doc)
    else:
        _print_status(doc)
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    """The job's record, events and images go, from whichever store holds them; a live job
    is cancelled and waited for first."""
    try:
        deleted = _connect(_need_url(args)).delete(args.id)
        if not deleted:
            raise LookupError(f"no job {args.id} (unknown, or its record expired)")
    except Exception as exc:  # noqa: BLE001
        return _fail(args, exc)
    if args.json:
        emit({"id": args.id, "deleted": True})
    else:
        print(f"{args.id}: deleted")
    return 0


def cmd_results_sweep(args: argparse.Namespace) -> int:
    """Remove a shared folder's job folders older than RESULT_TTL (their records are gone,
    so nothing names them any more). An S3 store is swept by its bucket's lifecycle rule."""
    from urllib.parse import urlsplit

    from sdfarm.store.keys import RESULT_TTL
    from sdfarm.store.results_file import FileResults

    parts = urlsplit(args.url)
    if parts.scheme != "file" or not parts.path.startswith("/"):
        return _fail(
            args,
            ValueError(
                f"{args.url}: only a file:///folder store is swept here; give an S3 bucket a "
                "lifecycle rule that expires the prefix"
            ),
            2,
        )
    older = RESULT_TTL if args.older_than is None else args.older_than
    try:
        gone = FileResults(parts.path).sweep(older)
    except OSError as exc:
        return _fail(args, exc)
    if args.json:
        emit({"removed": gone})
    else:
        print(f"removed {len(gone)} job folder(s) older than {older:g} s from {parts.path}")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    """A queued job is cancelled at once; a placed or running one on request (its worker
    stops it), so the reply says which, and `already done` when there was nothing to do."""
    try:
        job = _connect(_need_url(args)).job(args.id)
        if not job.state():
            raise LookupError(f"no job {args.id} (unknown, or its record expired)")
        requested = bool(job.cancel())
        state = job.state()
    except Exception as exc:  # noqa: BLE001
        return _fail(args, exc)
    doc = {"id": args.id, "cancelled": requested, "state": state}
    if args.json:
        emit(doc)
    elif not requested:
        print(f"{args.id}: already {state}")
    else:
        print(
            f"{args.id}: "
            + ("cancelled" if state == "cancelled" else f"cancel requested ({state})")
        )
    return 0


def _model_line(m: dict[str, Any]) -> str:
    """A model's line: its name, and for a video model its variant (and CLIP vision encoder)."""
    if not m.get("video"):
        return str(m.get("name", m))
    vision = ", CLIP vision encoder" if m.get("clip_vision") else ""
    return f"{m['name']} (video: {m['video']}{vision})"


def cmd_models(args: argparse.Namespace) -> int:
    try:
        farm = _connect(_need_url(args))
        models, upscalers = farm.models(), farm.upscalers()
        controlnets, embeddings = farm.controlnets(), farm.embeddings()
    except Exception as exc:  # noqa: BLE001
        return _fail(args, exc)
    if args.json:
        emit({"models": models, "upscalers": upscalers, "controlnets": controlnets,
              "embeddings": embeddings})  # fmt: skip
    else:
        for m in models:
            print(m if isinstance(m, str) else _model_line(m))
        for u in upscalers:
            print(f"{u['name']} (upscaler, x{u['scale']})")
        for name in controlnets:
            print(f"{name} (ControlNet)")
        for name in embeddings:
            print(f"{name} (embedding)")
    return 0


# -- generate without --in-process ---------------------------------------------------------------


def generate_on_farm(args: argparse.Namespace) -> int:
    """`sdfarm generate`: one job at interactive priority on the running farm (else a private
    local farm for the call); writes the PNG(s) like --in-process does."""
    from sdfarm.native.errors import EngineError, InvalidParameterError

    model, dirs = _split_model(args.model, _models_dirs(args.models))
    if args.device != "auto" or args.no_check_memory:
        _err("note: --device and --no-check-memory apply to --in-process; the farm places jobs")
    params = given_params(args)
    options = {"priority": 0, **given_options(args)}
    try:
        from sdfarm.native.params import from_mapping, read_image_files, validate

        params = read_image_files(params)  # read once: the farm gets the bytes
        validate(from_mapping({"prompt": args.prompt, **params}))
        with farm_url(args.redis, dirs, args.threads) as url:
            farm = _connect(url)
            job = farm.submit(model, args.prompt, **params, **options)
            result = job.result(args.timeout)
    except KeyboardInterrupt:
        return 130
    except (InvalidParameterError, EngineError) as exc:
        return _fail(args, exc)
    except Exception as exc:  # noqa: BLE001 - farm errors become a message and EXIT_FARM
        return _fail(args, exc, EXIT_FARM if exit_code(exc) == 1 else None)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    outputs = []
    pngs = list(getattr(result, "pngs", None) or [result.png])
    for i, data in enumerate(pngs):
        path = out if i == 0 else out.with_name(f"{out.stem}-{i}{out.suffix}")
        path.write_bytes(data)
        outputs.append(str(path))
    meta = dict(getattr(result, "metadata", {}) or {})
    doc = {"output": outputs[0], "outputs": outputs, "job": job.id, "redis_url": url, **meta}
    doc["records"] = list(getattr(result, "records", []) or [])
    if args.json:
        emit(doc)
    else:
        timings = meta.get("timings", {})
        print(
            f"{outputs[0]}: job {job.id} on {meta.get('host', '?')}/{meta.get('device', '?')}, "
            f"seed {meta.get('seed', '?')}, generate {timings.get('generate_s', '?')} s"
        )
        for r in doc["records"]:
            if isinstance(r, dict):
                print(f"[{r.get('level')}] {r.get('message')}", file=sys.stderr)
    return 0
