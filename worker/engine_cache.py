"""The engines one worker process keeps loaded on its device.

Loading a model costs seconds (minutes for big ones), generating with a loaded one a fraction
of that, so engines stay loaded after a job: for `keep_alive` seconds of idleness, forever when
pinned. A new model that does not fit next to them evicts idle engines, least recently used
first; a model that cannot fit even on an emptied device is refused with the figures, so the
job fails with a reason instead of the runtime running out of memory. One load at a time: two
loads at once would each have checked their estimate against the same free memory.

Pure logic: the loader, the clock and the disposer are injected, so every rule is tested
without the runtime (tests/unit/test_engine_cache.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sdfarm.native.devices import format_bytes
from sdfarm.native.errors import ModelTooLargeError


class CacheFullError(ModelTooLargeError):
    """The model's estimate does not fit this device even after evicting every idle engine."""


@dataclass
class _Entry:
    engine: Any
    estimate: int
    pinned: bool
    users: int = 0
    last_used: float = 0.0

    @property
    def busy(self) -> bool:
        return self.users > 0


def _dispose(engine: Any) -> None:
    engine.dispose()


class EngineCache:
    """Loaded engines by model name.

    `capacity_bytes`: what the engines may hold together (the device's figure, capped by the
    worker's --memory-limit). `overflow_bytes`: when the device has a slower path (a GPU whose
    model spills into system memory), a model above the capacity may still load on the
    emptied device up to this many bytes; None means the capacity is a hard limit.
    Thread-safe: the heartbeat reads `snapshot()` while a job loads or runs.
    """

    def __init__(
        self,
        loader: Callable[[str], Any],
        capacity_bytes: int,
        keep_alive: float = 300.0,
        pinned: Iterable[str] = (),
        clock: Callable[[], float] = time.monotonic,
        dispose: Callable[[Any], None] = _dispose,
        overflow_bytes: int | None = None,
    ) -> None:
        self._loader = loader
        self.capacity_bytes = int(capacity_bytes)
        self.overflow_bytes = overflow_bytes
        self.keep_alive = float(keep_alive)
        self.pinned = set(pinned)
        self._clock = clock
        self._dispose = dispose
        self._entries: dict[str, _Entry] = {}
        self._mu = threading.Lock()  # guards _entries and _loading; never held while loading
        self._load_lock = threading.Lock()  # one load at a time
        self._loading: tuple[str, int] | None = None

    # -- queries ---------------------------------------------------------------------------

    def __contains__(self, name: str) -> bool:
        with self._mu:
            e = self._entries.get(name)
            return e is not None and not _poisoned(e.engine)

    @property
    def loading(self) -> str | None:
        """The model being loaded right now, if any."""
        with self._mu:
            return self._loading[0] if self._loading else None

    def held_bytes(self) -> int:
        """The estimates of every loaded engine plus the one being loaded."""
        with self._mu:
            return self._held_locked()

    def snapshot(self) -> list[dict[str, Any]]:
        """One dict per loaded engine (name, estimate, busy, pinned, idle_since, idle_s) for
        heartbeats; idle_since is wall-clock time (None while busy)."""
        now, wall = self._clock(), time.time()
        with self._mu:
            out = []
            for name, e in sorted(self._entries.items()):
                idle = None if e.busy else max(0.0, now - e.last_used)
                out.append(
                    {
                        "name": name,
                        "estimate": e.estimate,
                        "busy": e.busy,
                        "pinned": e.pinned,
                        "idle_since": None if idle is None else round(wall - idle, 3),
                        "idle_s": None if idle is None else round(idle, 3),
                    }
                )
            return out

    # -- use ---------------------------------------------------------------------------------

    def get(self, name: str, estimate: int, need: int | None = None) -> Any:
        """The engine for `name`, loading it when absent (or poisoned). `estimate` is what the
        loaded model holds (the seed's estimate at its native size); `need`, when larger, is
        what this use needs (a large image's working memory). Before a load, idle engines are
        evicted in LRU order until `need` fits; CacheFullError when it cannot. A loaded engine
        is never refused here (the engine checks the image size itself), but idle others are
        evicted to make room for a large `need`. The caller holds the engine until
        `release(name)`."""
        need = max(estimate, need or 0)
        with self._load_lock:
            victims: list[Any] = []
            with self._mu:
                e = self._entries.get(name)
                if e is not None and _poisoned(e.engine):
                    victims.append(self._entries.pop(name).engine)
                    e = None
                if e is not None:
                    e.users += 1
                    e.last_used = self._clock()
                    if need > e.estimate:
                        victims += self._evict_locked(
                            self.capacity_bytes, keep=name, need=need - e.estimate
                        )
                else:
                    victims += self._make_room_locked(name, need)
                    self._loading = (name, estimate)
            for engine in victims:
                self._dispose(engine)
            if e is not None:
                return e.engine
            try:
                engine = self._loader(name)
            finally:
                with self._mu:
                    self._loading = None
            with self._mu:
                self._entries[name] = _Entry(
                    engine, estimate, name in self.pinned, users=1, last_used=self._clock()
                )
            return engine

    def release(self, name: str) -> None:
        """The caller is done with the engine: it becomes idle (and evictable) from now."""
        with self._mu:
            e = self._entries.get(name)
            if e is not None and e.users > 0:
                e.users -= 1
                e.last_used = self._clock()

    def drop(self, name: str) -> bool:
        """Remove and dispose `name` now (a poisoned engine, busy or not); False if absent."""
        with self._mu:
            e = self._entries.pop(name, None)
        if e is None:
            return False
        self._dispose(e.engine)
        return True

    def expire(self) -> list[str]:
        """Dispose engines idle for longer than keep_alive (never pinned or busy ones) and
        poisoned idle ones; returns their names."""
        now = self._clock()
        with self._mu:
            names = [
                n
                for n, e in self._entries.items()
                if not e.busy
                and (_poisoned(e.engine) or (not e.pinned and now - e.last_used > self.keep_alive))
            ]
            gone = [self._entries.pop(n).engine for n in names]
        for engine in gone:
            self._dispose(engine)
        return names

    def clear(self) -> None:
        """Dispose every engine (process shutdown)."""
        with self._mu:
            gone = [e.engine for e in self._entries.values()]
            self._entries.clear()
        for engine in gone:
            self._dispose(engine)

    # -- eviction ------------------------------------------------------------------------------

    def _held_locked(self) -> int:
        held = sum(e.estimate for e in self._entries.values())
        return held + (self._loading[1] if self._loading else 0)

    def _evict_locked(self, limit: int, keep: str | None = None, need: int = 0) -> list[Any]:
        """Pop idle, unpinned engines, least recently used first, until held + need <= limit;
        returns the popped engines (disposed by the caller outside the lock)."""
        popped = []
        idle = sorted(
            (e.last_used, n)
            for n, e in self._entries.items()
            if not e.busy and not e.pinned and n != keep
        )
        for _, n in idle:
            if self._held_locked() + need <= limit:
                break
            popped.append(self._entries.pop(n).engine)
        return popped

    def _make_room_locked(self, name: str, estimate: int) -> list[Any]:
        """Evict for a new load of `estimate` bytes, or raise CacheFullError without evicting
        anything when even the emptied device (busy and pinned engines stay) is too small."""
        held = sum(e.estimate for e in self._entries.values())
        stuck = sum(e.estimate for e in self._entries.values() if e.busy or e.pinned)
        if stuck + estimate <= self.capacity_bytes:
            return self._evict_locked(self.capacity_bytes, need=estimate)
        limit = self.overflow_bytes
        if limit is not None and stuck + estimate <= limit:
            # The slower path: give the big model the whole device, spilling to system memory.
            return self._evict_locked(0, need=estimate)
        kept = [
            f"{n} {format_bytes(e.estimate)} ({'busy' if e.busy else 'pinned'})"
            for n, e in sorted(self._entries.items())
            if e.busy or e.pinned
        ]
        figures: dict[str, int | None] = {
            "estimate": estimate,
            "capacity": self.capacity_bytes,
            "held": held,
            "held_busy_or_pinned": stuck,
        }
        if limit is not None:
            figures["overflow"] = limit
        where = f"this device's capacity {format_bytes(self.capacity_bytes)}"
        if limit is not None:
            where += f" (or {format_bytes(limit)} with system memory)"
        raise CacheFullError(
            f"model {name!r} needs an estimated {format_bytes(estimate)}, more than {where}"
            + (f" next to engines that cannot be evicted: {', '.join(kept)}" if kept else "")
            + "; use a smaller or quantized model, or a device with more memory",
            estimate,
            figures,
        )


def _poisoned(engine: Any) -> bool:
    return bool(getattr(engine, "poisoned", None))
