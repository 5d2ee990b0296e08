"""Batch output: where each item's PNG and sidecar go, which items are already done (the
resume test: a complete PNG exists), and writing them so that a PNG appears only once complete
(sidecar first, then the PNG renamed into place) and a failed write leaves no `.tmp` behind.
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
    return out_dir / f"{item.name}.png"


def sidecar_path(out_dir: Path, item: BatchItem) -> Path:
    return out_dir / f"{item.name}.json"


def split_done(
    items: Sequence[BatchItem], existing: Iterable[str]
) -> tuple[list[BatchItem], list[BatchItem]]:
    """(to do, skipped): an item is skipped when `{name}.png` is among the existing files.
    Pure, so the decision is tested without a farm or a disk."""
    have = set(existing)
    todo = [i for i in items if f"{i.name}.png" not in have]
    skipped = [i for i in items if f"{i.name}.png" in have]
    return todo, skipped


def is_done(out_dir: Path, item: BatchItem) -> bool:
    """The resume test of one item, on the disk: its PNG exists and is not empty (a batch
    streaming its input asks per item instead of listing the folder)."""
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
) -> Path:
    """The sidecar first, then the PNG: a PNG on disk always has its metadata beside it. When
    the PNG cannot be written, the sidecar just written goes too (the item is redone)."""
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
        _write_atomically(target, result.png, write)
    except BaseException:
        with contextlib.suppress(OSError):
            meta.unlink()
        raise
    return target
