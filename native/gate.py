"""The native gate: helper threads of a worker process hold off their Python work while the
job thread is between two runtime calls.

Why: between two images the job thread runs about a millisecond of Python (the result
handed over, the next job begun), and every time it gives the GIL up there (a syscall, a
lock, a thread's wake-up) a helper thread that grabbed it keeps it for up to the switch
interval (0.5 ms in a worker: sdfarm.worker.hooks). The helpers (the uploader, the
lookahead, the cancel watch) have the whole native call to do their work, when the job
thread holds no GIL at all. So the engine closes the gate when a native call returns and
opens it when the next one starts; the worker opens it when its job thread has nothing
more to start. A helper waits at most HOLD_MAX_S, so no work is ever held for long.
"""

from __future__ import annotations

import threading

HOLD_MAX_S = 0.005


class Gate:
    """Open: helpers work. Closed: the job thread is on its way to its next native call."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()

    def close(self) -> None:
        """A native call returned: the job thread's Python runs next."""
        self._open.clear()

    def open(self) -> None:
        """A native call starts, or the job thread has nothing more to start."""
        self._open.set()

    def wait(self, timeout: float = HOLD_MAX_S) -> bool:
        """Until the gate is open, at most `timeout`; True when it is."""
        return self._open.wait(timeout)


GATE = Gate()
"""The gate of this process (its engines' native calls)."""
