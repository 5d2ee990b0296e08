"""The farm as the scheduler sees it: every heartbeat turned into a placement `DeviceState`.

Workers write one heartbeat per device (sdfarm.store.records.HEARTBEAT_FIELDS, with a TTL);
the scheduler owns `running:{device}` (job id -> dispatch id), so a device's queued work is
counted from the scheduler's own writes and never lags a heartbeat. The conversions are pure
functions (tested in tests/unit/test_registry.py); `Registry.snapshot` is the only I/O: one
`Store.snapshot` per scheduler cycle.

A heartbeat carries the figures its worker computed (capacity, compute_figure, slow_figure,
with the worker's --memory-limit applied): the worker knows its device and its engines, so
they are taken as they are. A field missing from a heartbeat counts as nothing (0, no engines,
no models): a document that is not our worker's gets no jobs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from sdfarm.native import enginekey
from sdfarm.native.controlnets import CONTROL_HEADS
from sdfarm.native.estimate import Facts, ModelFacts, UpscalerFacts
from sdfarm.scheduler.placement import DeviceState, LoadedModel
from sdfarm.store import FarmReading, Store
from sdfarm.store.records import upscaler_name

DEFAULT_BACKLOG = 2
DEFAULT_QUEUE_LIMIT = 10_000


# -- pure conversions ---------------------------------------------------------------------------


def _int(value: Any, default: int = 0) -> int:
    try:
        return max(0, int(value))
    except (TypeError, ValueError):
        return default


def device_type(hb: Mapping[str, Any]) -> str:
    """Placement knows cpu / gpu / igpu; an accelerator computes like a discrete GPU."""
    t = str(hb.get("type") or "cpu").lower()
    return "gpu" if t == "accel" else t if t in ("cpu", "gpu", "igpu") else "cpu"


def loaded_models(hb: Mapping[str, Any]) -> tuple[LoadedModel, ...]:
    """The engines a heartbeat lists (`loaded`: [{name, estimate, busy, pinned, idle_since}])."""
    out = []
    for m in hb.get("loaded") or []:
        if not isinstance(m, Mapping) or not m.get("name"):
            continue
        try:
            idle = float(m.get("idle_since") or 0.0)
        except (TypeError, ValueError):
            idle = 0.0
        out.append(
            LoadedModel(
                name=str(m["name"]),
                estimate=_int(m.get("estimate")),
                busy=bool(m.get("busy")),
                pinned=bool(m.get("pinned")),
                idle_since=idle,
            )
        )
    return tuple(sorted(out, key=lambda m: m.name))


def device_state(
    key: str, hb: Mapping[str, Any], *, queued: int = 0, backlog_limit: int = DEFAULT_BACKLOG
) -> DeviceState:
    """One live heartbeat as placement's `DeviceState`, with the worker's own figures."""
    host, _, device = key.partition("/")
    compute = _int(hb.get("compute_figure"))
    slots = max(1, _int(hb.get("slots"), 1))
    return DeviceState(
        host=str(hb.get("host") or host),
        device=str(hb.get("device") or device),
        type=device_type(hb),
        compute_figure=compute,
        slow_figure=max(_int(hb.get("slow_figure")), compute),
        capacity=max(_int(hb.get("capacity")), compute),
        loaded=loaded_models(hb),
        queued=queued,
        backlog_limit=backlog_limit + slots - 1,  # N running at once, then the backlog
        alive=True,
        accepting=bool(hb.get("accepting", True)),
        slots=slots,
    )


def dead_state(key: str, queued: int = 0, backlog_limit: int = DEFAULT_BACKLOG) -> DeviceState:
    """A device whose heartbeat expired: placement skips it and a refusal counts it as dead."""
    host, _, device = key.partition("/")
    return DeviceState(
        host=host,
        device=device,
        type="cpu",
        compute_figure=0,
        slow_figure=0,
        capacity=0,
        queued=queued,
        backlog_limit=backlog_limit,
        alive=False,
    )


def account(
    state: DeviceState, model: str, estimate: int, evict: Iterable[str] = (), sent: int = 1
) -> DeviceState:
    """The device as it will be once a job for `model` runs there, before any heartbeat says
    so: `sent` more queued jobs, `evict`ed engines gone, the model counted as loaded (busy) and
    its estimate taken from the figures. Used for every job sent in a pass and for jobs already
    sent whose model the heartbeat does not list yet, so two jobs of one model go where the
    first one's load is, and two new models are not put on a device that holds one."""
    # One engine per name evicted (with N slots a model may be loaded more than once, and
    # placement names each engine it evicts); idle ones first, as the worker evicts.
    evicted = list(evict)
    kept, gone = [], 0
    for m in sorted(state.loaded, key=lambda m: m.busy):
        if m.name in evicted and (state.slots == 1 or not m.busy):
            evicted.remove(m.name)
            gone += m.estimate
        else:
            kept.append(m)
    taken = 0
    if state.slots > 1:
        kept, taken = _engine_per_job(kept, model, estimate)
    elif any(m.name == model for m in kept):
        kept = [replace(m, busy=True) if m.name == model else m for m in kept]
    else:
        kept.append(LoadedModel(model, max(0, estimate), busy=True))
        taken = max(0, estimate)
    return replace(
        state,
        loaded=tuple(sorted(kept, key=lambda m: m.name)),
        queued=state.queued + sent,
        compute_figure=max(0, state.compute_figure + gone - taken),
        slow_figure=max(0, state.slow_figure + gone - taken),
    )


def account_sent(state: DeviceState, sent: Iterable[tuple[str, int]]) -> DeviceState:
    """`account(state, model, estimate, sent=0)` for each (model, estimate) in turn, built
    once: every cycle does this for every job already sent to every device, and a copy of
    the device per job was most of reading a large farm."""
    if state.slots > 1:
        return _account_slots(state, sent)
    kept = list(state.loaded)
    names = {m.name for m in kept}
    busy: set[str] = set()
    taken = 0
    for model, estimate in sent:
        if model in names:
            busy.add(model)
        else:
            kept.append(LoadedModel(model, max(0, estimate), busy=True))
            names.add(model)
            taken += max(0, estimate)
    if not busy and not taken and len(kept) == len(state.loaded):
        return state
    kept = [replace(m, busy=True) if m.name in busy and not m.busy else m for m in kept]
    return replace(
        state,
        loaded=tuple(sorted(kept, key=lambda m: m.name)),
        compute_figure=max(0, state.compute_figure - taken),
        slow_figure=max(0, state.slow_figure - taken),
    )


def _engine_per_job(
    kept: list[LoadedModel], model: str, estimate: int
) -> tuple[list[LoadedModel], int]:
    """With N slots each job runs on an engine of its own: an idle engine of its model turns
    busy, else a new busy engine of `estimate` bytes is counted (the bytes taken)."""
    for i, m in enumerate(kept):
        if m.name == model and not m.busy:
            kept = [*kept[:i], replace(m, busy=True), *kept[i + 1 :]]
            return kept, 0
    return [*kept, LoadedModel(model, max(0, estimate), busy=True)], max(0, estimate)


def _account_slots(state: DeviceState, sent: Iterable[tuple[str, int]]) -> DeviceState:
    """`account_sent` on a device with N slots. The heartbeat's busy engines run jobs that
    are among those sent (running); the other sent jobs each take an idle engine of their
    model, else a new one, counted at its estimate. Cautious on purpose: a job may reach a
    slot that does not hold its model and load it again (the worker then evicts the idle
    copy), and a job in the backlog behind N running ones is counted as an engine too."""
    per_model: dict[str, list[int]] = {}
    for model, estimate in sent:
        per_model.setdefault(model, []).append(estimate)
    kept = list(state.loaded)
    taken = 0
    for model, estimates in sorted(per_model.items()):
        running = sum(1 for m in kept if m.name == model and m.busy)
        for estimate in estimates[running:]:
            kept, took = _engine_per_job(kept, model, estimate)
            taken += took
    if not taken and kept == list(state.loaded):
        return state
    return replace(
        state,
        loaded=tuple(sorted(kept, key=lambda m: m.name)),
        compute_figure=max(0, state.compute_figure - taken),
        slow_figure=max(0, state.slow_figure - taken),
    )


def heartbeat_models(hb: Mapping[str, Any]) -> dict[str, ModelFacts]:
    """{name: ModelFacts} of the models a heartbeat's worker can load (malformed entries are
    left out: that worker is not asked to load them)."""
    out = {}
    for name, doc in (hb.get("models") or {}).items():
        try:
            out[str(name)] = ModelFacts.from_json(doc)
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
    return out


def heartbeat_upscalers(hb: Mapping[str, Any]) -> dict[str, UpscalerFacts]:
    """{name: UpscalerFacts} of the upscalers a heartbeat's worker can load (malformed
    entries left out)."""
    out = {}
    for name, doc in (hb.get("upscalers") or {}).items():
        try:
            out[str(name)] = UpscalerFacts.from_json(doc)
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
    return out


class Catalogs:
    """Parsed `models` documents, kept by the document's identity: the store hands every
    heartbeat of one catalog the same object for as long as the catalog is unchanged, so
    each is parsed once, not once per device per cycle. Holding the document keeps its id
    from being reused by another object."""

    LIMIT = 4096

    def __init__(self) -> None:
        self._parsed: dict[int, tuple[Any, dict[str, ModelFacts]]] = {}

    def models(self, hb: Mapping[str, Any]) -> dict[str, ModelFacts]:
        """`heartbeat_models(hb)`, parsed once per catalog document."""
        doc = hb.get("models")
        got = self._parsed.get(id(doc))
        if got is None or got[0] is not doc:
            if len(self._parsed) >= self.LIMIT:
                self._parsed.clear()
            got = (doc, heartbeat_models(hb))
            self._parsed[id(doc)] = got
        return got[1]


def facts_index(
    heartbeats: Mapping[str, Mapping[str, Any]], catalogs: Catalogs | None = None
) -> dict[str, ModelFacts]:
    """{name: `model_facts(heartbeats, name)`} for every model some live worker has, made in
    one pass over the distinct catalogs (heartbeats sharing one `models` document count once:
    the cautious facts are a max and a min, so repeats change nothing, and the first of
    equal native areas stays first)."""
    catalogs = catalogs or Catalogs()
    distinct: dict[int, Mapping[str, Any]] = {}
    for hb in heartbeats.values():
        distinct.setdefault(id(hb.get("models")), hb)
    found: dict[str, list[ModelFacts]] = {}
    for hb in distinct.values():
        for name, facts in catalogs.models(hb).items():
            found.setdefault(name, []).append(facts)
    return {name: ModelFacts.cautious(facts) for name, facts in found.items()}


def model_facts(heartbeats: Mapping[str, Mapping[str, Any]], name: str) -> Facts | None:
    """The facts of engine `name` (a model, or `upscaler:NAME`) valid on every device that
    lists it (`cautious`: one estimate per job, whichever of those devices gets it); None
    when no live worker has it."""
    upscaler = upscaler_name(name)
    if upscaler is not None:
        ups = [f for hb in heartbeats.values() if (f := heartbeat_upscalers(hb).get(upscaler))]
        return UpscalerFacts.cautious(ups) if ups else None
    if enginekey.is_key(name):
        return key_facts(heartbeats, name, lambda m: model_facts(heartbeats, m))
    found = [f for hb in heartbeats.values() if (f := heartbeat_models(hb).get(name))]
    return ModelFacts.cautious(found) if found else None


def key_facts(
    heartbeats: Mapping[str, Mapping[str, Any]], name: str, base: Any
) -> ModelFacts | None:
    """The facts of an engine key (sdfarm.native.enginekey: a model with a ControlNet,
    embeddings or the TAESD as decoder): its model's facts (`base(model)`) with the
    ControlNet's and the embeddings' bytes added, the largest copy any live worker lists, and
    the TAESD's decode term for a TAESD engine; None when one part is unknown (a TAESD engine
    of a model whose live copies do not all have a TAESD included)."""
    key = enginekey.parse(name)
    facts = base(key.model) if key is not None else None
    if key is None or not isinstance(facts, ModelFacts):
        return None
    if key.decoder and key.decoder not in facts.decoders:
        return None
    facts = facts.with_decoder(key.decoder)
    controlnets: dict[str, int] = {}
    embeddings: dict[str, int] = {}
    for hb in heartbeats.values():
        for field_name, into in (("controlnets", controlnets), ("embeddings", embeddings)):
            for n, size in (hb.get(field_name) or {}).items():
                into[str(n)] = max(into.get(str(n), 0), _int(size))
    extra = enginekey.extra_bytes(key, controlnets, embeddings)
    if extra is None:
        return None
    return facts.with_extras(extra, CONTROL_HEADS if key.control_net else 0)


def farm_upscalers(heartbeats: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Every upscaler some live worker can load."""
    return sorted({n for hb in heartbeats.values() for n in heartbeat_upscalers(hb)})


def farm_loras(heartbeats: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    """{name: bytes} of every LoRA some live worker can apply (the largest copy)."""
    out: dict[str, int] = {}
    for hb in heartbeats.values():
        for name, size in (hb.get("loras") or {}).items():
            out[str(name)] = max(out.get(str(name), 0), _int(size))
    return out


def farm_models(heartbeats: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Every model some live worker can load."""
    return sorted({n for hb in heartbeats.values() for n in heartbeat_models(hb)})


# -- the snapshot --------------------------------------------------------------------------------


@dataclass
class Snapshot:
    """The farm at one instant, for one scheduler cycle (or `sdfarm status`): the store's
    `FarmReading` plus a DeviceState for every known device (dead ones with alive=False), with
    the jobs already sent there accounted."""

    heartbeats: dict[str, dict[str, Any]] = field(default_factory=dict)
    devices: list[DeviceState] = field(default_factory=list)
    running: dict[str, dict[str, str]] = field(default_factory=dict)
    jobs: dict[str, dict[str, str]] = field(default_factory=dict)
    heads: dict[int, list[str]] = field(default_factory=dict)
    head_fields: dict[str, list[str]] = field(default_factory=dict)
    now: float = 0.0
    catalogs: Catalogs | None = field(default=None, repr=False)
    _facts: dict[str, ModelFacts] | None = field(default=None, init=False, repr=False)
    _loras: dict[str, int] | None = field(default=None, init=False, repr=False)

    def _index(self) -> dict[str, ModelFacts]:
        """Every model's facts, made once per snapshot (a cycle asks per model and size)."""
        if self._facts is None:
            self._facts = facts_index(self.heartbeats, self.catalogs)
        return self._facts

    def model_facts(self, name: str) -> Facts | None:
        if upscaler_name(name) is not None:
            return model_facts(self.heartbeats, name)
        if enginekey.is_key(name):
            return key_facts(self.heartbeats, name, self._index().get)
        return self._index().get(name)

    def models(self) -> list[str]:
        return sorted(self._index())

    def loras(self) -> dict[str, int]:
        if self._loras is None:
            self._loras = farm_loras(self.heartbeats)
        return self._loras

    def running_by_submitter(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for job in self.jobs.values():
            s = job.get("submitter", "")
            counts[s] = counts.get(s, 0) + 1
        return counts


def build_devices(
    heartbeats: Mapping[str, Mapping[str, Any]],
    known: Iterable[str],
    running: Mapping[str, Mapping[str, str]],
    jobs: Mapping[str, Mapping[str, str]],
    backlog_limit: int = DEFAULT_BACKLOG,
    cache: dict[str, tuple[Any, tuple[Any, ...], DeviceState]] | None = None,
) -> list[DeviceState]:
    """Every known device as a DeviceState, sorted by key; a live device's queued count is
    its `running:{device}` length less the jobs its worker claimed ahead (`ahead`: taken
    from its queue and held as its next run, sdfarm.worker.chain: the queue behind them is
    empty, and the next message must be there before that job begins, or the engine waits
    for it), and models of jobs sent there that its heartbeat does not
    list are counted as loading (`account` with sent=0). With `cache` (kept by the caller
    between cycles), a device whose heartbeat is the same object and whose sent jobs are
    the same as last time keeps its DeviceState instead of being built again."""
    out = []
    for key in sorted(set(known) | set(heartbeats)):
        entries = running.get(key, {})
        hb = heartbeats.get(key)
        if hb is None:
            out.append(dead_state(key, len(entries), backlog_limit))
            continue
        sent = [(j, jobs.get(j) or {}) for j in sorted(entries)]
        sig = (backlog_limit, *((j, job.get("model"), job.get("state"), job.get("estimate"),
                                 bool(job.get("ahead"))) for j, job in sent))  # fmt: skip
        seen = cache.get(key) if cache is not None else None
        if seen is not None and seen[0] is hb and seen[1] == sig:
            out.append(seen[2])
            continue
        waiting = sum(1 for _, job in sent if not job.get("ahead"))
        state = device_state(key, hb, queued=waiting, backlog_limit=backlog_limit)
        state = account_sent(
            state,
            [
                (job["model"], _int(job.get("estimate")))
                for _, job in sent
                if job.get("model") and job.get("state") in ("placed", "running")
            ],
        )
        if cache is not None:
            cache[key] = (hb, sig, state)
        out.append(state)
    if cache is not None and len(cache) > len(out):
        live = {d.key for d in out}
        for key in [k for k in cache if k not in live]:
            del cache[key]
    return out


def snapshot_of(
    reading: FarmReading,
    backlog_limit: int = DEFAULT_BACKLOG,
    cache: dict[str, tuple[Any, tuple[Any, ...], DeviceState]] | None = None,
    catalogs: Catalogs | None = None,
) -> Snapshot:
    devices = build_devices(
        reading.heartbeats, reading.known, reading.running, reading.jobs, backlog_limit, cache
    )
    return Snapshot(
        catalogs=catalogs,
        heartbeats=reading.heartbeats,
        devices=devices,
        running=reading.running,
        jobs=reading.jobs,
        heads=reading.heads,
        head_fields=reading.head_fields,
        now=reading.now,
    )


class Registry:
    """Reads the farm's state through the store."""

    def __init__(self, store: Store, backlog_limit: int = DEFAULT_BACKLOG) -> None:
        self.store = store
        self.backlog_limit = backlog_limit
        self._states: dict[str, tuple[Any, tuple[Any, ...], DeviceState]] = {}
        self._catalogs = Catalogs()

    def snapshot(self, heads: int = 0, clear_wake: bool = False, facts: int = 4) -> Snapshot:
        """The farm now (`Store.snapshot`) as placement sees it; what did not change since
        the last snapshot (heartbeats, catalogs, devices) is reused, not rebuilt."""
        reading = self.store.snapshot(heads=heads, clear_wake=clear_wake, facts=facts)
        return snapshot_of(reading, self.backlog_limit, self._states, self._catalogs)
