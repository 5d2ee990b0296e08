"""Another process that holds GPU memory through torch (the `HOLDER` script), for the rules
stage: most of the GPU, or all of it to the last MiB."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import tempfile
import threading
import time
from typing import Any

from .children import _LIVE
from .harness import CaseError, Stage, _tail, error_text

HOLDER = r"""
import os, sys, time
import torch
parent = os.getppid()
hold, leave = float(sys.argv[1]), float(sys.argv[2])
free, total = torch.cuda.mem_get_info()
n = int(hold * 2**30) if hold > 0 else int(free - leave * 2**30)
n -= n % (2 << 20)
held = []
while n > 0:
    try:
        held.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
        break
    except RuntimeError:
        n -= 256 << 20
if leave <= 0 and hold <= 0:
    for chunk in (64 << 20, 2 << 20):
        while True:
            try:
                held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
            except RuntimeError:
                break
after, _ = torch.cuda.mem_get_info()
print("held", sum(x.numel() for x in held), after, total, flush=True)
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end and os.getppid() == parent:  # never outlive the suite
    time.sleep(0.5)
"""


def holder_split(line: str) -> dict[str, int] | None:
    """The holder's 'held BYTES FREE_AFTER TOTAL' line."""
    parts = line.split()
    if len(parts) != 4 or parts[0] != "held":
        return None
    held, free, total = (int(p) for p in parts[1:])
    return {"held": held, "free_after": free, "total": total}


class Holder:
    """Another process holding GPU memory through torch (the `HOLDER` script)."""

    def __init__(
        self,
        python: str,
        hold_gib: float,
        leave_gib: float,
        st: Stage,
        wait: float = 120.0,
        sleep: float = 900.0,
    ) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.info: dict[str, Any] = {"hold_gib": hold_gib, "leave_gib": leave_gib}
        cmd = [python, "-c", HOLDER, str(hold_gib), str(leave_gib), str(sleep)]
        st.command(
            f"{python} -c '<HOLDER: torch.empty(N, uint8, cuda); print held; sleep>' "
            f"{hold_gib} {leave_gib} {sleep:.0f}"
        )
        self.errfile = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - lives with the holder
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=self.errfile,
            text=True,
            start_new_session=True,
        )
        _LIVE.add(self.proc)
        lines: queue.Queue[str | None] = queue.Queue()

        def read() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        end = time.monotonic() + wait
        while time.monotonic() < end:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                break
            got = holder_split(line.strip())
            if got:
                self.info.update(got)
                return
        self.stop()
        self.errfile.seek(0)
        err = self.errfile.read()
        raise CaseError(
            f"the holder did not report 'held' within {wait:.0f} s: "
            f"{_tail(err, 1500) or 'no output'}"
        )

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        _LIVE.discard(self.proc)
        self.proc = None
        time.sleep(1.0)  # let the driver release the memory before the next probe


def holder_available(python: str) -> str | None:
    """None when `python` has torch with CUDA; else why not."""
    try:
        done = subprocess.run(
            [python, "-c", "import torch; assert torch.cuda.is_available(), 'no CUDA device'"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return error_text(e)
    if done.returncode != 0:
        return (
            _tail(done.stderr, 300).strip().splitlines()[-1]
            if done.stderr.strip()
            else (f"exit {done.returncode}")
        )
    return None
