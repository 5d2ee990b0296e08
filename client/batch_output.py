"""Batch output: where each item's PNG and sidecar go, which items are already done (the
resume test: a complete PNG exists), and writing them so that a PNG appears only once complete
(sidecar first, then the PNG renamed into place) and a failed write leaves no `.tmp` behind.

A video line's output is its video file instead of the PNG (`NAME.webp`, or `NAME.mp4` when
the line asks for mp4), written the same way and so the same resume test; with `frames` its
frames go first, as `NAME/frame-0000.png`, ... (what `sdfarm video` writes into its folder).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from sdfarm.client.batch_input import BatchItem


def png_path(out_dir: Path, item: BatchItem) -> Path:
    """The item's output file: its PNG, or a video line's video file."""
    return out_dir / output_name(item)


def output_name(item: BatchItem) -> str:
    """`NAME.png` for an image, `NAME.webp` or `NAME.mp4` for a video (its format)."""
    if item.kind == "video":
        return f"{item.name}.{item.params.get('format') or 'webp'}"
    return f"{item.name}.png"


def frames_dir(out_dir: Path, item: BatchItem) -> Path:
    """Where a video line's frames go, when the batch writes them."""
    return out_dir / item.name


def sidecar_path(out_dir: Path, item: BatchItem) -> Path:
    return out_dir / f"{item.name}.json"


def split_done(
    items: Sequence[BatchItem], existing: Iterable[str]
) -> tuple[list[BatchItem], list[BatchItem]]:
    """(to do, skipped): an item is skipped when its output file (`{name}.png`, a video's
    `{name}.webp` or `.mp4`) is among the existing files. Pure, so the decision is tested
    without a farm or a disk."""
    have = set(existing)
    todo = [i for i in items if output_name(i) not in have]
    skipped = [i for i in items if output_name(i) in have]
    return todo, skipped


def is_done(out_dir: Path, item: BatchItem) -> bool:
    """The resume test of one item, on the disk: its PNG (a video's file) exists and is not
    empty (a batch streaming its input asks per item instead of listing the folder)."""
    try:
        return png_path(out_dir, item).stat().st_size > 0
    except FileNotFoundError:
        return False


def existing_files(out_dir: Path) -> set[str]:
    try:
        return {p.name for p in out_dir.iterdir() if p.is_file() and p.stat().st_size > 0}
    except FileNotFoundError:
        return set()


def write_file(path: Path, data: bytes) -> None:
    """The one place a batch writes bytes to disk (run_batch's `write` hook)."""
    with open(path, "wb") as f:
        f.write(data)


def _write_atomically(
    path: Path, data: bytes, write: Callable[[Path, bytes], None] = write_file
) -> None:
    """`data` under `path`, or nothing: a temporary file renamed into place, removed when the
    write fails (a full disk leaves no half file behind)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_result(
    out_dir: Path,
    item: BatchItem,
    job_id: str,
    result: Any,
    write: Callable[[Path, bytes], None] = write_file,
    frames: bool = False,
) -> Path:
    """The sidecar first, then the PNG: a PNG on disk always has its metadata beside it. When
    the PNG cannot be written, the sidecar just written goes too (the item is redone). A
    video: the sidecar, its frames when `frames`, then its video file."""
    sidecar = {
        "name": item.name,
        "prompt": item.prompt,
        "job": job_id,
        "metadata": getattr(result, "metadata", {}),
        "records": getattr(result, "records", []),
    }
    meta = sidecar_path(out_dir, item)
    _write_atomically(meta, json.dumps(sidecar, indent=2, default=str).encode(), write)
    target = png_path(out_dir, item)
    try:
        if item.kind == "video":
            _write_frames(frames_dir(out_dir, item), result.frames if frames else [], write)
        _write_atomically(target, result.video if item.kind == "video" else result.png, write)
    except BaseException:
        with contextlib.suppress(OSError):
            meta.unlink()
        raise
    return target


def _write_frames(
    folder: Path, pngs: Sequence[bytes], write: Callable[[Path, bytes], None] = write_file
) -> None:
    """A video's frames as `folder/frame-0000.png`, ..., each written whole."""
    if not pngs:
        return
    folder.mkdir(exist_ok=True)
    for i, png in enumerate(pngs):
        _write_atomically(folder / f"frame-{i:04d}.png", png, write)
