"""Keeping a local farm's processes up: a child that exits, is killed or freezes is started
again, so one crash costs the jobs it held (which the scheduler re-places), never the farm.

A thread of the owning process checks every child a few times a second. A child that exited
is started again after a backoff that grows while it keeps failing (0.5 s doubling to 30 s,
reset after a minute up); one frozen (stopped by SIGSTOP or a debugger for FROZEN_S) is killed
with its whole process group and started again. The private
redis-server is one of the children: it restarts on the same port from its AOF, and the other
processes ride out the gap (they retry Redis errors).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

FROZEN_S = 5.0
"""How long a child may stay stopped or blocked in the kernel before it counts as frozen."""
CHECK_S = 0.2
BACKOFF_FIRST_S, BACKOFF_MAX_S, HEALTHY_S = 0.5, 30.0, 60.0


@dataclass
class Restart:
    """One child that went away and came back: when it was noticed gone and why, when it was
    started again (None until it is)."""

    role: str
    noticed: float
    why: str
    back: float | None = None

    @property
    def recovery_s(self) -> float | None:
        return None if self.back is None else round(self.back - self.noticed, 3)


@dataclass
class _Watch:
    failures: int = 0
    started: float = field(default_factory=time.monotonic)
    frozen_since: float | None = None


class Supervisor:
    """Watches `children()` ({role: process with .pid and .poll()}) and calls `restart(role)`
    for each that exited or froze. `on_event(kind, role, **info)` hears about it."""

    def __init__(
        self,
        children: Callable[[], dict[str, Any]],
        restart: Callable[[str], None],
        on_event: Callable[..., None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._children = children
        self._restart = restart
        self._on_event = on_event or (lambda kind, role, **info: None)
        self._clock = clock
        self._watch: dict[str, _Watch] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sdfarm-supervisor", daemon=True)
        self.restarts: list[Restart] = []

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(CHECK_S):
            for role, proc in list(self._children().items()):
                if self._stop.is_set():
                    return
                why = self._why_gone(role, proc)
                if why is not None:
                    self._bring_back(role, proc, why)

    def _why_gone(self, role: str, proc: Any) -> str | None:
        watch = self._watch.setdefault(role, _Watch())
        code = proc.poll()
        if code is not None:
            return f"exited with {code}" if code >= 0 else f"killed by signal {-code}"
        if _frozen(proc.pid):
            now = self._clock()
            watch.frozen_since = watch.frozen_since or now
            if now - watch.frozen_since >= FROZEN_S:
                return f"frozen for {now - watch.frozen_since:.1f} s"
        else:
            watch.frozen_since = None
        if self._clock() - watch.started > HEALTHY_S:
            watch.failures = 0
        return None

    def _bring_back(self, role: str, proc: Any, why: str) -> None:
        record = Restart(role, time.time(), why)
        self.restarts.append(record)
        self._on_event("gone", role, why=why)
        _kill_group(proc)  # a frozen child, or a dead one's orphans (its pool process)
        watch = self._watch.setdefault(role, _Watch())
        delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** max(0, watch.failures - 1))
        if watch.failures and self._stop.wait(delay):
            return
        watch.failures += 1
        try:
            self._restart(role)
        except Exception as exc:  # noqa: BLE001 - try again on the next check
            self._on_event("restart-failed", role, error=str(exc))
            return
        watch.started, watch.frozen_since = self._clock(), None
        record.back = time.time()
        self._on_event("restarted", role, why=why, after_s=record.recovery_s)


def _frozen(pid: int) -> bool:
    """True when the process is stopped (SIGSTOP, a debugger) or its state says traced/dead."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in (b"T", b"t")


def _kill_group(proc: Any) -> None:
    """SIGKILL the child's process group (each child leads its own session), then reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(5)
