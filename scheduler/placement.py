"""Where a job runs: a pure function of the farm's state, as Ollama's scheduler does it.

The scheduler loop reads heartbeats from Redis, turns them into `DeviceState`s and asks
`place(job, devices, now)` where the next job goes. Nothing here does I/O, reads a clock or
keeps state between calls, so every rule is a row in a scenario table
(`tests/unit/test_placement.py`) and a standby scheduler that takes over decides exactly as the
old leader would have on the same state.

Tiers, best first, per alive device that accepts work (SPEC "scheduler: placement across hosts"):

1. ``loaded``        the model is already loaded here and the job's size fits next to it
                     (the estimate grows with the image size): no load, no warm-up.
2. ``fits``          the estimate fits the device's compute figure as it is now.
3. ``fits-evicting`` it fits the compute figure once idle, unpinned engines are evicted
                     (least recently used first, only as many as needed).
4. ``slow-path``     it fits only the slower path (the host's discrete GPUs + MemAvailable, parts
                     of the model staying in system memory), again counting evictable engines.

Then no tier: the device cannot take the job now.

A job whose VAE may decode in tiles (`vae_tiling` auto) has two estimates. Per device, the one
rule of sdfarm.native.tiling (`plan_tiling`) picks one against what the device's compute
figure can give the job (its figure, plus what the model's engine there holds, plus the idle
engines it may evict): a device where only the tiled estimate fits gets the job with the tiled
estimate, and the `Placed` outcome carries that plan for the job record and the worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from sdfarm.native.tiling import TilingPlan, least_estimate, plan_tiling

MiB = 1024 * 1024
GiB = 1024 * MiB

DEVICE_TYPES = frozenset({"cpu", "gpu", "igpu"})

TIER_LOADED = "loaded"
TIER_FITS = "fits"
TIER_FITS_EVICTING = "fits-evicting"
TIER_SLOW_PATH = "slow-path"
TIERS = (TIER_LOADED, TIER_FITS, TIER_FITS_EVICTING, TIER_SLOW_PATH)
"""Best first; a tier's index is its rank."""


@dataclass(frozen=True)
class LoadedModel:
    """An engine a worker holds, as its heartbeat reports it.

    `estimate` is the bytes the engine holds on its device (what evicting it gives back).
    Busy engines (running a job) and pinned engines (keep-alive forever) are never evicted;
    `idle_since` (the worker's clock, seconds) orders eviction: least recently used first.
    """

    name: str
    estimate: int
    busy: bool = False
    pinned: bool = False
    idle_since: float = 0.0

    def __post_init__(self) -> None:
        if self.estimate < 0:
            raise ValueError(f"loaded model {self.name!r}: negative estimate {self.estimate}")


@dataclass(frozen=True, kw_only=True)
class DeviceState:
    """One device of one host, as the registry last saw it (keyword-only: the registry builds
    these from heartbeats by name, and tests spell out only what a scenario is about).

    - `compute_figure`: bytes a new model may use on this device now (the GPU's figure, or
      MemAvailable for a CPU device), already capped by the worker's --memory-limit.
    - `slow_figure`: the host's discrete GPUs' figures + MemAvailable, the slower path where
      parts stay in system memory; equal to `compute_figure` for a CPU device.
    - `loaded`: the engines this device's worker holds.
    - `queued`: jobs already sent to this device and not finished (running ones included);
      the dispatcher counts a job it has just sent before the next heartbeat arrives.
    - `backlog_limit`: how many such jobs the device may hold; late binding keeps it small so
      one slow device never hoards a batch.
    - `alive`: heartbeat is fresh. `accepting`: the worker takes new jobs (not draining).
    - `capacity`: the figure the device would have if emptied (free + what its own engines
      hold): a job above every figure now but within a capacity waits instead of failing.
    - `slots`: engine slots (`sdfarm worker --engines N`), each running one job at once with
      its own engines. With one slot a job of a loaded model runs on that engine, after the
      running one; with N > 1 it may run beside it, so only an idle engine of its model is
      ``loaded`` for it, and a busy one makes it need an engine of its own (its estimate
      against the shared figure). The registry grows `backlog_limit` by N - 1, so N jobs
      run and the backlog waits behind them.
    """

    host: str
    device: str
    type: str
    compute_figure: int
    slow_figure: int
    capacity: int
    loaded: tuple[LoadedModel, ...] = ()
    queued: int = 0
    backlog_limit: int = 2
    alive: bool = True
    accepting: bool = True
    slots: int = 1

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"{self.key}: slots must be at least 1, got {self.slots}")
        if self.type not in DEVICE_TYPES:
            raise ValueError(f"{self.key}: device type {self.type!r} not one of cpu/gpu/igpu")
        for name in ("compute_figure", "slow_figure", "capacity", "queued", "backlog_limit"):
            if getattr(self, name) < 0:
                raise ValueError(f"{self.key}: negative {name} {getattr(self, name)}")

    @property
    def key(self) -> str:
        """The device's name across the farm, and the last tie-break (so placement is
        deterministic whatever order the registry lists devices in)."""
        return f"{self.host}/{self.device}"

    @property
    def has_room(self) -> bool:
        """Whether the bounded backlog takes one more job."""
        return self.queued < self.backlog_limit

    @property
    def slow_capacity(self) -> int:
        """The slower path's figure if this device were emptied: what its engines hold comes
        back to the slow path too (for a CPU device this equals `capacity`)."""
        return self.slow_figure + max(0, self.capacity - self.compute_figure)


@dataclass(frozen=True)
class JobRequest:
    """What placement needs of a job: the model's name and its estimate in bytes (the seed's
    rule, grown with the image size by the client). Priority and submitter do not change where
    a job goes, only when (`fairness.py`); they ride along for the reasons and logs."""

    model: str
    estimate: int
    priority: int = 5
    submitter: str = ""
    tiled_estimate: int | None = None
    vae_tiling: str = "auto"

    def __post_init__(self) -> None:
        if self.estimate < 0 or (self.tiled_estimate or 0) < 0:
            raise ValueError(f"job for {self.model!r}: negative estimate {self.estimate}")

    @property
    def tiled(self) -> int:
        """The estimate decoded in tiles (`estimate` when the job has no tiled form)."""
        return self.estimate if self.tiled_estimate is None else self.tiled_estimate

    def plan(self, figure: int | None) -> TilingPlan:
        """How the job decodes on a device that can give it `figure` (`plan_tiling`)."""
        return plan_tiling(self.estimate, self.tiled, self.vae_tiling, figure)

    @property
    def least(self) -> int:
        """The smallest estimate the job may run with: what an emptied device must hold."""
        return least_estimate(self.estimate, self.tiled, self.vae_tiling)


@dataclass(frozen=True)
class Placed:
    """Send the job to `device` ("host/device"); the worker evicts `evict` first, in order
    (it would pick the same engines by LRU; naming them lets the scheduler log and check it)."""

    device: str
    tier: str
    evict: tuple[str, ...] = ()
    tiling: TilingPlan | None = None


@dataclass(frozen=True)
class Wait:
    """No device can take the job now but one could later: keep it in the central queue."""

    reason: str


@dataclass(frozen=True)
class Figures:
    """One device's figures as a Refuse reports them."""

    device: str
    type: str
    compute_figure: int
    slow_figure: int
    capacity: int
    slow_capacity: int


@dataclass(frozen=True)
class Refuse:
    """Nothing could ever fit: fail the job at once. `reason` names the estimate and every
    device's figures; `figures` holds the same numbers for --json and the gateway."""

    reason: str
    figures: tuple[Figures, ...]


Outcome = Placed | Wait | Refuse


def fmt_bytes(n: int) -> str:
    """Bytes as GiB with two decimals: the unit users compare against `nvidia-smi` and `free`."""
    return f"{n / GiB:.2f} GiB"


def figures_of(device: DeviceState) -> Figures:
    """The numbers a Refuse reports for `device`."""
    return Figures(
        device=device.key,
        type=device.type,
        compute_figure=device.compute_figure,
        slow_figure=device.slow_figure,
        capacity=device.capacity,
        slow_capacity=device.slow_capacity,
    )


def figures_table(devices: Sequence[DeviceState]) -> str:
    """Every device's figures on one line each, sorted by key, so a refused user sees which
    device came closest and by how much (the seed's rule: name the estimate and every figure)."""
    if not devices:
        return "(no devices)"
    lines = []
    for d in sorted(devices, key=lambda d: d.key):
        lines.append(
            f"{d.key} ({d.type}): compute {fmt_bytes(d.compute_figure)}, "
            f"slow path {fmt_bytes(d.slow_figure)}, capacity {fmt_bytes(d.capacity)}, "
            f"slow-path capacity {fmt_bytes(d.slow_capacity)}"
        )
    return "\n".join(lines)


def held_engine(device: DeviceState, model: str) -> LoadedModel | None:
    """The engine of `model` on `device` a job of it would use: with one slot the loaded
    one (busy or not: the job runs after the running one), with N slots an idle one (a busy
    engine runs another job; this one may run beside it, on an engine of its own)."""
    for m in device.loaded:
        if m.name == model and (device.slots == 1 or not m.busy):
            return m
    return None


def _evictable(device: DeviceState, now: float) -> list[LoadedModel]:
    """Idle, unpinned engines, least recently used first (ties by name).

    `idle_since` comes from the worker's clock on another host; the age is clamped at zero
    against the scheduler's `now`, so a stamp from a clock running ahead counts as just used
    rather than as the oldest engine.
    """
    idle = [m for m in device.loaded if not m.busy and not m.pinned]
    return sorted(idle, key=lambda m: (-max(0.0, now - m.idle_since), m.name))


def _evict_to_fit(
    figure: int, estimate: int, candidates: list[LoadedModel]
) -> tuple[str, ...] | None:
    """The shortest LRU prefix of `candidates` whose eviction makes `estimate` fit `figure`;
    () when it fits already, None when evicting all of them is still not enough."""
    freed = 0
    evicted: list[str] = []
    for model in candidates:
        if figure + freed >= estimate:
            break
        freed += model.estimate
        evicted.append(model.name)
    if figure + freed >= estimate:
        return tuple(evicted)
    return None


@dataclass(frozen=True)
class _Option:
    """A device's best tier for a job, with the evictions it needs."""

    device: DeviceState
    tier: str
    evict: tuple[str, ...]
    tiling: TilingPlan | None = None

    def rank(self) -> tuple[int, bool, int, int, str]:
        """Best first: tier, then (within the slow path) no eviction over eviction, then the
        SPEC's ties: least queued work, most free memory, and the key for determinism."""
        return (
            TIERS.index(self.tier),
            bool(self.evict),
            self.device.queued,
            -self.device.compute_figure,
            self.device.key,
        )


def plan_for(job: JobRequest, device: DeviceState, now: float) -> TilingPlan:
    """How `job` decodes on `device`: the plan against what the device's compute figure can
    give it, counting the model's engine there and the idle engines it may evict."""
    held = held_engine(device, job.model)
    others = [m for m in _evictable(device, now) if m is not held]
    room = device.compute_figure + (held.estimate if held else 0)
    return job.plan(room + sum(m.estimate for m in others))


def tier_for(
    job: JobRequest, device: DeviceState, now: float
) -> tuple[str, tuple[str, ...]] | None:
    """The best tier `device` offers `job` now and the engines to evict for it, or None;
    judged by the estimate of the job's plan on this device (`plan_for`).

    Backlog room is not looked at here: a full device still has a tier, which decides whether
    the job waits for it (see `place`).
    """
    job = replace(job, estimate=plan_for(job, device, now).estimate, tiled_estimate=None)
    held = held_engine(device, job.model)
    if held is not None:
        return _tier_for_held(job, device, held, now)
    candidates = _evictable(device, now)
    evict = _evict_to_fit(device.compute_figure, job.estimate, candidates)
    if evict == ():
        return TIER_FITS, ()
    if evict is not None:
        return TIER_FITS_EVICTING, evict
    evict = _evict_to_fit(device.slow_figure, job.estimate, candidates)
    if evict is not None:
        return TIER_SLOW_PATH, evict
    return None


def _tier_for_held(
    job: JobRequest, device: DeviceState, held: LoadedModel, now: float
) -> tuple[str, tuple[str, ...]] | None:
    """The model is loaded here. Its engine holds `held.estimate` (the estimate at the size it
    last ran); a job at a larger size needs the difference on top, the estimate grows with
    the image size (native/memory.py). Within the free figure it is the ``loaded`` tier;
    otherwise other idle engines are evicted, or it takes the slow path, like a new load
    would but counting what the engine already holds; beyond that the device cannot take it
    (and `place` refuses it if even the emptied device is too small)."""
    if job.estimate <= held.estimate + device.compute_figure:
        return TIER_LOADED, ()
    others = [m for m in _evictable(device, now) if m is not held]
    evict = _evict_to_fit(device.compute_figure + held.estimate, job.estimate, others)
    if evict is not None:
        return TIER_FITS_EVICTING, evict
    evict = _evict_to_fit(device.slow_figure + held.estimate, job.estimate, others)
    if evict is not None:
        return TIER_SLOW_PATH, evict
    return None


def place(job: JobRequest, devices: Sequence[DeviceState], now: float) -> Outcome:
    """Where `job` goes now: `Placed`, `Wait` (keep it queued) or `Refuse` (fail it at once).

    Only alive devices count; of those, only accepting devices with backlog room
    (queued < backlog_limit) can take the job now. The rules, in order:

    1. No alive device: Wait("no workers"), since a worker may join.
    2. A device that has the model loaded and has room: the best of them.
    3. The model is loaded somewhere but every such device's backlog is full: the job goes to a
       device with room where it fits without eviction (tier ``fits``), so a batch spreads
       over idle devices instead of queueing behind one; if there is none, it waits for the
       device that holds the model rather than evicting someone's engine or taking the slow
       path (both cost a load and the holder frees up within `backlog_limit` jobs).
    4. Otherwise the best tier among devices with room, even if a device with a better tier
       is full: no device holds the model, so every choice pays a load anyway and waiting
       would only add latency.
    5. Some device has a tier but none has room (or accepts): Wait.
    6. No device has a tier now, but the estimate fits some alive device's capacity or
       slow-path capacity (the device emptied, e.g. once busy or pinned engines go): Wait.
    7. Otherwise Refuse, naming the estimate and every alive device's figures.

    Ties within a tier: a device that needs no eviction first (only matters on the slow path),
    then least queued work, then most free memory (compute figure), then the device key.
    `now` is the scheduler's clock, used for the engines' idle ages (eviction order).
    """
    alive = [d for d in devices if d.alive]
    if not alive:
        return Wait("no workers: no alive device has sent a heartbeat")

    options: list[_Option] = []
    for device in alive:
        if not device.accepting:
            continue
        found = tier_for(job, device, now)
        if found is not None:
            options.append(_Option(device, found[0], found[1], _carried(job, device, now)))

    ready = sorted((o for o in options if o.device.has_room), key=_Option.rank)
    holders = [o for o in options if o.tier == TIER_LOADED]

    if holders:
        if ready and ready[0].tier == TIER_LOADED:
            return _placed(ready[0])
        no_eviction = [o for o in ready if o.tier == TIER_FITS]
        if no_eviction:
            return _placed(no_eviction[0])
        keys = ", ".join(sorted(o.device.key for o in holders))
        return Wait(f"{job.model} is loaded on {keys}, whose backlog is full; waiting for it")

    if ready:
        return _placed(ready[0])

    if options:
        keys = ", ".join(sorted(o.device.key for o in options))
        return Wait(f"every device that can take {job.model} is busy (backlog full): {keys}")

    least = job.least
    if any(least <= max(d.capacity, d.slow_capacity) for d in alive):
        roomy = ", ".join(sorted(d.key for d in alive if least <= max(d.capacity, d.slow_capacity)))
        return Wait(
            f"{job.model} (estimate {fmt_bytes(least)}) fits no device now; "
            f"waiting for engines to be freed on {roomy}"
        )

    figures = tuple(figures_of(d) for d in sorted(alive, key=lambda d: d.key))
    dead = len(devices) - len(alive)
    ignored = f" ({dead} dead device(s) not counted)" if dead else ""
    return Refuse(
        reason=(
            f"{job.model} needs an estimated {fmt_bytes(least)}{_tiling_note(job)}, more than "
            f"any device could ever give it, even emptied{ignored}:\n{figures_table(alive)}"
        ),
        figures=figures,
    )


def _carried(job: JobRequest, device: DeviceState, now: float) -> TilingPlan | None:
    """The plan a `Placed` carries: None for a job with one estimate and no choice made."""
    if job.tiled_estimate is None and job.vae_tiling == "auto":
        return None
    return plan_for(job, device, now)


def _tiling_note(job: JobRequest) -> str:
    """What a refusal says of tiling: that even tiled it does not fit, or what tiling would
    need when the user turned it off."""
    if job.tiled >= job.estimate:
        return ""
    if job.vae_tiling == "off":
        return f" (vae_tiling off; decoded in tiles it would need {fmt_bytes(job.tiled)})"
    return f" even decoded in tiles (untiled {fmt_bytes(job.estimate)})"


def _placed(option: _Option) -> Placed:
    return Placed(
        device=option.device.key, tier=option.tier, evict=option.evict, tiling=option.tiling
    )


def reserve_device(job: JobRequest, devices: Sequence[DeviceState], now: float) -> str | None:
    """The device a waiting `job` should hold, or None.

    A job that waits for an emptied device (no device offers it a tier now, one would once its
    engines are freed: rule 6 of `place`) holds the roomiest such device; the dispatcher then
    sends no job behind it in fair-share order there, so the device drains and the big job is
    not starved by a stream of small ones. None when some device has a tier (the job waits
    only for backlog room, which frees by itself) or none could ever hold it.
    """
    live = [d for d in devices if d.alive and d.accepting]
    if any(tier_for(job, d, now) is not None for d in live):
        return None
    roomy = [d for d in live if job.least <= max(d.capacity, d.slow_capacity)]
    if not roomy:
        return None
    return max(roomy, key=lambda d: (max(d.capacity, d.slow_capacity), d.key)).key
