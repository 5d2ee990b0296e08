"""Placement scenarios: each row is a farm's state, a job, and where the job must go."""

from __future__ import annotations

import pytest

from sdfarm.scheduler.placement import (
    DeviceState,
    Figures,
    GiB,
    JobRequest,
    LoadedModel,
    Placed,
    Refuse,
    Wait,
    figures_table,
    place,
    reserve_device,
    tier_for,
)

NOW = 10_000.0


def eng(
    name: str, gib: float, *, busy: bool = False, pinned: bool = False, idle: float = 0.0
) -> LoadedModel:
    return LoadedModel(name, int(gib * GiB), busy=busy, pinned=pinned, idle_since=idle)


def dev(
    key: str,
    free: float,
    *,
    type: str = "gpu",
    slow: float | None = None,
    loaded: tuple[LoadedModel, ...] = (),
    queued: int = 0,
    limit: int = 2,
    alive: bool = True,
    accepting: bool = True,
    capacity: float | None = None,
) -> DeviceState:
    """A device from GiB figures. Defaults: the slow path adds 16 GiB of MemAvailable for a
    GPU (nothing for a CPU device), and capacity is free + what the loaded engines hold."""
    host, device = key.split("/")
    compute = int(free * GiB)
    if slow is None:
        slow_figure = compute if type == "cpu" else compute + 16 * GiB
    else:
        slow_figure = int(slow * GiB)
    cap = int(capacity * GiB) if capacity is not None else compute + sum(m.estimate for m in loaded)
    return DeviceState(
        host=host,
        device=device,
        type=type,
        compute_figure=compute,
        slow_figure=slow_figure,
        capacity=cap,
        loaded=loaded,
        queued=queued,
        backlog_limit=limit,
        alive=alive,
        accepting=accepting,
    )


def job(model: str, gib: float) -> JobRequest:
    return JobRequest(model=model, estimate=int(gib * GiB), priority=5, submitter="alice")


# (job, devices, expected Placed)
PLACED = [
    pytest.param(
        job("sdxl", 7),
        [dev("h1/gpu0", 2, loaded=(eng("sdxl", 7),)), dev("h2/gpu0", 40)],
        Placed("h1/gpu0", "loaded"),
        id="loaded-beats-more-free-memory",
    ),
    pytest.param(
        job("sdxl", 7),
        [dev("h1/gpu0", 2, loaded=(eng("sdxl", 7, busy=True),), queued=1), dev("h2/gpu0", 40)],
        Placed("h1/gpu0", "loaded"),
        id="loaded-busy-with-backlog-room-still-wins-over-idle-device",
    ),
    pytest.param(
        job("sdxl", 7),
        [dev("h1/gpu0", 2, loaded=(eng("sdxl", 7, busy=True),), queued=2), dev("h2/gpu0", 40)],
        Placed("h2/gpu0", "fits"),
        id="loaded-backlog-full-spills-to-idle-device-with-room",
    ),
    pytest.param(
        job("sdxl", 7),
        [
            dev("h1/gpu0", 2, loaded=(eng("sdxl", 7, busy=True),), queued=1),
            dev("h2/gpu0", 2, loaded=(eng("sdxl", 7),), queued=0),
        ],
        Placed("h2/gpu0", "loaded"),
        id="loaded-on-two-devices-least-queued",
    ),
    pytest.param(
        job("flux", 6),
        [dev("h1/gpu0", 3, loaded=(eng("old", 4, idle=100), eng("new", 4, idle=200)))],
        Placed("h1/gpu0", "fits-evicting", ("old",)),
        id="evict-one-idle-engine-lru",
    ),
    pytest.param(
        job("flux", 8),
        [
            dev(
                "h1/gpu0",
                1,
                loaded=(eng("a", 4, idle=300), eng("b", 4, idle=100), eng("c", 4, idle=200)),
            )
        ],
        Placed("h1/gpu0", "fits-evicting", ("b", "c")),
        id="evict-only-as-many-as-needed-oldest-first",
    ),
    pytest.param(
        job("flux", 5),
        [
            dev(
                "h1/gpu0",
                1,
                loaded=(
                    eng("pinned", 4, pinned=True, idle=0),
                    eng("busy", 4, busy=True, idle=1),
                    eng("idle", 4, idle=500),
                ),
                queued=1,
            )
        ],
        Placed("h1/gpu0", "fits-evicting", ("idle",)),
        id="pinned-and-busy-never-evicted",
    ),
    pytest.param(
        job("flux", 10),
        [dev("h1/gpu0", 4, slow=40)],
        Placed("h1/gpu0", "slow-path"),
        id="slow-path-only",
    ),
    pytest.param(
        job("flux", 11),
        [dev("h1/gpu0", 2, slow=8, loaded=(eng("x", 4, idle=5),))],
        Placed("h1/gpu0", "slow-path", ("x",)),
        id="slow-path-after-evicting",
    ),
    pytest.param(
        job("flux", 10),
        [dev("h1/gpu0", 4, slow=40), dev("h2/gpu0", 12, queued=1)],
        Placed("h2/gpu0", "fits"),
        id="fits-beats-slow-path-even-with-more-queued",
    ),
    pytest.param(
        job("flux", 10),
        [dev("h1/gpu0", 4, loaded=(eng("x", 8, idle=1),)), dev("h2/gpu0", 12, queued=1)],
        Placed("h2/gpu0", "fits"),
        id="fits-without-eviction-beats-fits-evicting",
    ),
    pytest.param(
        job("flux", 10),
        [dev("h1/gpu0", 4, slow=30, loaded=(eng("x", 8, idle=1),)), dev("h2/gpu0", 4, slow=30)],
        Placed("h1/gpu0", "fits-evicting", ("x",)),
        id="fits-evicting-beats-slow-path",
    ),
    pytest.param(
        job("flux", 10),
        [
            dev("h1/gpu0", 2, slow=8, loaded=(eng("x", 4, idle=1),)),
            dev("h2/gpu0", 2, slow=20, queued=1),
        ],
        Placed("h2/gpu0", "slow-path"),
        id="slow-path-prefers-no-eviction-over-less-queued",
    ),
    pytest.param(
        job("flux", 8),
        [dev("h1/gpu0", 20, queued=1), dev("h2/gpu0", 10, queued=0)],
        Placed("h2/gpu0", "fits"),
        id="equal-tier-least-queued-first",
    ),
    pytest.param(
        job("flux", 8),
        [dev("h1/gpu0", 10), dev("h2/gpu0", 20)],
        Placed("h2/gpu0", "fits"),
        id="equal-tier-and-queue-most-free-first",
    ),
    pytest.param(
        job("flux", 8),
        [dev("h2/gpu0", 10), dev("h1/gpu1", 10), dev("h1/gpu0", 10)],
        Placed("h1/gpu0", "fits"),
        id="all-equal-device-key-decides",
    ),
    pytest.param(
        job("sdxl", 7),
        [dev("h1/gpu0", 2, loaded=(eng("sdxl", 7),), alive=False), dev("h2/gpu0", 10)],
        Placed("h2/gpu0", "fits"),
        id="dead-device-ignored-even-if-loaded",
    ),
    pytest.param(
        job("sdxl", 7),
        [dev("h1/gpu0", 2, loaded=(eng("sdxl", 7),), accepting=False), dev("h2/gpu0", 10)],
        Placed("h2/gpu0", "fits"),
        id="draining-device-ignored-even-if-loaded",
    ),
    pytest.param(
        job("flux", 8),
        [dev("h1/gpu0", 20, queued=2), dev("h2/gpu0", 2, loaded=(eng("x", 8, idle=1),))],
        Placed("h2/gpu0", "fits-evicting", ("x",)),
        id="not-loaded-anywhere-better-tier-full-takes-best-tier-now",
    ),
    pytest.param(
        job("flux", 8),
        [dev("h1/cpu", 4, type="cpu"), dev("h2/gpu0", 12, queued=1)],
        Placed("h2/gpu0", "fits"),
        id="memory-limit-capped-cpu-never-chosen-when-model-exceeds-its-figure",
    ),
    pytest.param(
        job("tiny", 1),
        [dev("h1/cpu", 4, type="cpu"), dev("h2/gpu0", 12, queued=1)],
        Placed("h1/cpu", "fits"),
        id="memory-limit-capped-cpu-chosen-when-model-fits-its-figure",
    ),
    pytest.param(
        job("flux", 8),
        [dev("h1/gpu0", 20, queued=3, limit=4), dev("h2/gpu0", 10, queued=2)],
        Placed("h1/gpu0", "fits"),
        id="per-device-backlog-limit-respected",
    ),
    pytest.param(
        job("sdxl", 9),
        [dev("h1/gpu0", 2, loaded=(eng("sdxl", 7),)), dev("h2/gpu0", 40)],
        Placed("h1/gpu0", "loaded"),
        id="loaded-larger-size-fits-next-to-the-engine",
    ),
    pytest.param(
        job("sdxl", 12),
        [dev("h1/gpu0", 2, loaded=(eng("sdxl", 7), eng("x", 4, idle=1)))],
        Placed("h1/gpu0", "fits-evicting", ("x",)),
        id="loaded-larger-size-evicts-other-engines-not-itself",
    ),
    pytest.param(
        job("sdxl", 20),
        [dev("h1/gpu0", 2, slow=30, loaded=(eng("sdxl", 7),))],
        Placed("h1/gpu0", "slow-path"),
        id="loaded-larger-size-takes-the-slow-path",
    ),
]


@pytest.mark.parametrize(("request_", "devices", "expected"), PLACED)
def test_placed(request_: JobRequest, devices: list[DeviceState], expected: Placed) -> None:
    assert place(request_, devices, NOW) == expected


@pytest.mark.parametrize(("request_", "devices", "expected"), PLACED)
def test_placed_ignores_listing_order(
    request_: JobRequest, devices: list[DeviceState], expected: Placed
) -> None:
    """A standby scheduler reading the registry in another order decides the same."""
    assert place(request_, list(reversed(devices)), NOW) == expected


# (job, devices, words the Wait reason must contain)
WAITS = [
    pytest.param(job("flux", 4), [], ["no workers"], id="no-devices"),
    pytest.param(
        job("flux", 4), [dev("h1/gpu0", 20, alive=False)], ["no workers"], id="only-dead-devices"
    ),
    pytest.param(
        job("flux", 4),
        [dev("h1/gpu0", 20, queued=2), dev("h2/gpu0", 20, queued=2)],
        ["busy", "h1/gpu0", "h2/gpu0"],
        id="backlog-full-everywhere",
    ),
    pytest.param(
        job("sdxl", 7),
        [
            dev("h1/gpu0", 2, loaded=(eng("sdxl", 7, busy=True),), queued=2),
            dev("h2/gpu0", 2, loaded=(eng("other", 8, idle=1),)),
        ],
        ["loaded on h1/gpu0", "backlog is full"],
        id="loaded-backlog-full-waits-rather-than-evict-elsewhere",
    ),
    pytest.param(
        job("sdxl", 7),
        [
            dev("h1/gpu0", 2, loaded=(eng("sdxl", 7, busy=True),), queued=2),
            dev("h2/gpu0", 2, slow=30),
        ],
        ["loaded on h1/gpu0"],
        id="loaded-backlog-full-waits-rather-than-slow-path",
    ),
    pytest.param(
        job("flux", 10),
        [
            dev(
                "h1/gpu0",
                2,
                slow=4,
                loaded=(eng("pinned", 6, pinned=True), eng("busy", 6, busy=True)),
                queued=1,
            )
        ],
        ["fits no device now", "h1/gpu0", "10.00 GiB"],
        id="fits-emptied-device-but-pinned-and-busy-engines-hold-it-now",
    ),
    pytest.param(
        job("flux", 10),
        [dev("h1/gpu0", 20, accepting=False), dev("h2/gpu0", 4, slow=6)],
        ["fits no device now", "h1/gpu0"],
        id="only-draining-device-could-take-it",
    ),
]


@pytest.mark.parametrize(("request_", "devices", "words"), WAITS)
def test_wait(request_: JobRequest, devices: list[DeviceState], words: list[str]) -> None:
    outcome = place(request_, devices, NOW)
    assert isinstance(outcome, Wait), outcome
    for word in words:
        assert word in outcome.reason


# (job, devices, words the Refuse reason must contain)
REFUSALS = [
    pytest.param(
        job("huge", 100),
        [dev("h1/gpu0", 20, slow=60), dev("h2/cpu", 30, type="cpu")],
        [
            "huge",
            "100.00 GiB",
            "h1/gpu0 (gpu): compute 20.00 GiB, slow path 60.00 GiB, capacity 20.00 GiB",
            "h2/cpu (cpu): compute 30.00 GiB, slow path 30.00 GiB, capacity 30.00 GiB",
        ],
        id="too-big-for-everything-names-estimate-and-every-figure",
    ),
    pytest.param(
        job("flux", 8),
        [dev("h1/cpu", 4, type="cpu")],
        ["8.00 GiB", "h1/cpu (cpu): compute 4.00 GiB"],
        id="memory-limit-capped-cpu-only",
    ),
    pytest.param(
        job("huge", 50),
        [dev("h1/gpu0", 100, alive=False), dev("h2/gpu0", 10, slow=20)],
        ["50.00 GiB", "h2/gpu0", "1 dead device(s) not counted"],
        id="dead-device-capacity-not-counted",
    ),
]


@pytest.mark.parametrize(("request_", "devices", "words"), REFUSALS)
def test_refuse(request_: JobRequest, devices: list[DeviceState], words: list[str]) -> None:
    outcome = place(request_, devices, NOW)
    assert isinstance(outcome, Refuse), outcome
    for word in words:
        assert word in outcome.reason
    alive = sorted(d.key for d in devices if d.alive)
    assert [f.device for f in outcome.figures] == alive


def test_refuse_figures_are_structured() -> None:
    devices = [dev("h1/gpu0", 2, slow=10, loaded=(eng("x", 6, idle=1),))]
    outcome = place(job("huge", 100), devices, NOW)
    assert isinstance(outcome, Refuse)
    assert outcome.figures == (
        Figures(
            device="h1/gpu0",
            type="gpu",
            compute_figure=2 * GiB,
            slow_figure=10 * GiB,
            capacity=8 * GiB,
            slow_capacity=16 * GiB,
        ),
    )


def test_slow_path_capacity_makes_it_wait_not_refuse() -> None:
    """Emptied, the slow path would hold it: the job waits instead of failing."""
    devices = [
        dev("h1/gpu0", 1, slow=9, loaded=(eng("p", 7, pinned=True),)),
    ]
    outcome = place(job("flux", 14), devices, NOW)
    assert isinstance(outcome, Wait), outcome


def test_figures_table_sorted_and_empty() -> None:
    table = figures_table([dev("h2/gpu0", 1), dev("h1/gpu0", 2)])
    assert table.splitlines()[0].startswith("h1/gpu0 (gpu): compute 2.00 GiB")
    assert table.splitlines()[1].startswith("h2/gpu0 (gpu): compute 1.00 GiB")
    assert figures_table([]) == "(no devices)"


def test_tier_for_ignores_backlog() -> None:
    """A full device still has a tier: that decides whether a job waits for it."""
    full = dev("h1/gpu0", 2, loaded=(eng("sdxl", 7),), queued=2)
    assert tier_for(job("sdxl", 7), full, NOW) == ("loaded", ())


def test_fits_exactly_at_the_figure() -> None:
    assert place(job("m", 8), [dev("h1/gpu0", 8)], NOW) == Placed("h1/gpu0", "fits")


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"type": "tpu"}, id="unknown-type"),
        pytest.param({"queued": -1}, id="negative-queued"),
        pytest.param({"compute_figure": -1}, id="negative-figure"),
    ],
)
def test_device_state_rejects_nonsense(kwargs: dict[str, object]) -> None:
    base: dict[str, object] = {
        "host": "h1",
        "device": "gpu0",
        "type": "gpu",
        "compute_figure": GiB,
        "slow_figure": GiB,
        "capacity": GiB,
    }
    with pytest.raises(ValueError):
        DeviceState(**{**base, **kwargs})  # type: ignore[arg-type]


def test_loaded_model_at_a_size_no_device_can_hold_is_refused() -> None:
    """A loaded engine is no free pass: at 4096x4096 the estimate outgrows every device."""
    outcome = place(job("sdxl", 48), [dev("h1/cpu", 3, type="cpu", loaded=(eng("sdxl", 1),))], NOW)
    assert isinstance(outcome, Refuse)
    assert "48.00 GiB" in outcome.reason


def test_a_job_waiting_for_an_emptied_device_reserves_the_roomiest() -> None:
    busy = (eng("a", 10, busy=True),)
    devices = [
        dev("h1/gpu0", 4, slow=4, loaded=busy),  # capacity 14
        dev("h2/gpu0", 2, slow=2, loaded=(eng("b", 20, busy=True),)),  # capacity 22
        dev("h3/gpu0", 1, slow=1),  # capacity 1: could never hold it
    ]
    assert reserve_device(job("big", 12), devices, NOW) == "h2/gpu0"
    # Some device can take it now (only backlog room missing): nothing to reserve.
    assert reserve_device(job("big", 3), devices, NOW) is None
    # Nothing could ever hold it: refused, not reserved.
    assert reserve_device(job("huge", 100), devices, NOW) is None


# -- VAE tiling: per device, the plan of sdfarm.native.tiling picks the estimate ----------------


def tjob(untiled: float, tiled: float, choice: str = "auto") -> JobRequest:
    return JobRequest("m", int(untiled * GiB), tiled_estimate=int(tiled * GiB), vae_tiling=choice)


def planned(outcome: object) -> tuple[str, str, bool, float, bool]:
    """(device, tier, tiled?, the estimate in GiB, has a warning) of a Placed."""
    assert isinstance(outcome, Placed) and outcome.tiling is not None, outcome
    p = outcome.tiling
    return outcome.device, outcome.tier, p.tiled, p.estimate / GiB, bool(p.warning)


# (job, devices, (device, tier, tiled?, estimate GiB, warned?))
TILING = [
    pytest.param(
        tjob(20, 8),
        [dev("h1/gpu0", 32)],
        ("h1/gpu0", "fits", False, 20, False),
        id="fits-untiled-no-tiling",
    ),
    pytest.param(
        tjob(20, 8),
        [dev("h1/gpu0", 12, slow=12)],
        ("h1/gpu0", "fits", True, 8, True),
        id="only-the-tiled-estimate-fits-the-device-tiles",
    ),
    pytest.param(
        tjob(20, 8),
        [dev("h1/gpu0", 12)],
        ("h1/gpu0", "fits", True, 8, True),
        id="tiled-on-the-gpu-before-the-slow-path-untiled",
    ),
    pytest.param(
        tjob(20, 8),
        [dev("h1/gpu0", 4, loaded=(eng("old", 20),))],
        ("h1/gpu0", "fits-evicting", False, 20, False),
        id="untiled-when-evicting-an-idle-engine-makes-room",
    ),
    pytest.param(
        tjob(20, 8),
        [dev("h1/gpu0", 6, slow=6, loaded=(eng("m", 3),))],
        ("h1/gpu0", "loaded", True, 8, True),
        id="loaded-engine-counts-in-the-room",
    ),
    pytest.param(
        tjob(20, 8),
        [dev("h1/gpu0", 12, slow=12), dev("h2/gpu0", 24, slow=24)],
        ("h2/gpu0", "fits", False, 20, False),
        id="the-device-where-it-fits-untiled-ranks-first-by-free-memory",
    ),
    pytest.param(
        tjob(20, 8, "on"),
        [dev("h1/gpu0", 32)],
        ("h1/gpu0", "fits", True, 8, False),
        id="on-tiles-though-it-fits",
    ),
    pytest.param(
        tjob(20, 8),
        [dev("h1/gpu0", 4, slow=10)],
        ("h1/gpu0", "slow-path", True, 8, True),
        id="neither-fits-the-gpu-tiled-on-the-slow-path",
    ),
]


@pytest.mark.parametrize(("request_", "devices", "expected"), TILING)
def test_tiling_plan_per_device(
    request_: JobRequest, devices: list[DeviceState], expected: tuple[object, ...]
) -> None:
    assert planned(place(request_, devices, NOW)) == expected


def test_off_is_refused_where_tiled_would_fit_and_says_so() -> None:
    outcome = place(tjob(20, 8, "off"), [dev("h1/cpu", 12, type="cpu")], NOW)
    assert isinstance(outcome, Refuse), outcome
    assert "20.00 GiB (vae_tiling off; decoded in tiles it would need 8.00 GiB)" in outcome.reason


def test_refused_even_tiled() -> None:
    outcome = place(tjob(40, 16), [dev("h1/cpu", 12, type="cpu")], NOW)
    assert isinstance(outcome, Refuse), outcome
    assert "16.00 GiB even decoded in tiles (untiled 40.00 GiB)" in outcome.reason


def test_waits_for_an_emptied_device_by_its_tiled_estimate() -> None:
    busy = dev("h1/cpu", 2, type="cpu", loaded=(eng("other", 10, busy=True),))  # capacity 12
    assert isinstance(place(tjob(20, 8), [busy], NOW), Wait)
    assert reserve_device(tjob(20, 8), [busy], NOW) == "h1/cpu"
    assert isinstance(place(tjob(20, 8, "off"), [busy], NOW), Refuse)
