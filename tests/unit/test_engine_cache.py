"""EngineCache rules with a fake loader, clock and disposer (pure logic, no runtime)."""

from __future__ import annotations

import threading
import time

import pytest

from sdfarm.native.errors import ModelTooLargeError
from sdfarm.worker.engine_cache import CacheFullError, EngineCache

GB = 1 << 30


class FakeEngine:
    def __init__(self, name: str) -> None:
        self.name = name
        self.poisoned: str | None = None
        self.disposed = False


class Harness:
    """A cache plus a record of what was loaded and disposed, on a hand-driven clock."""

    def __init__(self, capacity: int = 10 * GB, **kw: object) -> None:
        self.now = 1000.0
        self.loads: list[str] = []
        self.disposed: list[str] = []
        self.cache = EngineCache(
            self.load,
            capacity,
            clock=lambda: self.now,
            dispose=self.dispose,
            **kw,  # type: ignore[arg-type]
        )

    def load(self, name: str) -> FakeEngine:
        self.loads.append(name)
        return FakeEngine(name)

    def dispose(self, engine: FakeEngine) -> None:
        engine.disposed = True
        self.disposed.append(engine.name)

    def use(self, name: str, estimate: int) -> FakeEngine:
        engine = self.cache.get(name, estimate)
        self.cache.release(name)
        self.now += 1
        return engine

    def names(self) -> list[str]:
        return [e["name"] for e in self.cache.snapshot()]


def test_second_get_reuses_the_loaded_engine() -> None:
    h = Harness()
    a = h.use("a", 2 * GB)
    assert h.use("a", 2 * GB) is a
    assert h.loads == ["a"]
    assert "a" in h.cache


def test_evicts_idle_engines_least_recently_used_first() -> None:
    h = Harness(capacity=10 * GB)
    h.use("a", 4 * GB)
    h.use("b", 4 * GB)
    h.use("a", 4 * GB)  # a is now the most recently used
    h.use("c", 4 * GB)  # 12 > 10: evict one idle engine, the LRU one (b)
    assert h.disposed == ["b"]
    assert h.names() == ["a", "c"]


def test_evicts_only_as_many_as_needed() -> None:
    h = Harness(capacity=10 * GB)
    for n in ("a", "b", "c"):
        h.use(n, 3 * GB)
    h.use("d", 4 * GB)  # 13 > 10: evicting a (LRU) leaves 10: enough
    assert h.disposed == ["a"]


def test_busy_and_pinned_engines_are_never_evicted() -> None:
    h = Harness(capacity=10 * GB, pinned={"p"})
    h.use("p", 4 * GB)
    h.cache.get("busy", 4 * GB)  # not released
    with pytest.raises(CacheFullError) as err:
        h.cache.get("new", 4 * GB)
    assert h.disposed == []  # a refusal evicts nothing
    msg = str(err.value)
    assert "'new'" in msg and "p 4.00 GiB (pinned)" in msg and "busy 4.00 GiB (busy)" in msg
    assert err.value.estimate == 4 * GB
    assert err.value.figures["capacity"] == 10 * GB
    h.cache.release("busy")
    h.cache.get("new", 4 * GB)
    assert h.disposed == ["busy"]


def test_refuses_a_model_that_cannot_fit_even_empty() -> None:
    h = Harness(capacity=8 * GB)
    h.use("a", 2 * GB)
    with pytest.raises(ModelTooLargeError, match=r"'huge' needs an estimated 9.00 GiB"):
        h.cache.get("huge", 9 * GB)
    assert h.loads == ["a"] and h.disposed == []


def test_overflow_lets_a_big_model_load_alone_on_the_slow_path() -> None:
    h = Harness(capacity=8 * GB, overflow_bytes=20 * GB)
    h.use("a", 2 * GB)
    h.use("b", 2 * GB)
    h.use("big", 12 * GB)  # above the GPU, within GPU + system memory: loads alone
    assert sorted(h.disposed) == ["a", "b"]
    with pytest.raises(CacheFullError, match="with system memory"):
        h.cache.get("bigger", 21 * GB)


def test_expire_disposes_idle_engines_after_keep_alive_but_never_pinned() -> None:
    h = Harness(keep_alive=300, pinned={"p"})
    h.use("a", GB)
    h.use("p", GB)
    h.cache.get("busy", GB)
    h.now += 297  # a has been idle 299 s (released at 1000, now 1299)
    assert h.cache.expire() == []
    h.now += 2
    assert h.cache.expire() == ["a"]
    h.now += 10_000
    assert h.cache.expire() == []
    assert h.names() == ["busy", "p"]
    h.cache.release("busy")
    h.now += 301
    assert h.cache.expire() == ["busy"]


def test_poisoned_engine_is_dropped_and_reloaded_on_next_get() -> None:
    h = Harness()
    a = h.use("a", GB)
    a.poisoned = "device lost"
    assert "a" not in h.cache
    b = h.use("a", GB)
    assert b is not a and a.disposed
    assert h.loads == ["a", "a"]


def test_drop_disposes_at_once() -> None:
    h = Harness()
    h.cache.get("a", GB)
    assert h.cache.drop("a") is True
    assert h.disposed == ["a"] and h.names() == []
    assert h.cache.drop("a") is False
    h.cache.release("a")  # releasing a dropped engine is harmless


def test_failed_load_leaves_nothing_behind() -> None:
    def broken(name: str) -> FakeEngine:
        raise RuntimeError("no such file")

    cache = EngineCache(broken, 10 * GB)
    with pytest.raises(RuntimeError):
        cache.get("a", GB)
    assert cache.snapshot() == [] and cache.loading is None and cache.held_bytes() == 0


def test_snapshot_reports_busy_idle_and_pinned() -> None:
    h = Harness(pinned={"p"})
    h.use("p", 2 * GB)
    h.cache.get("a", 3 * GB)
    h.now += 5
    snap = {e["name"]: e for e in h.cache.snapshot()}
    assert snap["a"]["busy"] is True and snap["a"]["idle_since"] is None
    assert snap["p"] == {
        "name": "p",
        "estimate": 2 * GB,
        "busy": False,
        "pinned": True,
        "idle_since": pytest.approx(time.time() - 6, abs=1),
        "idle_s": 6.0,
    }
    assert h.cache.held_bytes() == 5 * GB


def test_a_large_image_evicts_idle_others_but_keeps_the_held_estimate() -> None:
    h = Harness(capacity=10 * GB)
    h.use("a", 4 * GB)
    h.use("b", 4 * GB)
    h.cache.get("b", 4 * GB, need=8 * GB)  # b is loaded; a big image needs room: a goes
    assert h.disposed == ["a"]
    assert h.cache.snapshot()[0]["estimate"] == 4 * GB  # what b holds once the job ends
    h.cache.release("b")
    h.cache.get("b", 4 * GB, need=50 * GB)  # never refused here: the engine checks sizes
    h.cache.release("b")
    with pytest.raises(CacheFullError, match="needs an estimated 12.00 GiB"):
        h.cache.get("c", 2 * GB, need=12 * GB)  # a new load is refused at its need
    assert h.loads == ["a", "b"]


def test_one_load_at_a_time_and_snapshot_does_not_wait_for_it() -> None:
    started, release = threading.Event(), threading.Event()
    active, peak = [0], [0]
    lock = threading.Lock()

    def slow(name: str) -> FakeEngine:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        started.set()
        release.wait(5)
        with lock:
            active[0] -= 1
        return FakeEngine(name)

    cache = EngineCache(slow, 10 * GB)
    threads = [threading.Thread(target=cache.get, args=(n, GB)) for n in ("a", "b")]
    for t in threads:
        t.start()
    assert started.wait(5)
    assert cache.loading in ("a", "b")
    assert cache.held_bytes() == GB  # the load in flight counts
    assert cache.snapshot() == []  # answered while the loader runs
    release.set()
    for t in threads:
        t.join(5)
    assert peak[0] == 1
    assert sorted(e["name"] for e in cache.snapshot()) == ["a", "b"]


# -- get_loaded: the worker's lookahead takes only an engine already loaded -----------------


def test_get_loaded_holds_a_loaded_engine_and_never_loads_nor_evicts() -> None:
    h = Harness(capacity=10 * GB)
    a = h.cache.get("a", 4 * GB)  # the running job's engine (busy)
    h.use("b", 4 * GB)  # idle beside it
    assert h.cache.get_loaded("c") is None and h.loads == ["a", "b"]  # not loaded: no load
    ahead = h.cache.get_loaded("a", 5 * GB)  # a larger image: 4 + 4 + 1 <= 10 fits as it is
    assert ahead is a and h.cache.holds("a", a)
    h.cache.release("a")
    assert h.cache.snapshot()[0]["busy"]  # still held by the running job
    assert h.cache.get_loaded("a", 7 * GB) is None  # 4 + 4 + 3 > 10: get would evict b
    assert h.disposed == []


def test_holds_is_false_once_the_engine_was_dropped_poisoned_or_replaced() -> None:
    h = Harness()
    a = h.use("a", 2 * GB)
    assert h.cache.holds("a", a) and not h.cache.holds("b", a)
    a.poisoned = "a CUDA error"
    assert not h.cache.holds("a", a) and h.cache.get_loaded("a") is None
    h.cache.drop("a")
    again = h.use("a", 2 * GB)
    assert again is not a and not h.cache.holds("a", a) and h.cache.holds("a", again)
