"""Several engine slots on one device (`sdfarm worker --engines N`), pure logic: placement and
the scheduler's accounting of N slots sharing one figure, the engine cache beside other slots,
the slots' shared folder, and `--engines auto`."""

from __future__ import annotations

import os
import subprocess
from dataclasses import replace
from typing import Any

import pytest

from sdfarm.scheduler.index import DeviceIndex
from sdfarm.scheduler.placement import (
    DeviceState,
    GiB,
    JobRequest,
    LoadedModel,
    Placed,
    Wait,
    held_engine,
    place,
)
from sdfarm.scheduler.registry import account, account_sent, build_devices, device_state
from sdfarm.worker.engine_cache import CacheFullError, EngineCache
from sdfarm.worker.slots import (
    GPU_ENGINES,
    MPS_ENGINES,
    Peers,
    SlotBoard,
    auto_engines,
    parse_engines,
)

NOW = 10_000.0


def eng(name: str, gib: float, *, busy: bool = False, idle: float = 0.0) -> LoadedModel:
    return LoadedModel(name, int(gib * GiB), busy=busy, idle_since=idle)


def device(
    capacity: float, loaded: tuple[LoadedModel, ...] = (), *, slots: int = 2, queued: int = 0,
    backlog: int = 2,
) -> DeviceState:  # fmt: skip
    """A GPU of `capacity` GiB whose figure is what its engines leave; the registry's
    backlog for N slots (backlog + N - 1)."""
    cap = int(capacity * GiB)
    compute = max(0, cap - sum(m.estimate for m in loaded))
    return DeviceState(
        host="h", device="gpu0", type="gpu", compute_figure=compute, slow_figure=compute,
        capacity=cap, loaded=loaded, queued=queued, backlog_limit=backlog + slots - 1,
        slots=slots,
    )  # fmt: skip


def job(model: str, gib: float) -> JobRequest:
    return JobRequest(model, int(gib * GiB))


def run(d: DeviceState, jobs: list[JobRequest]) -> tuple[list[str], DeviceState]:
    """Place `jobs` in turn on the one device as the dispatcher does in a pass (each placed
    job accounted before the next); each outcome as its tier or "wait"."""
    out = []
    for j in jobs:
        outcome = place(j, [d], NOW)
        assert outcome == DeviceIndex([d]).place(j, NOW) or isinstance(outcome, Wait)
        if isinstance(outcome, Placed):
            d = account(d, j.model, j.estimate, outcome.evict)
            out.append(outcome.tier)
        else:
            assert isinstance(outcome, Wait)
            out.append("wait")
    return out, d


# (device, jobs, outcomes, GiB left in the figure afterwards)
SCENARIOS = [
    pytest.param(
        device(24, (eng("a", 6),)),
        [job("a", 6), job("a", 6), job("a", 6), job("a", 6)],
        ["loaded", "fits", "fits", "wait"],
        6,
        id="n2-same-model-each-job-an-engine-then-backlog-full",
    ),
    pytest.param(
        device(12, (eng("a", 6),)),
        [job("a", 6), job("a", 6), job("a", 6)],
        ["loaded", "fits", "wait"],
        0,
        id="n2-room-for-two-engines-the-third-waits",
    ),
    pytest.param(
        device(10, (eng("a", 6),)),
        [job("a", 6), job("a", 6)],
        ["loaded", "wait"],
        4,
        id="n2-second-engine-does-not-fit-beside-the-running-one",
    ),
    pytest.param(
        device(10, (eng("a", 6),), slots=1),
        [job("a", 6), job("a", 6), job("a", 6)],
        ["loaded", "loaded", "wait"],
        4,
        id="n1-unchanged-jobs-queue-on-the-one-engine",
    ),
    pytest.param(
        device(12, (eng("a", 6, busy=True),)),
        [job("b", 5), job("c", 2)],
        ["fits", "wait"],
        1,
        id="n2-another-model-placed-only-when-both-fit",
    ),
    pytest.param(
        device(10, (eng("a", 6, busy=True),)),
        [job("b", 5)],
        ["wait"],
        4,
        id="n2-another-model-that-does-not-fit-beside-the-running-one-waits",
    ),
    pytest.param(
        device(10, (eng("a", 6, busy=True), eng("b", 3))),
        [job("c", 4)],
        ["fits-evicting"],
        0,
        id="n2-an-idle-engine-is-evicted-never-the-busy-one",
    ),
    pytest.param(
        device(40, (), slots=4, backlog=1),
        [job("a", 6)] * 5,
        ["fits", "fits", "fits", "fits", "wait"],
        16,
        id="n4-backlog-1-four-run-at-once-none-waits-on-the-device",
    ),
    pytest.param(
        device(40, (), slots=2, backlog=2),
        [job("a", 6), job("b", 6), job("a", 6), job("b", 6)],
        ["fits", "fits", "fits", "wait"],
        22,
        id="n2-two-models-two-running-one-in-the-backlog",
    ),
]


@pytest.mark.parametrize(("d", "jobs", "want", "left"), SCENARIOS)
def test_slots_share_one_figure(d: DeviceState, jobs: list, want: list, left: float) -> None:
    got, after = run(d, jobs)
    assert got == want
    assert after.compute_figure == int(left * GiB)
    # Never more engines busy than the figure can hold.
    assert sum(m.estimate for m in after.loaded) <= after.capacity


def test_the_heartbeats_slots_make_the_backlog_and_the_slots() -> None:
    hb = {"type": "gpu", "compute_figure": 10 * GiB, "capacity": 10 * GiB, "slots": 3}
    d = device_state("h/gpu0", hb, backlog_limit=2)
    assert (d.slots, d.backlog_limit) == (3, 4)
    old = device_state("h/gpu0", {k: v for k, v in hb.items() if k != "slots"}, backlog_limit=2)
    assert (old.slots, old.backlog_limit) == (1, 2)


def test_account_sent_counts_an_engine_per_job_beyond_the_busy_ones() -> None:
    # Slot 0 runs a job of "a" (busy), slot 1 holds an idle "a". Sent: that running job and
    # two placed ones of "a": the first takes the idle engine, the second a new one.
    d = device(24, (eng("a", 6, busy=True), eng("a", 6)))
    after = account_sent(d, [("a", 6 * GiB)] * 3)
    assert after.compute_figure == 6 * GiB
    assert [m.busy for m in after.loaded] == [True, True, True]
    # One slot: every job of a loaded model runs on it, nothing more is taken.
    one = replace(d, slots=1)
    assert account_sent(one, [("a", 6 * GiB)] * 3).compute_figure == one.compute_figure


def test_build_devices_accounts_running_and_placed_jobs_per_slot() -> None:
    hb = {
        "type": "gpu", "compute_figure": 12 * GiB, "capacity": 18 * GiB, "slots": 2,
        "loaded": [{"name": "a", "estimate": 6 * GiB, "busy": True, "slot": 0}],
    }  # fmt: skip
    jobs = {
        "j1": {"model": "a", "state": "running", "estimate": str(6 * GiB)},
        "j2": {"model": "a", "state": "placed", "estimate": str(6 * GiB)},
    }
    (d,) = build_devices({"h/gpu0": hb}, [], {"h/gpu0": {"j1": "d1", "j2": "d2"}}, jobs)
    assert d.compute_figure == 6 * GiB and d.queued == 2 and d.backlog_limit == 3
    assert held_engine(d, "a") is None  # both engines busy: a third job needs its own
    assert place(job("a", 6), [d], NOW) == Placed("h/gpu0", "fits")
    assert isinstance(place(job("a", 7), [d], NOW), Wait)


# -- the engine cache beside other slots ---------------------------------------------------


class FakePeers:
    """Other slots as their files would say, evicting when asked (if idle)."""

    def __init__(self, engines: list[tuple[int, dict]], wait_s: float = 0.0) -> None:
        self.others = engines
        self.wait_s = wait_s
        self.asked: list[tuple[int, list[str]]] = []
        self.locks = 0

    def load_lock(self):  # noqa: ANN201
        import contextlib

        self.locks += 1
        return contextlib.nullcontext()

    def engines(self) -> list[tuple[int, dict]]:
        return list(self.others)

    def ask_evict(self, slot: int, names: list[str]) -> None:
        self.asked.append((slot, names))
        self.others = [
            (s, e)
            for s, e in self.others
            if not (s == slot and e["name"] in names and not e["busy"])
        ]

    def sleep(self, seconds: float) -> None:
        pass


def cache(capacity: float, peers: FakePeers, loaded: list[str] | None = None) -> EngineCache:
    loaded = loaded if loaded is not None else []
    return EngineCache(lambda n: loaded.append(n) or n, int(capacity * GiB), peers=peers,
                       dispose=lambda e: None)  # fmt: skip


def test_a_load_asks_another_slot_to_evict_its_least_recently_used_idle_engine() -> None:
    peers = FakePeers([
        (1, {"name": "old", "estimate": 4 * GiB, "busy": False, "idle_since": 10.0}),
        (1, {"name": "new", "estimate": 4 * GiB, "busy": False, "idle_since": 20.0}),
        (2, {"name": "run", "estimate": 4 * GiB, "busy": True}),
    ])  # fmt: skip
    c = cache(15, peers)
    assert c.get("x", 4 * GiB) == "x"
    assert peers.asked == [(1, ["old"])]
    assert peers.locks == 1
    c.release("x")
    assert c.get("x", 4 * GiB) == "x" and peers.locks == 1  # a hit takes no device lock


def test_a_load_that_cannot_fit_beside_other_slots_busy_engines_is_refused() -> None:
    peers = FakePeers([(1, {"name": "run", "estimate": 8 * GiB, "busy": True})])
    loaded: list[str] = []
    with pytest.raises(CacheFullError, match="busy or pinned"):
        cache(10, peers, loaded).get("x", 4 * GiB)
    assert loaded == []


def test_own_idle_engines_count_and_go_first_when_older() -> None:
    peers = FakePeers([(1, {"name": "theirs", "estimate": 4 * GiB, "busy": False,
                            "idle_since": 9e12})])  # fmt: skip
    disposed: list[str] = []
    c = EngineCache(lambda n: n, 10 * GiB, peers=peers, dispose=disposed.append)
    c.get("mine", 4 * GiB)
    c.release("mine")
    c.get("x", 4 * GiB)
    assert disposed == ["mine"] and peers.asked == []


def test_evict_requested_disposes_only_idle_engines() -> None:
    disposed: list[str] = []
    c = EngineCache(lambda n: n, 10 * GiB, dispose=disposed.append)
    c.get("busy", GiB)
    c.get("idle", GiB)
    c.release("idle")
    assert c.evict_requested(["busy", "idle", "absent"]) == ["idle"]
    assert disposed == ["idle"]


# -- the slots' folder ------------------------------------------------------------------------


def test_the_board_lists_live_slots_only_and_the_lowest_leads(tmp_path) -> None:
    board = SlotBoard(tmp_path)
    dead = subprocess.Popen(["true"])
    dead.wait()
    board.write(0, {"pid": dead.pid, "incarnation": "gone"})
    board.write(1, {"pid": os.getpid(), "incarnation": "one"})
    board.write(2, {"pid": os.getppid(), "incarnation": "two"})
    assert sorted(board.live()) == [1, 2]
    assert board.leader() == 1
    assert sorted(board.others(1)) == [2]
    board.ask_evict(2, ["a"])
    board.ask_evict(2, ["b"])
    assert board.take_evictions(2) == ["a", "b"]
    assert board.take_evictions(2) == []
    peers = Peers(board, 1)
    board.write(2, {"pid": os.getppid(), "loaded": [{"name": "m", "estimate": 5}],
                    "loading": "n", "loading_estimate": 7})  # fmt: skip
    assert [(s, e["name"], e["estimate"]) for s, e in peers.engines()] == [(2, "m", 5), (2, "n", 7)]
    with board.load_lock():
        pass
    assert not board.stopping
    board.mark_stopping()
    assert board.stopping


# -- --engines --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "capacity", "largest", "mps", "want"),
    [
        ("cpu", 64 * GiB, GiB, False, 1),
        ("cpu", 64 * GiB, GiB, True, 1),
        ("igpu", 64 * GiB, GiB, False, 1),
        ("gpu", 139 * GiB, 6 * GiB, False, GPU_ENGINES),
        ("gpu", 139 * GiB, 6 * GiB, True, MPS_ENGINES),
        ("gpu", 20 * GiB, 6 * GiB, True, 3),
        ("accel", 139 * GiB, 0, False, GPU_ENGINES),
        ("gpu", 10 * GiB, 6 * GiB, False, 1),
        ("gpu", 10 * GiB, 6 * GiB, True, 1),
        ("gpu", 4 * GiB, 6 * GiB, False, 1),
    ],
)
def test_auto_engines(dtype: str, capacity: int, largest: int, mps: bool, want: int) -> None:
    assert auto_engines(dtype, capacity, largest, mps=mps) == want


def test_parse_engines() -> None:
    import argparse

    assert parse_engines("auto") == "auto" and parse_engines("3") == 3
    for bad in ("0", "-1", "x", "65"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_engines(bad)


def test_evicting_one_of_two_engines_of_a_model_gives_back_one() -> None:
    # Two slots each hold an idle "b"; "c" needs one of them gone, not both.
    d = device(10, (eng("b", 4, idle=1.0), eng("b", 4, idle=2.0)))
    outcome = place(job("c", 4), [d], NOW)
    assert outcome == Placed("h/gpu0", "fits-evicting", ("b",))
    after = account(d, "c", 4 * GiB, outcome.evict)
    assert [m.name for m in after.loaded] == ["b", "c"]
    assert after.compute_figure == 2 * GiB


def _slot_process(root: str, ready: Any, done: Any) -> None:
    """Slot 1 in its own process: loads "a", leaves it idle, then serves eviction requests
    (as the worker's janitor does) until told to stop; exits 0 if "a" was disposed."""
    board = SlotBoard(root)
    gone: list[str] = []
    c = EngineCache(lambda n: n, 10 * GiB, peers=Peers(board, 1), dispose=gone.append)
    c.on_change = lambda: board.write(
        1, {"pid": os.getpid(), "loaded": c.snapshot(), "held": c.held_bytes()}
    )
    c.get("a", 4 * GiB)
    c.release("a")
    ready.set()
    while not done.wait(0.02):
        c.evict_requested(board.take_evictions(1))
    os._exit(0 if gone == ["a"] else 1)


def test_a_load_evicts_another_processes_idle_engine_through_the_board(tmp_path) -> None:
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    ready, done = ctx.Event(), ctx.Event()
    other = ctx.Process(target=_slot_process, args=(str(tmp_path), ready, done))
    other.start()
    try:
        assert ready.wait(10)
        board = SlotBoard(tmp_path)
        assert [e["name"] for _, e in Peers(board, 0).engines()] == ["a"]
        c = EngineCache(lambda n: n, 10 * GiB, peers=Peers(board, 0, wait_s=10.0))
        assert c.get("b", 8 * GiB) == "b"  # 4 + 8 > 10: slot 1's idle "a" had to go
        assert Peers(board, 0).engines() == []
    finally:
        done.set()
        other.join(10)
    assert other.exitcode == 0
