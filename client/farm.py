"""The Python client: `Farm(redis_url).submit(model, prompt, ...) -> Job`, `farm.map(prompts)`
for batches, `farm.upscale(image, upscaler) -> Job` for an upscale.

A client talks to Redis only, through `sdfarm.store` (submit, wait, cancel); it never needs
the scheduler to answer it. Parameters are validated here with the engine's own rules
(sdfarm.native.params) before anything is queued, so a bad request fails in the caller's
process, not on a worker minutes later.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, replace
from typing import Any, TypeVar

import redis

from sdfarm.client.errors import (
    FarmBusyError,
    FarmError,
    FarmFullError,
    JobCancelled,
    JobFailed,
    QuotaExceededError,
    UnknownModelError,
)
from sdfarm.client.job import DEADLINE_GRACE_S, WAIT_SLICE_S, Job, Result
from sdfarm.native import enginekey, upscale_params, video_params, videofile
from sdfarm.native.decoders import resolve as resolve_decoder
from sdfarm.native.errors import InvalidParameterError
from sdfarm.native.estimate import ModelFacts, UpscalerFacts
from sdfarm.native.params import (
    NAMES,
    OPTION_NAMES,
    OPTIONS,
    PARAMS,
    JobOptions,
    check_options,
    detach_images,
    from_mapping,
    read_image_files,
    validate,
)
from sdfarm.scheduler.registry import (
    DEFAULT_QUEUE_LIMIT,
    Registry,
    farm_loras,
    farm_models,
    farm_upscalers,
    heartbeat_models,
    heartbeat_upscalers,
    model_facts,
)
from sdfarm.store import JobSpec, Store
from sdfarm.store.records import new_job_id, upscaler_key
from sdfarm.store.results import delete_job
from sdfarm.store.retry import BUDGET_S, retry_transient

__all__ = [
    "Farm",
    "FarmBusyError",
    "FarmError",
    "FarmFullError",
    "Job",
    "JobCancelled",
    "JobFailed",
    "QuotaExceededError",
    "Result",
    "UnknownModelError",
]

T = TypeVar("T")

MAP_WINDOW = 256
MODELS_CACHE_S = 1.0


class Farm:
    """A connection to a farm's Redis. Thread-safe (redis-py pools connections)."""

    def __init__(
        self,
        redis_url: str | None = None,
        *,
        submitter: str | None = None,
        deadline_grace_s: float = DEADLINE_GRACE_S,
        retry_s: float = BUDGET_S,
    ) -> None:
        url = redis_url or os.environ.get("SDFARM_REDIS_URL")
        if not url:
            raise FarmError("no farm: give Farm(redis_url) or set SDFARM_REDIS_URL")
        self.url = url
        self.store = Store.connect(url, socket_timeout=WAIT_SLICE_S + 30)
        self.submitter = submitter or os.environ.get("USER") or "anonymous"
        self.deadline_grace_s = deadline_grace_s
        self.retry_s = retry_s
        self._hb_cache: tuple[float, dict[str, dict[str, Any]]] = (-1e9, {})

    def close(self) -> None:
        self.store.close()

    def retry(self, call: Callable[[], T]) -> T:
        """`call()`, riding out a Redis that is away for up to `retry_s` seconds (a restart, a
        failover); a service answering requests sets it short, a batch long."""
        return retry_transient(call, budget_s=self.retry_s)

    def __enter__(self) -> Farm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- heartbeats -------------------------------------------------------------------------

    def _heartbeats(self, fresh: bool = False) -> dict[str, dict[str, Any]]:
        """Live heartbeats, cached for a second: a big batch must not read every heartbeat
        once per job."""
        at, cached = self._hb_cache
        if not fresh and time.monotonic() - at < MODELS_CACHE_S:
            return cached
        hbs = self.retry(self.store.heartbeats)
        self._hb_cache = (time.monotonic(), hbs)
        return hbs

    def models(self) -> list[dict[str, Any]]:
        """Every model some live worker can load: name, bytes, native size, the devices that
        have it and those that hold it loaded now; a video model also its `video` variant and
        whether it has a CLIP vision encoder (`clip_vision`: it takes input images through it)."""
        hbs = self._heartbeats(fresh=True)
        out = []
        for name in farm_models(hbs):
            facts = model_facts(hbs, name)
            assert facts is not None
            have = [k for k, hb in sorted(hbs.items()) if name in heartbeat_models(hb)]
            loaded = [
                k for k in have if any(m.get("name") == name for m in hbs[k].get("loaded") or [])
            ]
            out.append(
                {
                    "name": name,
                    "bytes": facts.bytes,
                    "native_size": list(facts.native_size),
                    "devices": have,
                    "loaded_on": loaded,
                    **({"video": facts.video} if facts.video else {}),
                    **({"clip_vision": True} if facts.vision else {}),
                }
            )
        return out

    def loras(self) -> list[str]:
        """The names of the LoRAs some live worker has, sorted."""
        return sorted(farm_loras(self._heartbeats(fresh=True)))

    def controlnets(self) -> list[str]:
        """The names of the ControlNets some live worker has, sorted."""
        hbs = self._heartbeats(fresh=True)
        return sorted({str(n) for hb in hbs.values() for n in hb.get("controlnets") or {}})

    def embeddings(self) -> list[str]:
        """The names of the textual-inversion embeddings some live worker has, sorted."""
        hbs = self._heartbeats(fresh=True)
        return sorted({str(n) for hb in hbs.values() for n in hb.get("embeddings") or {}})

    # -- submitting ---------------------------------------------------------------------------

    def submit(
        self, model: str, prompt: str, *, owner: str = "", quota: int = 0, **fields: Any
    ) -> Job:
        """Queue one job of `model`. `fields` are the generation parameters (every field of
        sdfarm.native.params.GenerationParams) and the job options (JobOptions), both listed
        below (an input image as bytes or a file path); `owner` marks who may read the job
        back through the gateway, and with `quota` > 0 may have that many live jobs at once.
        InvalidParameterError before anything is queued (an unknown name included);
        UnknownModelError when workers are up and none has `model`; FarmBusyError at the
        queue limit; QuotaExceededError when the owner is at its quota."""
        options = {k: fields.pop(k) for k in OPTION_NAMES if k in fields}
        unknown = sorted(set(fields) - set(NAMES))
        if unknown:
            raise InvalidParameterError(
                unknown[0],
                f"unknown parameter; the parameters are {', '.join(NAMES)}; the options are "
                f"{', '.join(OPTION_NAMES)}",
            )
        checked = validate(from_mapping({"prompt": prompt, **read_image_files(fields)}))
        opts = check_options(JobOptions(**options))
        facts = self._model_facts(model)
        if facts is not None and facts.video:
            raise InvalidParameterError(
                "model",
                f"{model!r} is a video model ({facts.video}): submit a video job (Farm.video)",
            )
        params, inputs = detach_images(checked)
        spec = JobSpec(model=model, params=params, owner=owner, **asdict(opts))
        spec = replace(spec, submitter=opts.submitter or self.submitter)
        return self.submit_spec(spec, inputs, quota)

    def submit_spec(
        self, spec: JobSpec, inputs: Mapping[str, bytes] | None = None, quota: int = 0
    ) -> Job:
        """Queue a JobSpec whose params and options are already validated, with its input
        images (`detach_images`) beside it; its test hook passes through to workers that
        honour hooks. Checks the model against the farm; `quota`: as `submit`'s."""
        if not isinstance(spec.model, str) or not spec.model:
            raise InvalidParameterError("model", "give a model name")
        if spec.kind != "upscale":
            # A ControlNet or embeddings make another engine of the model: the job's model
            # is that engine's key (sdfarm.native.enginekey), which placement and the
            # worker's cache go by.
            base = enginekey.parse(spec.model)
            base_model = base.model if base is not None else spec.model
            self._check_assets(spec.params)
            spec = replace(spec, model=enginekey.engine_key(base_model, spec.params))
            self._check_model(base_model)
            self._check_decoder(base_model, str(spec.params.get("decoder") or "default"))
        else:
            self._check_model(spec.model)
        self._check_loras([str(pair[0]) for pair in spec.params.get("loras") or []])
        if spec.params.get("hires_upscaler"):
            self._upscaler_facts(str(spec.params["hires_upscaler"]), "hires_upscaler")
        job_id = new_job_id()  # the same id on every try: a retry never queues twice
        try:
            queued, depth, limit = self.retry(
                lambda: self.store.submit(spec, DEFAULT_QUEUE_LIMIT, job_id, inputs, quota)
            )
        except redis.OutOfMemoryError as exc:
            why = self.store.refusing_writes() or f"Redis refused the write ({exc})"
            raise FarmFullError(f"nothing can be queued: {why}") from None
        if queued is None:
            raise FarmBusyError(depth, limit)
        return Job(self, job_id)

    def _check_model(self, model: str) -> None:
        """UnknownModelError when workers are up and none lists `model` (after a fresh look);
        with no worker up the job waits for one."""
        hbs = self._heartbeats()
        if hbs and model_facts(hbs, model) is None:
            hbs = self._heartbeats(fresh=True)
            if hbs and model_facts(hbs, model) is None:
                bad = next(
                    (
                        str(hb["bad_models"][model])
                        for hb in hbs.values()
                        if isinstance(hb.get("bad_models"), dict) and model in hb["bad_models"]
                    ),
                    None,
                )
                raise UnknownModelError(model, farm_models(hbs), bad)

    def _model_facts(self, model: str) -> ModelFacts | None:
        """The live workers' facts of `model` (None when none lists it: `submit_spec` says
        so, or the job waits for a worker)."""
        facts = model_facts(self._heartbeats(), model)
        return facts if isinstance(facts, ModelFacts) else None

    def _check_decoder(self, model: str, decoder: str) -> None:
        """InvalidParameterError naming `decoder` when the live workers' copies of `model`
        lack the decoder a job asks for (taesd without a TAESD file, vae without a full VAE;
        sdfarm.native.decoders), before anything is queued."""
        facts = self._model_facts(model)
        if facts is not None and facts.decoders:
            resolve_decoder(decoder, facts.decoders, model)

    def _check_assets(self, params: Mapping[str, Any]) -> None:
        """InvalidParameterError naming `control_net` or `embeddings` when no live worker has
        the ControlNet or an embedding a job names (after a fresh look)."""
        control = str(params.get("control_net") or "")
        names = enginekey.embedding_names(str(params.get("embeddings") or ""))
        wanted = [("control_net", "controlnets", "ControlNet", n) for n in [control] if n]
        wanted += [("embeddings", "embeddings", "embedding", n) for n in names]
        if not wanted or not self._heartbeats():
            return

        def have(field_name: str) -> set[str]:
            return {str(n) for hb in self._heartbeats().values() for n in hb.get(field_name) or {}}

        if all(n in have(f) for _, f, _, n in wanted):
            return
        if not self._heartbeats(fresh=True):
            return
        for param, field_name, kind, name in wanted:
            known = have(field_name)
            if name not in known:
                raise InvalidParameterError(
                    param,
                    f"unknown {kind} {name!r}; the farm has {', '.join(sorted(known)) or 'none'}",
                )

    def _check_loras(self, names: list[str]) -> None:
        """InvalidParameterError naming a LoRA no live worker has (after a fresh look)."""
        if not names:
            return
        missing = [n for n in names if n not in farm_loras(self._heartbeats())]
        if missing and self._heartbeats(fresh=True):
            have = farm_loras(self._heartbeats())
            missing = [n for n in names if n not in have]
            if missing:
                known = ", ".join(sorted(have)) or "none"
                raise InvalidParameterError(
                    "loras", f"unknown LoRA {missing[0]!r}; the farm has {known}"
                )

    def upscale(
        self,
        image: bytes | str | os.PathLike[str],
        upscaler: str,
        *,
        owner: str = "",
        quota: int = 0,
        **fields: Any,
    ) -> Job:
        """Queue one upscale of `image` (bytes or a file path) by `upscaler` (a name in the
        farm's upscalers/ folders); the job's result is the upscaled PNG. `fields` are the
        other upscale parameters (sdfarm.native.upscale_params: factor, tile_size) and the job
        options; `owner` and `quota` as `submit`'s. InvalidParameterError before anything is
        queued (an unknown name, a bad image, factor or tile size, an upscaler no live worker
        has included); FarmBusyError at the queue limit."""
        options = {k: fields.pop(k) for k in OPTION_NAMES if k in fields}
        values = {"image": image, "upscaler": upscaler, **fields}
        params = upscale_params.validate(
            upscale_params.from_mapping(upscale_params.read_image_file(values))
        )
        self._check_upscaler(params)
        opts = check_options(JobOptions(**options))
        doc, inputs = upscale_params.detach(params)
        spec = JobSpec(
            model=upscaler_key(params.upscaler), params=doc, kind="upscale", owner=owner,
            **asdict(opts),
        )  # fmt: skip
        spec = replace(spec, submitter=opts.submitter or self.submitter)
        return self.submit_spec(spec, inputs, quota)

    def video(
        self,
        model: str,
        prompt: str,
        *,
        owner: str = "",
        quota: int = 0,
        **fields: Any,
    ) -> Job:
        """Queue one video of `model` (a Wan model) from `prompt`; the job's result is the
        frames as PNGs then an animated WebP (`Result.frames`, `Result.webp`). `fields` are
        the other video parameters (sdfarm.native.video_params: width, height, frames (4k+1),
        fps, steps, seed, cfg_scale, sampler, scheduler, init_image, end_image as bytes or a
        path, format: webp or mp4) and the job options; `owner` and `quota` as `submit`'s.
        InvalidParameterError before anything is queued (mp4 included, when a live worker
        that has the model lacks the `video` extra); whether the model makes video (and reads
        the images given) the worker checks before any native call."""
        options = {k: fields.pop(k) for k in OPTION_NAMES if k in fields}
        values = video_params.read_image_files({"prompt": prompt, **fields})
        params = video_params.validate(video_params.from_mapping(values))
        opts = check_options(JobOptions(**options))
        facts = self._model_facts(model)
        if facts is not None and not facts.video:
            raise InvalidParameterError(
                "model", f"{model!r} is not a video model: video jobs need a Wan model"
            )
        if params.format != "webp":  # the workers encode it: their library, not ours
            workers = {
                f"{hb.get('host')}/{hb.get('device')}": hb.get("video_formats")
                for hb in self._heartbeats().values()
                if model in heartbeat_models(hb)
            }
            videofile.check_workers(params.format, workers)
        doc, inputs = video_params.detach(params)
        spec = JobSpec(model=model, params=doc, kind="video", owner=owner, **asdict(opts))
        spec = replace(spec, submitter=opts.submitter or self.submitter)
        return self.submit_spec(spec, inputs, quota)

    def _check_upscaler(self, params: upscale_params.UpscaleParams) -> None:
        """InvalidParameterError naming an upscaler no live worker has, or a factor that is
        not its scale."""
        facts = self._upscaler_facts(params.upscaler, "upscaler")
        if facts is not None:
            upscale_params.check_against(params, facts.scale)

    def _upscaler_facts(self, name: str, parameter: str) -> UpscalerFacts | None:
        """The facts of upscaler `name`; InvalidParameterError naming `parameter` when live
        workers are up and none has it (after a fresh look); None with no worker up (the job
        waits for one)."""
        facts = model_facts(self._heartbeats(), upscaler_key(name))
        if facts is None and self._heartbeats(fresh=True):
            facts = model_facts(self._heartbeats(), upscaler_key(name))
            if facts is None:
                have = ", ".join(farm_upscalers(self._heartbeats())) or "none"
                raise InvalidParameterError(
                    parameter, f"unknown upscaler {name!r}; the farm has {have}"
                )
        return facts if isinstance(facts, UpscalerFacts) else None

    def upscalers(self) -> list[dict[str, Any]]:
        """Every upscaler some live worker can load: name, bytes, scale and the devices."""
        hbs = self._heartbeats(fresh=True)
        out = []
        for name in farm_upscalers(hbs):
            facts = model_facts(hbs, upscaler_key(name))
            assert isinstance(facts, UpscalerFacts)
            have = [k for k, hb in sorted(hbs.items()) if name in heartbeat_upscalers(hb)]
            out.append({"name": name, "bytes": facts.bytes, "scale": facts.scale, "devices": have})
        return out

    def job(self, job_id: str) -> Job:
        return Job(self, job_id)

    def cancel(self, job_id: str) -> bool:
        return self.job(job_id).cancel()

    def delete(self, job_id: str, timeout: float | None = 30.0) -> bool:
        """Delete a job: its record, events and images, from whichever result store its
        record names (sdfarm.store.results). A live job is cancelled first and waited for,
        up to `timeout` seconds (TimeoutError past it). False when there was no such job."""
        got = self.retry(lambda: delete_job(self.store, job_id))
        if got < 0:
            job = self.job(job_id)
            job.cancel()
            try:
                job.wait(timeout)
            except FarmError:  # it vanished meanwhile
                return False
            got = self.retry(lambda: delete_job(self.store, job_id))
        return got > 0

    def map(
        self,
        prompts: Iterable[str | Mapping[str, Any]],
        model: str,
        *,
        window: int = MAP_WINDOW,
        **common: Any,
    ) -> Iterator[Result]:
        """Results in the order of `prompts` (a prompt, or a dict of per-item parameters with
        "prompt"), with at most `window` jobs of this call queued or running at once, so a
        million prompts never fill the farm's queue and other submitters keep their share.
        Raises the first JobFailed in order (like Executor.map); closing the iterator early
        cancels what it had in flight. A busy farm makes it wait for its own jobs first."""
        if window < 1:
            raise ValueError("window must be at least 1")
        items = iter(prompts)
        flying: deque[Job] = deque()
        held: str | Mapping[str, Any] | None = None
        exhausted = False
        try:
            while True:
                while not exhausted and len(flying) < window:
                    item = held if held is not None else next(items, None)
                    held = None
                    if item is None:
                        exhausted = True
                        break
                    kwargs = dict(common)
                    if isinstance(item, Mapping):
                        kwargs.update(item)
                    else:
                        kwargs["prompt"] = item
                    try:
                        flying.append(self.submit(model, **kwargs))
                    except FarmBusyError:
                        if not flying:
                            raise
                        held = item
                        break
                if not flying:
                    return
                yield flying.popleft().result()
        finally:
            for job in flying:
                with contextlib.suppress(Exception):  # best effort while unwinding
                    job.cancel()

    # -- status -------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Devices (heartbeat, figures, what runs there), queue depth by priority, running
        jobs, the leader and the config: one JSON-ready document for `sdfarm status`."""
        snap = Registry(self.store).snapshot()
        queues = self.store.queues()
        devices = []
        for state in snap.devices:
            hb = snap.heartbeats.get(state.key, {})
            devices.append(
                {
                    **hb,
                    "key": state.key,
                    "host": state.host,
                    "device": state.device,
                    "alive": state.alive,
                    "figure": state.compute_figure if state.alive else None,
                    "slow_figure": state.slow_figure if state.alive else None,
                    "capacity": state.capacity if state.alive else None,
                    "queued": len(snap.running.get(state.key, {})),
                    "jobs": sorted(snap.running.get(state.key, {})),
                }
            )
        running = [
            {"id": j, **{k: snap.jobs[j].get(k, "") for k in ("state", "device", "model",
                                                              "submitter", "priority")}}
            for j in sorted(snap.jobs)
        ]  # fmt: skip
        return {
            "leader": queues["leader"],
            "config": queues["config"],
            "devices": devices,
            "queues": queues["queues"],
            "pending": queues["pending"],
            "running": running,
        }


def _parameter_help() -> str:
    lines = ["", "Generation parameters (keyword arguments):"]
    lines += [
        f"    {p.name}: {p.help} ({p.range_text}"
        + (")" if p.required else f"; default {p.default!r})")
        for p in PARAMS
    ]
    lines += ["", "Options:"]
    lines += [f"    {p.name}: {p.help} ({p.range_text})" for p in OPTIONS]
    return "\n".join(lines)


Farm.submit.__doc__ = (Farm.submit.__doc__ or "") + "\n" + _parameter_help()
