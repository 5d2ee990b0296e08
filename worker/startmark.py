"""The start mark: which job's run a worker process began last, written to a local file
as the run begins, so that the slot's next process can tell after an abort which job the
abort belongs to.

Why: an abort must be charged to the job that caused it, and to no other.
- A job claimed ahead (sdfarm.worker.chain) is claimed in Redis during the image before it,
  and its start reaches Redis from the lookahead thread after its run began, off the path
  between two images. A process that aborts in between leaves Redis saying the job never
  began, which would make its loss free: a job that kills its process at once could be
  retried for ever.
- The job before it may still be running in Redis when the next one aborts: its native
  call is over and its result is being written on the uploader thread. Without the mark its
  loss would be counted too (and twice makes poison).
The mark is one `pwrite` of the job id, dispatch and the process's incarnation (a few
microseconds, no fsync: an abort loses no page cache), read by the next process of the slot
when it settles what its predecessor left (`Store.restore_held`): that job is charged, any
other still running under the dead process is spared. The file lives in the worker's run
folder: a child that Celery replaces finds it; a whole worker that dies and is started again
does not (the scheduler then counts every running job it lost, and re-places a job claimed
ahead without counting it).
"""

from __future__ import annotations

import os
from pathlib import Path

from sdfarm.store.records import Began

SIZE = 256  # job ids and dispatch ids are uuids: one fixed-size record, rewritten in place


class StartMark:
    """The start mark of one slot: `write` before a run begins, `read` in its successor."""

    def __init__(self, path: str | os.PathLike[str] | None, incarnation: str = "") -> None:
        self.path = Path(path) if path is not None else None
        self.incarnation = incarnation
        self._fd: int | None = None

    def write(self, job_id: str, dispatch: str) -> None:
        if self.path is None:
            return
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
        record = f"{job_id} {dispatch} {self.incarnation}\n".encode()
        if len(record) > SIZE:
            raise ValueError(f"a start mark holds {SIZE} bytes: job {job_id!r}")
        os.pwrite(self._fd, record.ljust(SIZE), 0)

    def read(self) -> Began | None:
        """The last run begun (job id, dispatch, incarnation), or None (no mark, or one
        that does not read)."""
        if self.path is None:
            return None
        try:
            words = self.path.read_bytes()[:SIZE].decode().split()
        except (OSError, UnicodeDecodeError):
            return None
        return Began(*words) if len(words) == 3 else None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def for_slot(run_dir: str | None, slot: int, incarnation: str) -> StartMark:
    """The mark of engine slot `slot` of the worker whose run folder is `run_dir`, written
    by the process `incarnation` (none when the worker has no run folder: a process outside
    `sdfarm worker`)."""
    return StartMark(Path(run_dir) / f"started-{slot}" if run_dir else None, incarnation)
