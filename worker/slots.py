"""Several engine slots on one device (`sdfarm worker --engines N`): what the pool processes
share.

With N > 1 the worker's Celery prefork pool has N processes consuming the device's one queue,
each with its own engine cache, so N jobs run at once (the runtime keeps one process-wide
lock, so engines in one process would run one at a time; N processes is what the H200 curve
in docs/gpu.md measured). The device's figure stays one figure: every engine any slot holds
and every load in progress counts against it. The slots share that through a `SlotBoard`, a
folder the parent creates before the fork:

- `slot-{i}.json`, one per slot, rewritten atomically whenever its cache changes and every
  heartbeat: its pid, incarnation, state, running job and engines (with estimates, busy,
  idle_since). A file whose process is gone (killed, a zombie) is ignored.
- `load.lock`: an flock held across every load on the device (at most one load at a time per
  device, as with one process; a killed holder releases it with its process).
- `evict-{i}.json`: engines another slot asked slot i to dispose (idle ones only), so a load
  can evict least recently used idle engines across slots.
- `stopping`: the worker is shutting down; no slot writes the device's heartbeat again.

One heartbeat per device: the live slot with the lowest index writes it, made of every live
slot's file (its `incarnation` is the worker's, made once in the parent, so a slot that is
replaced is not a restart of the device; `incarnations` lists the live slots', which is what
the scheduler checks a running job's claim against).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ENGINES_ENV = "SDFARM_ENGINES"

GPU_ENGINES = 2
"""`--engines auto` on a GPU, from the H200 curve (bench/engines_per_gpu.py, SD-Turbo
architecture at 512x512, 1 step, N separate processes each with its own engine;
bench/results/gpu/cuda-engines-per-gpu-512.json): N=1 8.52 img/s, N=2 9.58 (+12%), N=4 9.88
(+3% more, for twice the engines' memory), N=8 9.88. Two engines take most of the gain; past
that each engine costs its full estimate (6.04 GiB accounted each there) for almost nothing."""

MPS_ENGINES = 8
"""`--engines auto` on a CUDA GPU served by MPS (sdfarm.native.mps), from the farm on the H200
under MPS (bench/farm_engines.py, SD-Turbo architecture). With the runtime as it first was
(`bash bench/gpu_run.sh peertwo|peerthree`), 512x512 1 step N=1/2/4/8 made 7.20/10.92/12.37/
12.71 images/s: four took 94-97% of what eight made. With our CUDA patches and cuDNN's
convolutions and attention (`sdpapeer`, `sdpatable`: docs/gpu.md's lead table) eight make
6-25% more than four at every case measured: 37.03 against 29.62 images/s at 512 x 1 step,
16.20 / 14.81 at 512 x 4, 10.29-10.50 / 9.58 at 1024 x 1, 4.95-4.98 / 4.69 at 1024 x 4, for
38.8 GiB of engines accounted against 19.4 (of 139). With the transformer's linear layers and
layer norms fused too (lease I, `fusemore`), N = 1/2/4/8 at 1024 x 4 steps made 3.09/4.63/
5.77/5.88-5.96: eight still the best, by 2-3%; twelve made +1% at 512 x 4 steps and +5% at
512 x 1 step for half again the memory (lease J, `moreengines`). `auto_engines` lowers it
where fewer fit the device."""


def slot_index() -> int:
    """This pool process's index (billiard keeps it when it replaces a process), 0 outside a
    pool."""
    try:
        from billiard.process import current_process

        index = getattr(current_process(), "index", None)
        return int(index) if index is not None else 0
    except Exception:  # noqa: BLE001 - not in a pool
        return 0


def auto_engines(device_type: str, capacity: int, largest_estimate: int, mps: bool = False) -> int:
    """`--engines auto`: 1 on the CPU: one engine's threads already use every core, so a
    second engine only splits them (an integrated GPU too: nothing measured it). On a
    discrete GPU, GPU_ENGINES (2): on the H200 one engine made
    8.52 img/s (SD-Turbo architecture, 512x512, 1 step), two 9.58 (+12%),
    four 9.88 (+3% more for twice the memory), eight no more. Reduced so that that many
    engines of the largest listed model (`largest_estimate`, its resident estimate) fit the
    device's figure (`capacity`): the scheduler counts every engine at its estimate, and an
    engine that cannot fit beside the others would only make jobs wait. With `mps` (a CUDA
    GPU whose processes are MPS clients: kernels of different engines run at once)
    MPS_ENGINES (8) instead. At least 1."""
    if device_type not in ("gpu", "accel"):
        return 1  # the CPU, and an integrated GPU (its memory and power are the host's)
    n = MPS_ENGINES if mps else GPU_ENGINES
    if largest_estimate > 0:
        n = min(n, capacity // largest_estimate)
    return max(1, n)


def parse_engines(text: str | None) -> int | str:
    """ "auto" or a count from 1 to 64 (argparse's type)."""
    import argparse

    value = (text or "1").strip().lower()
    if value == "auto":
        return "auto"
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a count or auto: {text!r}") from None
    if not 1 <= n <= 64:
        raise argparse.ArgumentTypeError(f"--engines must be 1..64 or auto, got {n}")
    return n


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


class SlotBoard:
    """The folder the slots of one worker share (see the module docstring)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    @classmethod
    def create(cls) -> SlotBoard:
        """A fresh folder, made in the parent before the pool forks."""
        return cls(tempfile.mkdtemp(prefix="sdfarm-slots-"))

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    # -- the slots' files --------------------------------------------------------------------

    def write(self, slot: int, doc: dict[str, Any]) -> None:
        """Replace slot `slot`'s file atomically (readers see the old or the new one)."""
        path = self.root / f"slot-{slot}.json"
        tmp = self.root / f".slot-{slot}.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)

    def live(self) -> dict[int, dict[str, Any]]:
        """{slot: its document} for every slot whose process is alive."""
        out = {}
        for path in self.root.glob("slot-*.json"):
            try:
                doc = json.loads(path.read_text())
                slot = int(path.stem.split("-", 1)[1])
            except (OSError, ValueError):
                continue
            if isinstance(doc, dict) and _alive(int(doc.get("pid") or 0)):
                out[slot] = doc
        return out

    def others(self, slot: int) -> dict[int, dict[str, Any]]:
        return {i: d for i, d in self.live().items() if i != slot}

    def leader(self) -> int | None:
        """The slot that writes the device's heartbeat: the lowest live index."""
        live = self.live()
        return min(live) if live else None

    # -- loads and evictions -----------------------------------------------------------------

    @contextlib.contextmanager
    def load_lock(self) -> Iterator[None]:
        """The device's load lock (flock: a killed holder releases it)."""
        fd = os.open(self.root / "load.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def ask_evict(self, slot: int, names: list[str]) -> None:
        """Ask slot `slot` to dispose these engines if they are idle."""
        path = self.root / f"evict-{slot}.json"
        with self._locked(f"evict-{slot}.lock"):
            try:
                asked = set(json.loads(path.read_text()))
            except (OSError, ValueError):
                asked = set()
            tmp = self.root / f".evict-{slot}.{os.getpid()}.{threading.get_ident()}.tmp"
            tmp.write_text(json.dumps(sorted(asked | set(names))))
            os.replace(tmp, path)

    def take_evictions(self, slot: int) -> list[str]:
        """The engines other slots asked this one to dispose (the request is consumed)."""
        path = self.root / f"evict-{slot}.json"
        if not path.exists():
            return []
        with self._locked(f"evict-{slot}.lock"):
            try:
                names = json.loads(path.read_text())
            except (OSError, ValueError):
                names = []
            with contextlib.suppress(OSError):
                path.unlink()
        return [str(n) for n in names] if isinstance(names, list) else []

    @contextlib.contextmanager
    def _locked(self, name: str) -> Iterator[None]:
        fd = os.open(self.root / name, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    # -- shutdown ----------------------------------------------------------------------------

    def mark_stopping(self) -> None:
        with contextlib.suppress(OSError):
            (self.root / "stopping").touch()

    @property
    def stopping(self) -> bool:
        return (self.root / "stopping").exists()


class Peers:
    """What one slot's engine cache sees of the other slots (`EngineCache(peers=...)`)."""

    def __init__(self, board: SlotBoard, slot: int, wait_s: float = 30.0) -> None:
        self.board = board
        self.slot = slot
        self.wait_s = wait_s

    def load_lock(self) -> contextlib.AbstractContextManager[None]:
        return self.board.load_lock()

    def engines(self) -> list[tuple[int, dict[str, Any]]]:
        """(slot, engine) for every engine another live slot holds or is loading; a load in
        progress is an engine entry with busy true."""
        out = []
        for slot, doc in self.board.others(self.slot).items():
            for e in doc.get("loaded") or []:
                out.append((slot, e))
            loading = doc.get("loading_estimate")
            if doc.get("loading") and loading:
                out.append((slot, {"name": doc["loading"], "estimate": loading, "busy": True}))
        return out

    def ask_evict(self, slot: int, names: list[str]) -> None:
        self.board.ask_evict(slot, names)

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)
