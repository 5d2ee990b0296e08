"""Where a local farm announces itself, so `sdfarm generate`, `batch` and `status` find it
without flags.

`sdfarm up` writes `$XDG_RUNTIME_DIR/sdfarm/local.json` (fallback `/tmp/sdfarm-$UID/`, a 0700
directory that must belong to us: a shared /tmp must not let another user plant a farm URL).
The file names the Redis URL and every process with its start time, so a stale file (a farm
killed without cleanup, or a pid reused by an unrelated process) is recognised and ignored.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ENV_REDIS_URL = "SDFARM_REDIS_URL"
STATE_NAME = "local.json"


def state_dir() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_dir():
        return Path(runtime) / "sdfarm"
    return Path(f"/tmp/sdfarm-{os.getuid()}")


def state_path() -> Path:
    return state_dir() / STATE_NAME


def _private_dir(path: Path) -> Path:
    """Create `path` as 0700, or check an existing one is ours and private."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(f"{path} is not a directory owned by uid {os.getuid()}")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def process_start_time(pid: int) -> float | None:
    """The process's start time (psutil), None if there is no such process."""
    import psutil

    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
        return None


def pid_alive(pid: int, started: float | None = None) -> bool:
    """True when `pid` runs and (given `started`) is the same process, not a reused pid."""
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        created = proc.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
        return False
    return started is None or abs(created - started) < 1.0


@dataclass
class LocalState:
    """What `local.json` holds. `pids` maps a role (`owner`, `redis`, `scheduler`,
    `worker:{device}`) to [pid, start time]."""

    redis_url: str
    pids: dict[str, list[float]] = field(default_factory=dict)
    models_dirs: list[str] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.time)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> LocalState:
        return cls(
            redis_url=str(doc["redis_url"]),
            pids={k: [int(v[0]), float(v[1])] for k, v in dict(doc.get("pids", {})).items()},
            models_dirs=[str(d) for d in doc.get("models_dirs", [])],
            devices=[str(d) for d in doc.get("devices", [])],
            started=float(doc.get("started", 0.0)),
        )

    def alive(self) -> bool:
        """The farm answers when its owner, Redis (if it started one) and scheduler run and at
        least one worker does; a single dead worker does not make the farm unusable."""
        needed = [r for r in ("owner", "redis", "scheduler") if r in self.pids]
        workers = [r for r in self.pids if r.startswith("worker:")]
        if "owner" not in self.pids:
            return False
        if not all(pid_alive(int(self.pids[r][0]), self.pids[r][1]) for r in needed):
            return False
        return not workers or any(pid_alive(int(self.pids[r][0]), self.pids[r][1]) for r in workers)


def pid_entry(pid: int) -> list[float]:
    return [pid, process_start_time(pid) or time.time()]


def write_state(state: LocalState, path: Path | None = None) -> Path:
    """Write atomically (temp file + rename, mode 0600) so a reader never sees half a file."""
    path = path or state_path()
    _private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(state.to_json())
    os.replace(tmp, path)
    return path


def read_state(path: Path | None = None) -> LocalState | None:
    """The announced farm, or None when there is no readable file."""
    path = path or state_path()
    try:
        return LocalState.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


def remove_state(owner_pid: int | None = None, path: Path | None = None) -> None:
    """Remove the file, but only if it still announces our farm (`owner_pid`), so stopping
    one farm never erases another's announcement."""
    path = path or state_path()
    if owner_pid is not None:
        current = read_state(path)
        if current is not None and int(current.pids.get("owner", [0])[0]) != owner_pid:
            return
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def live_state(path: Path | None = None) -> LocalState | None:
    """The announced farm if its processes are alive, else None."""
    state = read_state(path)
    return state if state is not None and state.alive() else None


def find_redis_url(explicit: str | None = None) -> str | None:
    """--redis, else $SDFARM_REDIS_URL, else the running local farm's, else None."""
    if explicit:
        return explicit
    env = os.environ.get(ENV_REDIS_URL)
    if env:
        return env
    state = live_state()
    return state.redis_url if state is not None else None
