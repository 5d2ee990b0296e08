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

PEER_POLL_S = 0.05


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
        peers: Any = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self._loader = loader
        # The other engine slots on this device (sdfarm.worker.slots.Peers) with N > 1: their
        # engines count against the same capacity, a load takes the device's load lock and
        # may ask them to evict idle engines. None: this cache is alone on its device.
        self.peers = peers
        self.on_change = on_change
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

    @property
    def loading_estimate(self) -> int:
        """The estimate of the load in progress (0 when none)."""
        with self._mu:
            return self._loading[1] if self._loading else 0

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
            if self.peers is None:
                return self._get_locked(name, estimate, need)
            with self._mu:
                e = self._entries.get(name)
                if e is not None and not _poisoned(e.engine) and need <= e.estimate:
                    e.users += 1
                    e.last_used = self._clock()
                    hit = e.engine
                else:
                    hit = None
            if hit is not None:
                self._notify()
                return hit
            with self.peers.load_lock():
                return self._get_shared(name, estimate, need)

    def _get_locked(self, name: str, estimate: int, need: int) -> Any:
        """`get` for a cache alone on its device (the load lock held)."""
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
        return self._load_entry(name, estimate)

    def _load_entry(self, name: str, estimate: int) -> Any:
        """Load `name` (its `_loading` mark set by the caller, cleared here whatever happens)
        and hold it as an entry in use by one job."""
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

    def _get_shared(self, name: str, estimate: int, need: int) -> Any:
        """`get` beside other slots (the device's load lock and this cache's held): make room
        across every slot's engines, then load (or use the loaded engine at a larger size)."""
        victims: list[Any] = []
        with self._mu:
            e = self._entries.get(name)
            if e is not None and _poisoned(e.engine):
                victims.append(self._entries.pop(name).engine)
                e = None
            if e is not None:
                e.users += 1  # busy from now: never evicted for its own room
                e.last_used = self._clock()
        for engine in victims:
            self._dispose(engine)
        try:
            extra = need - e.estimate if e is not None else need
            self._room_across_slots(name, max(0, extra))
        except BaseException:
            if e is not None:
                self.release(name)
            raise
        if e is not None:
            self._notify()
            return e.engine
        with self._mu:
            self._loading = (name, estimate)
        self._notify()
        engine = self._load_entry(name, estimate)
        self._notify()
        return engine

    def _room_across_slots(self, name: str, extra: int) -> None:
        """Until `extra` more bytes fit the capacity next to every engine of every slot:
        evict idle, unpinned engines least recently used first, this slot's at once, other
        slots' by asking them (and waiting for their files to say so). Busy engines of other
        slots may end within the wait; CacheFullError when it runs out, or at once when even
        every slot's busy and pinned engines leave no room and none of them is busy."""
        peers = self.peers
        deadline = time.monotonic() + peers.wait_s
        rounds = 0
        while True:
            others = peers.engines()
            now, wall = self._clock(), time.time()
            with self._mu:
                own = [
                    (e.busy or e.pinned, wall - max(0.0, now - e.last_used), -1, n, e.estimate)
                    for n, e in self._entries.items()
                ]
            theirs = [
                (bool(o.get("busy") or o.get("pinned")), float(o.get("idle_since") or 0.0),
                 slot, str(o.get("name")), int(o.get("estimate") or 0))
                for slot, o in others
            ]  # fmt: skip
            everything = own + theirs
            held = sum(x[4] for x in everything)
            stuck = sum(x[4] for x in everything if x[0])
            if held + extra <= self.capacity_bytes:
                return
            limit = self.capacity_bytes
            if self.overflow_bytes is not None and not theirs:
                limit = max(limit, self.overflow_bytes)
            if held + extra <= limit:
                return
            if stuck + extra > limit:
                others_busy = any(o.get("busy") for _, o in others)
                if others_busy and time.monotonic() < deadline:
                    peers.sleep(PEER_POLL_S * 4)
                    continue
                with self._mu:
                    self._raise_full(name, extra, held, stuck, limit)
            over = held + extra - limit
            mine: list[str] = []
            asked: dict[int, list[str]] = {}
            for _, _, slot, n, est in sorted(x for x in everything if not x[0]):
                if over <= 0:
                    break
                if slot < 0:
                    mine.append(n)
                else:
                    asked.setdefault(slot, []).append(n)
                over -= est
            gone = []
            with self._mu:
                for n in mine:
                    e = self._entries.get(n)
                    if e is not None and not e.busy and not e.pinned:
                        gone.append(self._entries.pop(n).engine)
            for engine in gone:
                self._dispose(engine)
            if gone:
                self._notify()
            if not gone and not asked:  # nothing could go after all: never spin hot
                if time.monotonic() >= deadline:
                    with self._mu:
                        self._raise_full(name, extra, held, stuck, limit)
                peers.sleep(PEER_POLL_S)
            if asked:
                if rounds and time.monotonic() >= deadline:
                    with self._mu:
                        self._raise_full(name, extra, held, stuck, limit)
                for slot, names in asked.items():
                    peers.ask_evict(slot, names)
                rounds += 1
                peers.sleep(PEER_POLL_S)

    def evict_requested(self, names: list[str]) -> list[str]:
        """Another slot asked for these engines' memory: dispose those that are idle and not
        pinned; returns their names."""
        with self._mu:
            gone = [
                (n, self._entries.pop(n).engine)
                for n in names
                if n in self._entries and not self._entries[n].busy and not self._entries[n].pinned
            ]
        for _, engine in gone:
            self._dispose(engine)
        if gone:
            self._notify()
        return [n for n, _ in gone]

    def _raise_full(self, name: str, estimate: int, held: int, stuck: int, limit: int) -> None:
        """CacheFullError as `_make_room_locked` words it, counting every slot's engines."""
        where = f"this device's capacity {format_bytes(self.capacity_bytes)}"
        if limit > self.capacity_bytes:
            where += f" (or {format_bytes(limit)} with system memory)"
        raise CacheFullError(
            f"model {name!r} needs an estimated {format_bytes(estimate)}, more than {where} "
            f"next to the engines this device's slots cannot evict "
            f"({format_bytes(stuck)} busy or pinned); use a smaller or quantized model, fewer "
            "--engines, or a device with more memory",
            estimate,
            {"estimate": estimate, "capacity": self.capacity_bytes, "held": held,
             "held_busy_or_pinned": stuck},
        )  # fmt: skip

    def _notify(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def get_loaded(self, name: str, need: int = 0) -> Any:
        """The engine for `name` when it is loaded and usable and `need` (this use's working
        memory) fits beside every held engine, held as `get` holds it (the caller releases
        it); None otherwise. Never loads nor evicts, as `get` would: the worker's lookahead
        (sdfarm.worker.chain) prepares the next job with it while the current one runs, and
        must not start a load beside a running generation."""
        with self._mu:
            e = self._entries.get(name)
            if e is None or _poisoned(e.engine):
                return None
            if self._held_locked() + max(0, need - e.estimate) > self.capacity_bytes:
                return None
            e.users += 1
            e.last_used = self._clock()
            engine = e.engine
        self._notify()
        return engine

    def holds(self, name: str, engine: Any) -> bool:
        """Whether `engine` is still the usable engine loaded under `name` (it was not dropped,
        poisoned or replaced since it was taken)."""
        with self._mu:
            e = self._entries.get(name)
            return e is not None and e.engine is engine and not _poisoned(engine)

    def release(self, name: str) -> None:
        """The caller is done with the engine: it becomes idle (and evictable) from now."""
        with self._mu:
            e = self._entries.get(name)
            if e is not None and e.users > 0:
                e.users -= 1
                e.last_used = self._clock()
        self._notify()

    def drop(self, name: str) -> bool:
        """Remove and dispose `name` now (a poisoned engine, busy or not); False if absent."""
        with self._mu:
            e = self._entries.pop(name, None)
        if e is None:
            return False
        self._dispose(e.engine)
        self._notify()
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
        if names:
            self._notify()
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
