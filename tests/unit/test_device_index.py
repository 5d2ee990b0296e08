"""`DeviceIndex` decides exactly as `placement.place` over every device: compared on random
farms, job after job, with each placement accounted as the dispatcher does."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from sdfarm.scheduler import placement
from sdfarm.scheduler.index import DeviceIndex
from sdfarm.scheduler.placement import DeviceState, GiB, JobRequest, LoadedModel
from sdfarm.scheduler.registry import account

MODELS = [f"m{i}" for i in range(6)]


def random_device(rng: random.Random, i: int) -> DeviceState:
    capacity = rng.choice([4, 8, 16, 24]) * GiB
    slots = rng.choice([1, 1, 2, 3])
    loaded, held = [], 0
    # With N slots a model may be loaded once per slot.
    names = rng.sample(MODELS, rng.randint(0, 3)) if slots == 1 else rng.choices(MODELS[:3], k=3)
    for name in names:
        est = rng.choice([1, 2, 3, 5]) * GiB
        if held + est > capacity:
            continue
        held += est
        loaded.append(
            LoadedModel(
                name,
                est,
                busy=rng.random() < 0.3,
                pinned=rng.random() < 0.1,
                idle_since=float(rng.randint(0, 100)),
            )
        )
    compute = max(0, capacity - held - rng.choice([0, 0, GiB]))
    typ = rng.choice(["gpu", "cpu"])
    slow = compute + (rng.choice([0, 8, 32]) * GiB if typ == "gpu" else 0)
    return DeviceState(
        host=f"h{i // 3}",
        device=f"D{i % 3}",
        type=typ,
        compute_figure=compute,
        slow_figure=slow,
        capacity=capacity,
        loaded=tuple(sorted(loaded, key=lambda m: m.name)),
        queued=rng.randint(0, 2 + slots - 1),
        backlog_limit=2 + slots - 1,
        alive=rng.random() < 0.9,
        accepting=rng.random() < 0.9,
        slots=slots,
    )


def same(a: placement.Outcome, b: placement.Outcome) -> bool:
    """Equal outcomes; a Wait's reason may differ (the dispatcher does not read it)."""
    if isinstance(a, placement.Wait):
        return isinstance(b, placement.Wait)
    return a == b


@pytest.mark.parametrize("seed", range(200))
def test_index_places_as_placement_does(seed: int) -> None:
    rng = random.Random(seed)
    devices = {d.key: d for d in (random_device(rng, i) for i in range(rng.randint(0, 12)))}
    index = DeviceIndex(devices.values())
    now = 100.0
    for _ in range(30):
        job = JobRequest(rng.choice(MODELS), rng.choice([1, 2, 3, 4, 6, 9, 20, 40]) * GiB)
        want = placement.place(job, list(devices.values()), now)
        got = index.place(job, now)
        assert same(want, got), (job, want, got)
        assert index.reserve_device(job, now) == placement.reserve_device(
            job, list(devices.values()), now
        )
        if isinstance(want, placement.Placed):
            devices[want.device] = account(devices[want.device], job.model, job.estimate,
                                           want.evict)  # fmt: skip
            index.update(devices[want.device])
        elif rng.random() < 0.3 and devices:
            key = rng.choice(sorted(devices))
            devices[key] = replace(devices[key], accepting=False)
            index.update(devices[key])
        assert index.has_room() == any(
            d.alive and d.accepting and d.has_room for d in devices.values()
        )
        assert index.devices == devices


def test_every_outcome_and_tier_is_covered() -> None:
    """The random farms above reach every tier and every kind of outcome (else the comparison
    proves less than it seems)."""
    tiers, kinds = set(), set()
    for seed in range(200):
        rng = random.Random(seed)
        devices = [random_device(rng, i) for i in range(rng.randint(0, 12))]
        for _ in range(10):
            job = JobRequest(rng.choice(MODELS), rng.choice([1, 2, 3, 4, 6, 9, 20, 40]) * GiB)
            out = placement.place(job, devices, 100.0)
            kinds.add(type(out).__name__)
            if isinstance(out, placement.Placed):
                tiers.add(out.tier)
    assert kinds == {"Placed", "Wait", "Refuse"}
    assert tiers == set(placement.TIERS)


def test_roomiest_is_the_largest_alive_capacity() -> None:
    a = DeviceState(host="a", device="D", type="cpu", compute_figure=GiB, slow_figure=GiB,
                    capacity=4 * GiB)  # fmt: skip
    b = replace(a, host="b", capacity=64 * GiB, alive=False)
    assert DeviceIndex([a, b]).roomiest == 4 * GiB
    assert DeviceIndex([b]).roomiest is None
