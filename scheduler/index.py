"""One cycle's devices, indexed so that placing a job does not walk the whole farm.

`placement.place` looks at every device for every job: on a farm of a thousand devices a
cycle that sends hundreds of jobs made a hundred thousand tier checks, and the cost of one
placement grew with the farm. `DeviceIndex.place` gives the same outcome as
`placement.place(job, every device, now)` (tests/unit/test_device_index.py compares them on
random farms) from three kinds of lookup:

- per model, the devices with backlog room that hold it, by queued count and then most
  free memory (`_ready_holders`): the ``loaded`` tier can only be there, and the first whose
  engine leaves room for the job's size is the best;
- the devices with backlog room, the same way (`_ready`): the best ``fits`` device (model
  not held, estimate within the compute figure) is the first of the lowest level whose
  figure is large enough, skipping the holders;
- only when neither gives an answer and no device offers the ``loaded`` tier,
  `placement.place` over the devices with room (evicting or the slow path), then over every
  device (which then can only say Wait or Refuse).

The dispatcher feeds every change it makes in a pass back through `update`.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Iterator

from sdfarm.scheduler import placement
from sdfarm.scheduler.placement import (
    TIER_FITS,
    TIER_LOADED,
    DeviceState,
    JobRequest,
    Outcome,
    Placed,
    Wait,
)


def _live(d: DeviceState) -> bool:
    return d.alive and d.accepting


class _Levels:
    """Devices with backlog room by queued count, each level sorted by (-compute figure,
    key): walking the levels in order visits devices best first by placement's tie-breaks."""

    def __init__(self) -> None:
        self.levels: dict[int, list[tuple[int, str]]] = {}

    def add(self, d: DeviceState, sort: bool = True) -> None:
        """Add `d`; with sort=False at the end of its level (then `sort()` before any use)."""
        level = self.levels.setdefault(d.queued, [])
        if sort:
            insort(level, (-d.compute_figure, d.key))
        else:
            level.append((-d.compute_figure, d.key))

    def sort(self) -> None:
        for level in self.levels.values():
            level.sort()

    def remove(self, d: DeviceState) -> None:
        level = self.levels[d.queued]
        del level[bisect_left(level, (-d.compute_figure, d.key))]
        if not level:
            del self.levels[d.queued]

    def walk(self, estimate: int) -> Iterator[str]:
        """Keys best first, each level only as far as the compute figure reaches `estimate`
        (the rest of a level has less)."""
        for queued in sorted(self.levels):
            for neg_figure, key in self.levels[queued]:
                if -neg_figure < estimate:
                    break
                yield key


class DeviceIndex:
    """The devices of one pass, by key, with the lookups above."""

    def __init__(self, devices: Iterable[DeviceState]) -> None:
        self.devices: dict[str, DeviceState] = {}
        self._holders: dict[str, set[str]] = {}
        self._ready = _Levels()
        self._ready_holders: dict[str, _Levels] = {}
        for d in devices:
            self.devices[d.key] = d
            self._add(d, sort=False)
        self._ready.sort()
        for levels in self._ready_holders.values():
            levels.sort()
        alive = [max(d.capacity, d.slow_capacity) for d in self.devices.values() if d.alive]
        self.roomiest: int | None = max(alive) if alive else None
        """The largest capacity (or slow-path capacity) of an alive device: a job within it
        is never refused (rule 7 of `placement.place`)."""

    def _add(self, d: DeviceState, sort: bool = True) -> None:
        if not _live(d):
            return
        for m in d.loaded:
            self._holders.setdefault(m.name, set()).add(d.key)
            if d.has_room:
                self._ready_holders.setdefault(m.name, _Levels()).add(d, sort)
        if d.has_room:
            self._ready.add(d, sort)

    def _remove(self, d: DeviceState) -> None:
        if not _live(d):
            return
        for m in d.loaded:
            self._holders[m.name].discard(d.key)
            if d.has_room:
                self._ready_holders[m.name].remove(d)
        if d.has_room:
            self._ready.remove(d)

    def update(self, state: DeviceState) -> None:
        """`state` replaces the device of its key (a job sent there, or it stops taking work)."""
        self._remove(self.devices[state.key])
        self.devices[state.key] = state
        self._add(state)

    def has_room(self) -> bool:
        """Whether any live device that takes work has backlog room left."""
        return bool(self._ready.levels)

    def _loaded_tier(self, job: JobRequest, key: str) -> bool:
        """Whether device `key`, which holds the job's model, offers the ``loaded`` tier: the
        job's size fits next to the engine (placement._tier_for_held)."""
        d = self.devices[key]
        held = placement.held_engine(d, job.model)  # with N slots: an idle one, or none
        return held is not None and job.estimate <= held.estimate + d.compute_figure

    def _best_loaded(self, job: JobRequest) -> str | None:
        """The best device with room offering the ``loaded`` tier: least queued, then most
        free memory, then key. A holder's tier needs estimate <= its engine + its figure, so
        a level is walked from its largest figure until one passes."""
        levels = self._ready_holders.get(job.model)
        if levels is None:
            return None
        for queued in sorted(levels.levels):
            for _, key in levels.levels[queued]:
                if self._loaded_tier(job, key):
                    return key
        return None

    def _any_loaded(self, job: JobRequest) -> bool:
        """Whether any device (with room or not) offers the job the ``loaded`` tier."""
        return any(self._loaded_tier(job, k) for k in self._holders.get(job.model, ()))

    def _fits(self, job: JobRequest) -> str | None:
        """The best device with room where `job` fits without eviction and its model is not
        held (the ``fits`` tier): least queued, then most free memory, then key."""
        holders = self._holders.get(job.model, set())
        return next(
            (
                k
                for k in self._ready.walk(job.estimate)
                # a device with N slots whose engines of the model are all busy needs a new
                # one: for this job it does not hold the model
                if k not in holders or placement.held_engine(self.devices[k], job.model) is None
            ),
            None,
        )

    def place(self, job: JobRequest, now: float) -> Outcome:
        """What `placement.place(job, every device, now)` decides (a Wait's reason aside)."""
        best = self._best_loaded(job)
        if best is not None:
            return Placed(best, TIER_LOADED)
        fits = self._fits(job)
        if fits is not None:
            return Placed(fits, TIER_FITS)
        if self._any_loaded(job):
            return Wait(f"{job.model} is loaded only on devices whose backlog is full")
        roomy = [self.devices[k] for level in self._ready.levels.values() for _, k in level]
        outcome = placement.place(job, roomy, now)
        if isinstance(outcome, Placed):
            return outcome
        return placement.place(job, list(self.devices.values()), now)

    def reserve_device(self, job: JobRequest, now: float) -> str | None:
        """`placement.reserve_device(job, every device, now)`: None at once when a device
        offers the ``loaded`` tier, else the full walk."""
        if self._any_loaded(job):
            return None
        return placement.reserve_device(job, list(self.devices.values()), now)
