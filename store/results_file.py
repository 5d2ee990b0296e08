"""`FileResults`: images in a folder every worker and reader mounts (`file:///shared/dir`).

Each job's images are `dir/{job id}/{run}-{i}.png` (`run`: the dispatch that made them), each
written to a temporary name and renamed
into place, so a reader never sees half an image. Nothing expires by itself: the job record
goes after RESULT_TTL, the folder stays until the job is deleted or `sweep` removes folders
older than a given age (`sdfarm results sweep`, or any cron job that deletes old folders).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

JOB_DIR = re.compile(r"[0-9a-f]{32}")
IMAGE = re.compile(r"[0-9a-f]{32}/(?:[0-9a-f]{1,32}-)?[0-9]+\.png")
RUN = re.compile(r"[0-9a-f]{0,32}")


class FileResults:
    """A shared folder as a result store."""

    inline = False

    def __init__(self, root: str) -> None:
        self.root = Path(root)
        self.url = "file://" + str(self.root)

    def check(self) -> None:
        """Create the folder and prove it takes a file (a worker checks at start)."""
        self.root.mkdir(parents=True, exist_ok=True)
        probe = self.root / f".sdfarm-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()

    def _path(self, key: str) -> Path:
        if not IMAGE.fullmatch(key):  # keys come from job records: never a path outside
            raise ValueError(f"not an image key of this store: {key!r}")
        return self.root / key

    def put(self, job_id: str, pngs: Sequence[bytes], run: str = "") -> list[str]:
        if not JOB_DIR.fullmatch(job_id) or not RUN.fullmatch(run):
            raise ValueError(f"not a job id and run: {job_id!r}, {run!r}")
        folder = self.root / job_id
        folder.mkdir(parents=True, exist_ok=True)
        keys = []
        for i, data in enumerate(pngs):
            key = f"{job_id}/{run}-{i}.png" if run else f"{job_id}/{i}.png"
            tmp = folder / f".{Path(key).name}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, self._path(key))
            keys.append(key)
        return keys

    def get(self, job_id: str, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def delete(self, job_id: str, keys: Sequence[str]) -> None:
        """The images named, then the job's folder if nothing else is in it (another run's
        images stay)."""
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                self._path(key).unlink()
        if JOB_DIR.fullmatch(job_id):
            with contextlib.suppress(OSError):
                (self.root / job_id).rmdir()

    def signed_url(self, key: str, expires_s: int = 0) -> str | None:
        return None

    def sweep(self, older_than_s: float, now: float | None = None) -> list[str]:
        """Remove every job folder last written more than `older_than_s` ago (RESULT_TTL:
        their records are gone, so nothing can name them); the ids removed."""
        cutoff = (time.time() if now is None else now) - older_than_s
        gone = []
        for entry in os.scandir(self.root):
            if JOB_DIR.fullmatch(entry.name) and entry.is_dir() and entry.stat().st_mtime < cutoff:
                shutil.rmtree(entry.path, ignore_errors=True)
                gone.append(entry.name)
        return gone
