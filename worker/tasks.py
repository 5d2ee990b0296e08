"""The generate task: one Celery message = "run job X under dispatch D" on this device.

The message carries only ids; the job itself is read from Redis after an atomic claim, so a
message that outlived its placement (the job was re-placed, cancelled or already ran) is
dropped without a trace. Everything a user sent is checked again here before any native call
(the runtime aborts the process on some inputs) and model names resolve only through the
worker's model directories. A job that fails for a reason of its own (bad parameters, a model
that does not load or fit, a runtime error) fails alone: the worker goes on with the next.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any

from sdfarm.native import enginekey, images, logs, upscale_params, video_params, videofile
from sdfarm.native.controlnets import CONTROL_HEADS
from sdfarm.native.decoders import resolve as resolve_decoder
from sdfarm.native.engine import LogConfig, ModelWith, NativeOutput, check_extras, extras_bytes
from sdfarm.native.errors import EngineError, InvalidParameterError, ModelTooLargeError
from sdfarm.native.estimate import model_facts, upscaler_facts
from sdfarm.native.gate import GATE
from sdfarm.native.params import IMAGE_PARAMS, attach_images, from_mapping, validate
from sdfarm.native.preview import Preview
from sdfarm.native.tiling import TilingPlan
from sdfarm.native.video import refuse_video_model, require_video_model
from sdfarm.store import Claim, JobSpec
from sdfarm.store.records import JOB_KINDS, upscaler_key
from sdfarm.store.retry import retry_transient
from sdfarm.worker import chain, hooks
from sdfarm.worker.results import Finished, Later

log = logging.getLogger("sdfarm.worker")

PROGRESS_MIN_INTERVAL = 0.1  # at most 10 progress writes per second
PREVIEW_MIN_INTERVAL = 0.1  # at most 10 preview writes per second (each <= 32 KiB)
CANCEL_POLL_S = 0.2
CANCEL_EXIT_CODE = 0  # a cancel is not a crash; Celery replaces the process either way


def run_job(job_id: str, dispatch: str) -> None:
    """The Celery task TASK_NAME (registered by sdfarm.worker.app.make_app): its job, then the
    device's next jobs taken straight from its queue while there are any (sdfarm.worker.chain:
    no Celery round between two generations), each taken and prepared during the native call
    of the one before when the chain looks ahead."""
    ctx = hooks.context()
    links = chain.for_context(ctx, lambda m: JobRun.ahead_of(ctx, m), JobRun.give_back)
    try:
        JobRun(ctx, str(job_id), str(dispatch), links=links).run()
        while links is not None and (found := links.next()) is not None:
            message, ready = found
            run = ready or JobRun(ctx, message.job_id, message.dispatch, chained=True)
            run.links = links
            run.run()
    finally:
        GATE.open()  # nothing more to start: the helper threads need not hold off


class NotAhead(Exception):
    """A job that cannot be prepared ahead (its engine is not the one loaded): it is prepared
    when it starts."""


@dataclass
class Ahead:
    """A job prepared during the native call before it, from its claim taken ahead: its
    spec, its engine (held) and its call."""

    spec: JobSpec
    engine: Any
    call: Callable[[], Any]


class JobRun:
    """One run of one job in this worker process."""

    def __init__(
        self,
        ctx: hooks.Context,
        job_id: str,
        dispatch: str,
        chained: bool = False,
        links: chain.Chain | None = None,
    ) -> None:
        self.ctx = ctx
        self.links = links
        self._ahead: Ahead | None = None
        self._claimed_ahead: Claim | None = None  # claimed during the job before it
        self._began = False
        self._cancel_at_start = False
        self._loaded_only = False
        self.job_id = job_id
        self.dispatch = dispatch
        self.store = ctx.store
        self.timings: dict[str, float] = {"load_s": 0.0}
        self.meta: dict[str, Any] = {
            "job": job_id,
            "host": ctx.config.host,
            "device": ctx.config.device.name,
            "device_key": ctx.config.device_key,
            "incarnation": ctx.incarnation,
            # Taken by the slot itself after its last job (sdfarm.worker.chain), not by Celery.
            **({"chained": True} if chained else {}),
        }
        self.level = "none"
        self.log_prompts = False
        self._last_pub = 0.0
        self._last_step: tuple[int, int] | None = None
        self._last_preview = 0.0
        self._cancel_lock = threading.Lock()

    # -- the run ---------------------------------------------------------------------------

    def run(self) -> None:
        ctx = self.ctx
        self._t0 = time.monotonic()
        self.timings["begun_at"] = round(time.time(), 6)  # the worker's clock, epoch seconds
        # Every write on the job's path rides out a Redis restart (retry_transient): a blip
        # must not fail the job, nor leave it claimed by nobody.
        try:
            if self._claimed_ahead is not None:
                claimed = self._claimed_ahead
                self.meta["claimed_ahead"] = True  # no claim between it and the job before
                self._begin()
            else:
                claimed = retry_transient(
                    lambda: self.store.claim(
                        self.job_id, self.dispatch, ctx.incarnation, ctx.worker_name
                    )
                )
                if claimed is not None:  # an abort from here on is this job's
                    ctx.start_mark.write(self.job_id, self.dispatch)
            if claimed is None:
                log.info(
                    "dropped a stale message for job %s (dispatch %s)", self.job_id, self.dispatch
                )
                return
            ctx.set_state("busy", self.job_id)
            try:
                self._run(claimed)
            except Exception as exc:  # noqa: BLE001 - a bug fails this job, not the worker
                log.exception("job %s failed inside the worker", self.job_id)
                self._fail(f"internal error in the worker: {type(exc).__name__}: {exc}")
            finally:
                ctx.set_state("idle")
        finally:
            self.discard_ahead()

    def _run(self, claimed: Claim) -> None:
        self.timings["queued_s"] = round(max(0.0, claimed.started - claimed.created), 4)
        try:
            spec_doc = json.loads(claimed.spec or "{}")
            if not isinstance(spec_doc, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            self._fail(f"invalid job spec: {exc}")
            return
        hook = hooks.test_hook(spec_doc)
        if hook == "abort":
            self.ctx.uploader.flush(10.0)
            log.warning("test hook: aborting the process in job %s", self.job_id)
            os.abort()
        if claimed.cancelled or self._cancel_at_start:
            self._end("cancelled")
            return
        try:
            if (ahead := self._take_ahead()) is not None:
                spec, engine, call = ahead.spec, ahead.engine, ahead.call
                self.meta["ahead"] = True  # prepared during the native call before it
            else:
                spec = _job_spec(spec_doc)
                engine, call = self._prepare(spec, claimed)
        except EngineError as exc:
            self._fail(str(exc), _error_records(exc), self._refusal_fields(exc))
            return
        try:
            self._execute(spec.model, engine, call, hook)
        except EngineError as exc:
            if engine.poisoned:
                self.ctx.cache.drop(spec.model)
            self._fail(
                str(exc),
                self._load_records(spec.model) + _error_records(exc),
                self._refusal_fields(exc),
            )
        finally:
            self.ctx.cache.release(spec.model)

    def _prepare(self, spec: JobSpec, claimed: Claim) -> tuple[Any, Callable[[], Any]]:
        """The job's checked parameters, model and engine (held): (engine, the call)."""
        self.meta["model"] = spec.model
        self.level = spec.log_level
        self.log_prompts = spec.log_prompts
        prepare = {"upscale": self._prepare_upscale, "video": self._prepare_video}.get(
            spec.kind, self._prepare_generate
        )
        return prepare(spec, claimed)

    def _engine(self, name: str, model: Any, resident: int, need: int) -> Any:
        """The engine `name` for this job, held until `cache.release(name)`: loaded when
        absent, except ahead of the job's start, when only the loaded one will do."""
        if not self._loaded_only:
            return self.ctx.request_engine(name, model, resident, self.job_id, need)
        engine = self.ctx.cache.get_loaded(name, max(resident, need))
        if engine is None:
            raise NotAhead(name)
        return engine

    # -- lookahead (sdfarm.worker.chain) ------------------------------------------------------

    @classmethod
    def ahead_of(cls, ctx: hooks.Context, message: Any) -> JobRun:
        """The run of the job of `message`, taken during the native call before it, prepared
        as far as it can be without a claim (on the lookahead thread)."""
        run = cls(ctx, message.job_id, message.dispatch, chained=True)
        run.prepare_ahead()
        return run

    def prepare_ahead(self) -> None:
        """Claim the job ahead and prepare it as its start would: its spec, checked
        parameters, inputs and model, and its engine when that one is loaded. The claim
        (store/lua/claim_ahead.lua) keeps the Redis round trip of a claim off the path between
        two images; the job counts as begun only when its run does (`_begin`). Anything that
        stops the preparation (a test hook, bad input, an engine to load) leaves the job to
        be prepared when it starts, where its errors are reported."""
        ctx = self.ctx
        try:
            claim = self.store.claim_ahead(
                self.job_id, self.dispatch, ctx.incarnation, ctx.worker_name,
                ctx.config.device_key, str(ctx.slot),
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - claimed when it starts (claim.lua takes it)
            log.warning("job %s not claimed ahead: %s", self.job_id, exc)
            return
        if claim is None:
            return  # a stale message: dropped when it comes up
        self._claimed_ahead = claim
        cancel_watch().ahead = self
        try:
            doc = json.loads(claim.spec or "{}")
            if not isinstance(doc, dict) or hooks.test_hook(doc):
                return
            spec = _job_spec(doc)
            self._loaded_only = True
            engine, call = self._prepare(spec, claim)
            self._ahead = Ahead(spec, engine, call)
        except Exception as exc:  # noqa: BLE001 - prepared again, and reported, at its start
            log.debug("job %s not prepared ahead: %s", self.job_id, exc)
        finally:
            self._loaded_only = False

    def _begin(self) -> None:
        """The run of a job claimed ahead begins: marked in this slot's start mark first (an
        abort from here on is charged to this job: sdfarm.worker.startmark), then in Redis by
        the lookahead thread, off the path (`store.start`)."""
        self._began = True
        self.ctx.start_mark.write(self.job_id, self.dispatch)
        watch = cancel_watch()
        if watch.ahead is self:
            watch.ahead = None
        if hooks.test_hooks_enabled():
            self._abort_at_start_hook()
        if self.links is not None:
            self.links.run_ahead(self._record_start)
        else:  # not chained: nothing claims ahead then, but the start is still written
            self._record_start()

    def _abort_at_start_hook(self) -> None:
        """The test hook "abort-at-start": the process ends as the job begins, its start
        only in the start mark (the results before it written first)."""
        doc = json.loads(self._claimed_ahead.spec or "{}") if self._claimed_ahead else {}
        if hooks.test_hook(doc) == "abort-at-start":
            self.ctx.uploader.flush(10.0)
            log.warning("test hook: aborting the process as job %s begins", self.job_id)
            os.abort()

    def _record_start(self) -> None:
        """On the lookahead thread: the job's start in Redis (its `ahead` cleared, `started`,
        the running event). A cancel that came since it was claimed ends it before its native
        call when the answer is in by then; after that the cancel watch ends it."""
        ctx = self.ctx
        GATE.wait()  # once the native call began (or soon after): the job thread first
        try:
            cancelled = retry_transient(
                lambda: self.store.start(
                    self.job_id, self.dispatch, ctx.incarnation, ctx.worker_name
                )
            )
        except Exception as exc:  # noqa: BLE001 - its finish still ends it
            log.warning("start of job %s not recorded: %s", self.job_id, exc)
            return
        if cancelled:
            self._cancel_at_start = True

    def _take_ahead(self) -> Ahead | None:
        """The job as prepared ahead (from the claim it runs under, taken ahead), when its
        engine is still loaded and usable; otherwise None (and the engine released)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        if self.ctx.cache.holds(ahead.spec.model, ahead.engine):
            return ahead
        self.ctx.cache.release(ahead.spec.model)
        return None

    def discard_ahead(self) -> None:
        """Release the engine of a job prepared ahead that will not run here (its message was
        stale or given back, its claim found it cancelled)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            self.ctx.cache.release(ahead.spec.model)

    def give_back(self) -> None:
        """This job, claimed ahead, will not run in this process (its worker is stopping): its
        engine released and the job placed again, before its message is put back."""
        self.discard_ahead()
        if self._claimed_ahead is None or self._began:
            return
        watch = cancel_watch()
        if watch.ahead is self:
            watch.ahead = None
        ctx = self.ctx
        try:
            self.store.unclaim(self.job_id, self.dispatch, ctx.config.device_key, str(ctx.slot))
        except Exception as exc:  # noqa: BLE001 - the next process of the slot settles it
            log.warning("job %s claimed ahead not given back: %s", self.job_id, exc)

    def _prepare_generate(self, spec: JobSpec, claimed: Claim) -> tuple[Any, Callable[[], Any]]:
        """A generation's checked parameters, model, LoRAs and engine: (engine, the call)."""
        params = validate(from_mapping(self._with_inputs(spec.params)))
        # The job's model may be an engine key (sdfarm.native.enginekey): the model with a
        # ControlNet, embeddings or the TAESD as decoder, which its engine is loaded with.
        # (Not a key: taken as a model's name, which the catalog refuses when it is not one.)
        key = enginekey.parse(spec.model) or enginekey.EngineKey(spec.model)
        enginekey.check_key(spec.model, key.model, asdict(params))
        if not key.plain:  # the result names the model, and the engine it ran on
            self.meta.update(model=key.model, engine=spec.model)
        model = self.ctx.catalog.load(key.model)
        refuse_video_model(model)  # before its engine loads: it makes no images
        control_net = self.ctx.controlnets.load(key.control_net) if key.control_net else None
        embeddings = tuple(self.ctx.embeddings.load(n) for n in key.embeddings)
        check_extras(model, control_net, embeddings)
        # Refused before any load when this copy of the model lacks the decoder asked for.
        decoder = resolve_decoder(params.decoder, model.decoders, model.name)
        facts = model_facts(model, self.ctx.config.device, decoder)
        heads = CONTROL_HEADS if control_net is not None else 0
        facts = facts.with_extras(extras_bytes(control_net, embeddings), heads)
        if not key.plain:
            model = ModelWith(model, control_net, embeddings, key.decoder)
        loras = {name: self.ctx.loras.load(name) for name, _ in params.loras}
        extra = sum(f.size for f in loras.values())
        ups = {}
        if params.hires_upscaler:
            file = ups[params.hires_upscaler] = self.ctx.upscalers.load(params.hires_upscaler)
            hires = upscaler_facts(file.size, file.scale, self.ctx.config.device.name)
            extra += hires.working(params.width, params.height, params.hires_tile_size)
        # The job's estimate as the scheduler placed it (sdfarm.native.estimate): the
        # cache makes room for it and the engine checks it, so all three agree. So does
        # its VAE tiling plan (sdfarm.native.tiling), which the engine obeys.
        tiling: TilingPlan | None = _tiling_plan(claimed.tiling)
        need = claimed.estimate or facts.estimate(
            *params.final_size, params.encodes, extra, tiled=bool(tiling and tiling.tiled),
            batch=params.batch_count,
        )  # fmt: skip
        engine = self._engine(spec.model, model, facts.resident(), need)
        log_config = LogConfig(level=self.level, log_prompts=self.log_prompts)
        try:  # every check of the engine's, here: ahead of the start when looking ahead
            prepared = engine.prepare(
                params, progress=self._progress,
                preview=self._preview if params.preview_every else None,
                log=log_config, estimate=need, loras=loras, upscalers=ups, tiling=tiling,
            )  # fmt: skip
        except BaseException:
            self.ctx.cache.release(spec.model)
            raise
        return engine, lambda: engine.run_prepared(prepared)

    def _prepare_upscale(self, spec: JobSpec, claimed: Claim) -> tuple[Any, Callable[[], Any]]:
        """An upscale's checked parameters, upscaler file and engine (`upscaler:NAME` in the
        cache): (engine, the call)."""
        inputs = retry_transient(lambda: self.store.inputs(self.job_id))
        params = upscale_params.validate(
            upscale_params.from_mapping(upscale_params.attach(spec.params, inputs))
        )
        if upscaler_key(params.upscaler) != spec.model:
            raise InvalidParameterError("upscaler", "the job's engine is another upscaler")
        file = self.ctx.upscalers.load(params.upscaler)
        params = upscale_params.check_against(params, file.scale)
        facts = upscaler_facts(file.size, file.scale, self.ctx.config.device.name)
        need = claimed.estimate or facts.estimate(*images.size(params.image), params.tile_size)
        engine = self._engine(spec.model, file, facts.resident(), need)
        log_config = LogConfig(level=self.level)
        return engine, lambda: engine.upscale(params, log=log_config, estimate=need)

    def _prepare_video(self, spec: JobSpec, claimed: Claim) -> tuple[Any, Callable[[], Any]]:
        """A video's checked parameters, model (a Wan model reading the images given: checked
        from its headers before any engine loads) and engine: (engine, the call)."""
        inputs: dict[str, bytes] = {}
        if any(spec.params.get(n) for n in video_params.VIDEO_IMAGES):
            inputs = retry_transient(lambda: self.store.inputs(self.job_id))
        params = video_params.validate(
            video_params.from_mapping(video_params.attach(spec.params, inputs))
        )
        videofile.check_format(params.format)  # mp4 without the extra here: before any load
        model = self.ctx.catalog.load(spec.model)
        require_video_model(model).check(params)
        facts = model_facts(model, self.ctx.config.device)
        need = claimed.estimate or facts.video_estimate(
            params.width, params.height, params.frames, params.encodes
        )
        engine = self._engine(spec.model, model, facts.resident(), need)
        log_config = LogConfig(level=self.level, log_prompts=self.log_prompts)
        return engine, lambda: engine.video(
            params, progress=self._progress, log=log_config, estimate=need
        )

    def _execute(self, name: str, engine: Any, call: Callable[[], Any], hook: str | None) -> None:
        """Run the job's native call on its engine (after the load's records are stored and
        a cancel during the load is honoured) and hand its images to the uploader."""
        loaded = (
            self.ctx.last_load if (self.ctx.last_load or {}).get("job") == self.job_id else None
        )
        if loaded:
            self.timings["load_s"] = loaded["load_s"]
            self.timings["warmup_s"] = loaded["warmup_s"]
            # Before the first native call after a load: if the runtime kills this process,
            # the scheduler's poison report quotes these records. A cancel that came during
            # the load ends the job here, without ending the process. A job on a warm engine
            # skips this round trip: its claim checked the cancel a moment ago, and a later
            # one is caught by the cancel watch.
            records = self.ctx.load_records.get(name, [])
            if retry_transient(lambda: self.store.loaded(self.job_id, records)):
                self._end("cancelled")
                return
        with cancel_watch().watching(self):
            if hook and hook.startswith("sleep:"):  # the queue untouched meanwhile
                time.sleep(hooks.hook_sleep_seconds(hook))
            if self.links is not None:
                self.links.ahead()  # the next job, taken and prepared while this one runs
            if hook and hook.startswith("ahead-sleep:"):
                time.sleep(hooks.hook_sleep_seconds(hook))
            if hook == "abort-running":
                time.sleep(0.5)  # the lookahead takes the next message meanwhile
                log.warning("test hook: aborting the process while job %s runs", self.job_id)
                os.abort()
            if self._cancel_at_start:  # asked for while it was claimed ahead
                self._end("cancelled")
                return
            self.timings["worker_pre_s"] = round(time.monotonic() - self._t0, 4)
            out = call()
        # The result is built on the uploader thread, beside the next job's native call.
        load_records = self._load_records(name) if loaded else []
        self.ctx.uploader.submit(
            Later(self.job_id, self.dispatch, lambda: self._finished(out, load_records))
        )

    def _finished(self, out: Any, load_records: list[dict[str, Any]]) -> Finished:
        """The job's end from what its native call returned (a generation's NativeOutput is
        finished into its result here; an upscale's or a video's is its result)."""
        result = out.finish() if isinstance(out, NativeOutput) else out
        meta = {**result.metadata, **self.meta}
        meta["engine_device"] = result.metadata.get("device")
        meta["timings"] = {**self.timings, **result.metadata.get("timings", {})}
        records = load_records + [r.as_dict() for r in result.records]
        seeds = meta.get("seeds")
        frames = len(result.images) if meta.get("kind") == "video" else 0
        return Finished(
            self.job_id,
            self.dispatch,
            "done",
            meta=meta,
            records=_visible(records, self.level),
            images=list(result.images),
            png_params=[{**meta, "seed": s} for s in seeds]
            if seeds
            else [{**meta, "frame": i} for i in range(frames)] or [meta],
            extra=list(getattr(result, "extra", [])),
        )

    def _with_inputs(self, params: dict[str, Any]) -> dict[str, Any]:
        """The job's parameters with its input images read from the store (they travel beside
        the parameters, which name each by its digest)."""
        if not any(params.get(p.name) for p in IMAGE_PARAMS):
            return params
        return attach_images(params, retry_transient(lambda: self.store.inputs(self.job_id)))

    # -- progress and cancel -----------------------------------------------------------------

    def _progress(self, step: int, steps: int, s_per_step: float) -> None:
        """The engine's progress callback (its watcher thread): throttled progress and step
        events, and a cancel check on each write."""
        now = time.monotonic()
        if (step, steps) == self._last_step:
            return
        if step < steps and now - self._last_pub < PROGRESS_MIN_INTERVAL:
            return
        self._last_pub, self._last_step = now, (step, steps)
        try:
            if self.store.publish_progress(self.job_id, step, steps, s_per_step):
                self.cancel_running()
        except Exception as exc:  # noqa: BLE001 - progress is best effort
            log.warning("progress of job %s not published: %s", self.job_id, exc)

    def _preview(self, preview: Preview) -> None:
        """The engine's preview callback (its watcher thread): the newest preview as the job's
        `preview` event, throttled; one that comes too soon after the last is skipped (the
        next supersedes it, and the result comes anyway)."""
        now = time.monotonic()
        if now - self._last_preview < PREVIEW_MIN_INTERVAL:
            return
        self._last_preview = now
        try:
            self.store.publish_preview(self.job_id, preview.as_event())
        except Exception as exc:  # noqa: BLE001 - previews are best effort
            log.warning("preview of job %s not published: %s", self.job_id, exc)

    def _cancel_requested(self) -> bool:
        return self.store.cancel_requested(self.job_id)

    def cancel_running(self) -> None:
        """A cancel while the runtime generates: master-596 cannot stop, so this process ends.
        Earlier jobs' results are written first; Celery starts a fresh process."""
        if not self._cancel_lock.acquire(blocking=False):
            return
        log.warning("job %s cancelled while running: ending this worker process", self.job_id)
        try:
            self.ctx.uploader.flush(15.0)
            retry_transient(
                lambda: self.store.finish(
                    self.job_id, self.dispatch, self.ctx.config.device_key, "cancelled"
                )
            )
        finally:
            os._exit(CANCEL_EXIT_CODE)

    # -- endings -------------------------------------------------------------------------------

    def _end(
        self,
        state: str,
        error: str = "",
        records: list[dict[str, Any]] | None = None,
        job_fields: dict[str, str] | None = None,
    ) -> None:
        meta = None if state == "cancelled" else {**self.meta, "timings": dict(self.timings)}
        self.ctx.uploader.submit(
            Finished(
                self.job_id,
                self.dispatch,
                state,
                meta=meta,
                records=records or [],
                error=error,
                job_fields=job_fields or {},
            )
        )

    def _fail(
        self,
        message: str,
        records: list[dict[str, Any]] | None = None,
        job_fields: dict[str, str] | None = None,
    ) -> None:
        log.info("job %s failed: %s", self.job_id, message)
        self._end("failed", message, records, job_fields)

    def _refusal_fields(self, exc: BaseException) -> dict[str, str] | None:
        """A memory refusal here (the engine's check, the cache, a size too large for the
        host) reports its estimate and figures in the job record like placement's refusal."""
        if not isinstance(exc, ModelTooLargeError):
            return None
        cfg = self.ctx.config
        figures = {
            "device": cfg.device_key,
            "type": cfg.device.type,
            "source": "worker",
            "figures": exc.figures,
        }
        self.meta.update(estimate=exc.estimate, figures=exc.figures)
        return {"figures": json.dumps([figures]), "estimate": str(exc.estimate)}

    def _load_records(self, name: str) -> list[dict[str, Any]]:
        return _visible(self.ctx.load_records.get(name, []), self.level)


class CancelWatch:
    """Polls `cancel:{id}` while a job runs native code (or sleeps in a test hook): the
    engine's progress callback only fires per step, and a step can take minutes. One thread
    per worker process, started with its first job: a thread start per job cost about 0.3 ms
    on the path of every job. It polls the job claimed ahead too (`ahead`): a cancel of that
    one, found before it begins, ends it without a native call (found after, the process
    ends, as for any running job)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._job: JobRun | None = None
        self.ahead: JobRun | None = None  # the job claimed ahead, until its run begins
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="sdfarm-cancel", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def watching(self, job: JobRun) -> Iterator[None]:
        with self._cond:
            self._job = job
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._job = None
                self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._job is None:
                    self._cond.wait()
                job = self._job
                self._cond.wait(CANCEL_POLL_S)
                if self._job is not job:
                    continue
            GATE.wait()  # not while the job thread starts a native call
            try:
                if job._cancel_requested():
                    job.cancel_running()
                ahead = self.ahead
                if ahead is not None and ahead._cancel_requested():
                    ahead._cancel_at_start = True
            except Exception as exc:  # noqa: BLE001 - keep watching through a Redis blip
                log.warning("cancel check failed: %s", exc)


_watch: CancelWatch | None = None


def cancel_watch() -> CancelWatch:
    """This process's CancelWatch (a forked child starts its own)."""
    global _watch
    if _watch is None or _watch.pid != os.getpid():
        _watch = CancelWatch()
    return _watch


# -- parsing ---------------------------------------------------------------------------------


def _job_spec(doc: dict[str, Any]) -> JobSpec:
    """A JobSpec from the stored JSON, ignoring fields this worker does not know (a newer
    client may add some); InvalidParameterError naming what is missing or malformed."""
    known = {f.name for f in fields(JobSpec)}
    if not isinstance(doc.get("model"), str):
        raise InvalidParameterError("model", "the job names no model")
    if not isinstance(doc.get("params", {}), dict):
        raise InvalidParameterError("params", "must be an object")
    spec = JobSpec(**{k: v for k, v in doc.items() if k in known})
    if spec.kind not in JOB_KINDS:
        raise InvalidParameterError("kind", f"unknown job kind {spec.kind!r}")
    try:
        logs.level_number(spec.log_level)
    except ValueError as exc:
        raise InvalidParameterError("log_level", str(exc)) from None
    return spec


def _visible(records: list[dict[str, Any]], level: str) -> list[dict[str, Any]]:
    floor = logs.level_number(level)
    if floor >= logs.LEVELS["none"]:
        return []
    return [r for r in records if logs.LEVELS.get(r.get("level", "info"), 1) >= floor]


def _error_records(exc: BaseException) -> list[dict[str, Any]]:
    """The runtime's error records an engine error quotes, as result records."""
    return [
        {"seq": 0, "level": "error", "message": str(m), "source": "sd", "location": ""}
        for m in getattr(exc, "records", []) or []
    ]


def _tiling_plan(doc: dict[str, Any] | None) -> TilingPlan | None:
    """The plan the scheduler placed the job with; None when the record has none (a job
    placed by hand), and then the engine plans from its own figure."""
    if doc is None:
        return None
    try:
        return TilingPlan.from_json(doc)
    except (KeyError, TypeError, ValueError):
        return None
