"""AUTOMATIC1111's web UI API (`/sdapi/v1/...`) over the farm, so the image tools, bots and
plugins that speak it (the `webuiapi` package among them) work unchanged. The translation is
sdfarm.gateway.a1111; jobs go through the farm like any other (placement, priorities, fair
share, cancel), owned by the caller's token.

A1111 serves one user's one checkpoint; here each token has its own default model (POST
/sdapi/v1/options with `sd_model_checkpoint`, kept in the store), a request can name one in
`override_settings`, and otherwise the farm's first model by name is used. `progress` and
`interrupt` concern the caller's jobs that this gateway process submitted. A1111 clients send
`--api-auth` credentials as HTTP Basic: the password is the token (sdfarm.gateway.auth).
"""

from __future__ import annotations

import base64
from typing import Any, NoReturn

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from sdfarm.client.farm import Farm, Job, JobFailed
from sdfarm.gateway import a1111
from sdfarm.gateway.auth import Caller, caller, job_quota, require_token
from sdfarm.gateway.errors import APIError, _errors, _farm_error
from sdfarm.gateway.routes_openai import failure_reason
from sdfarm.gateway.schemas import decode_image, json_body
from sdfarm.native.errors import InvalidParameterError

router = APIRouter(prefix="/sdapi/v1", dependencies=[Depends(require_token)])
MODEL_PREF = "sd_model_checkpoint"
LIVE = ("queued", "placed", "running")


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    return body


def _models(farm: Farm) -> list[str]:
    try:
        return sorted(m["name"] for m in farm.models())
    except Exception as exc:  # noqa: BLE001
        raise _farm_error(exc) from None


def _model_for(request: Request, body: dict[str, Any]) -> str:
    """The request's checkpoint: `override_settings`, else the caller's default, else the
    farm's first model by name."""
    farm: Farm = request.app.state.farm
    named = (body.get("override_settings") or {}).get(MODEL_PREF)
    if named:
        return a1111.model_name(named)
    try:
        chosen = farm.store.preference(caller(request).owner, MODEL_PREF)
    except Exception as exc:  # noqa: BLE001
        raise _farm_error(exc) from None
    if chosen:
        return chosen
    models = _models(farm)
    if not models:
        raise APIError(503, "no worker of the farm is up: no model to use", code="no_model")
    return models[0]


def _rename(exc: InvalidParameterError, names: dict[str, str]) -> NoReturn:
    """Raise `exc` again naming the A1111 field its parameter came from."""
    if exc.parameter not in names:
        raise exc
    why = str(exc).partition(": ")[2]
    raise InvalidParameterError(names[exc.parameter], why) from None


def _submit(request: Request, body: dict[str, Any], *, img2img: bool) -> tuple[Job, str]:
    """The job of a txt2img / img2img body, queued, and its model: decoding images and the
    submit's round trips, run in the threadpool."""
    farm: Farm = request.app.state.farm
    fields = a1111.job_fields(body, img2img=img2img)
    if img2img:
        fields["init_image"] = decode_image("init_images", fields["init_image"])
        if "mask_image" in fields:
            mask = decode_image("mask", fields["mask_image"])
            fields["mask_image"] = a1111.prepare_mask(
                mask, bool(body.get("inpainting_mask_invert")), int(body.get("mask_blur") or 0)
            )
    model = _model_for(request, body)
    prompt = fields.pop("prompt")
    try:
        job = farm.submit(
            model,
            prompt,
            owner=caller(request).owner,
            quota=job_quota(request),
            submitter="a1111",
            **fields,
        )
    except InvalidParameterError as exc:  # name the A1111 field
        _rename(exc, {"hires_upscaler": "hr_upscaler", "strength": "denoising_strength"})
    request.app.state.recent.add(job.id)
    return job, model


async def _generate(request: Request, body: dict[str, Any], *, img2img: bool) -> dict[str, Any]:
    """Submit in the threadpool, then await the job on the event loop (no thread waits)."""
    farm: Farm = request.app.state.farm
    try:
        job, model = await run_in_threadpool(_submit, request, body, img2img=img2img)
        result = await job.result_async(request.app.state.aio.get(), request.app.state.timeout_s)
    except JobFailed as exc:
        reason = await run_in_threadpool(failure_reason, farm, exc.job_id)
        raise _farm_error(exc, reason=reason) from None
    except Exception as exc:  # noqa: BLE001 - every error becomes an HTTP error
        raise _farm_error(exc) from None
    return a1111.answer(result.pngs, result.metadata, model, body)


@router.post("/txt2img", responses=_errors(400, 401, 404, 409, 413, 429, 500, 503, 504, 507))
async def txt2img(request: Request, body: Any = Depends(json_body)) -> Any:  # noqa: B008
    return await _generate(request, _object(body), img2img=False)


@router.post("/img2img", responses=_errors(400, 401, 404, 409, 413, 429, 500, 503, 504, 507))
async def img2img(request: Request, body: Any = Depends(json_body)) -> Any:  # noqa: B008
    return await _generate(request, _object(body), img2img=True)


@router.get("/sd-models", responses=_errors(401, 503))
def sd_models(request: Request) -> Any:
    return [
        {"title": n, "model_name": n, "hash": None, "sha256": None, "filename": n, "config": None}
        for n in _models(request.app.state.farm)
    ]


@router.get("/samplers", responses=_errors(401))
def samplers() -> Any:
    return a1111.samplers_doc()


@router.get("/schedulers", responses=_errors(401))
def schedulers() -> Any:
    return a1111.schedulers_doc()


@router.get("/loras", responses=_errors(401, 503))
def loras(request: Request) -> Any:
    farm: Farm = request.app.state.farm
    try:
        names = farm.loras()
    except Exception as exc:  # noqa: BLE001
        raise _farm_error(exc) from None
    return [{"name": n, "alias": n, "path": n, "metadata": {}} for n in names]


@router.get("/upscalers", responses=_errors(401, 503))
def upscalers(request: Request) -> Any:
    """The farm's ESRGAN upscalers (for extra-single-image), then the hires pass's latent
    ones (a1111.LATENT_UPSCALERS)."""
    try:
        farm_ups = request.app.state.farm.upscalers()
    except Exception as exc:  # noqa: BLE001
        raise _farm_error(exc) from None
    rows = [{"name": "None", "model_name": None, "model_path": None, "model_url": None,
             "scale": 4}]  # fmt: skip
    rows += [
        {
            "name": u["name"],
            "model_name": u["name"],
            "model_path": None,
            "model_url": None,
            "scale": u["scale"],
        }  # fmt: skip
        for u in farm_ups
    ]
    rows += [
        {"name": n, "model_name": None, "model_path": None, "model_url": None, "scale": 2}
        for n in a1111.LATENT_UPSCALERS
    ]
    return rows


def _submit_upscale(request: Request, body: dict[str, Any]) -> Job:
    fields = a1111.extras_fields(body)
    fields["image"] = decode_image("image", fields["image"])
    try:
        job = request.app.state.farm.upscale(
            fields.pop("image"),
            fields.pop("upscaler"),
            owner=caller(request).owner,
            quota=job_quota(request),
            submitter="a1111",
            **fields,
        )
    except InvalidParameterError as exc:  # name the A1111 field
        _rename(exc, {"factor": "upscaling_resize", "upscaler": "upscaler_1"})
    request.app.state.recent.add(job.id)
    return job


@router.post("/extra-single-image", responses=_errors(400, 401, 404, 409, 413, 429, 500, 503))
async def extra_single_image(request: Request, body: Any = Depends(json_body)) -> Any:  # noqa: B008
    """Upscale one image with a farm upscaler (an upscale job): {"image": base64 PNG}."""
    farm: Farm = request.app.state.farm
    try:
        job = await run_in_threadpool(_submit_upscale, request, _object(body))
        result = await job.result_async(request.app.state.aio.get(), request.app.state.timeout_s)
    except JobFailed as exc:
        reason = await run_in_threadpool(failure_reason, farm, exc.job_id)
        raise _farm_error(exc, reason=reason) from None
    except Exception as exc:  # noqa: BLE001 - every error becomes an HTTP error
        raise _farm_error(exc) from None
    return {"html_info": "", "image": base64.b64encode(result.pngs[0]).decode()}


@router.get("/scripts", responses=_errors(401))
def scripts() -> Any:
    """No scripts: clients (webuiapi) read this to learn which extensions they may use."""
    return {"txt2img": [], "img2img": []}


@router.get("/options", responses=_errors(401, 503))
def get_options(request: Request) -> Any:
    model = _model_for(request, {})
    return {MODEL_PREF: model, "sd_checkpoint_hash": None, "samples_format": "png",
            "CLIP_stop_at_last_layers": 1}  # fmt: skip


@router.post("/options", responses=_errors(400, 401, 404, 503))
def set_options(request: Request, body: Any = Depends(json_body)) -> Any:  # noqa: B008
    """Only `sd_model_checkpoint` can be set (for the caller's token); another option is
    refused by name."""
    body = _object(body)
    other = sorted(set(body) - {MODEL_PREF})
    if other:
        raise APIError(
            400,
            f"option {other[0]!r} cannot be set here; only {MODEL_PREF} (this token's model)",
            param=other[0],
            code="invalid_parameter",
        )
    if MODEL_PREF in body:
        farm: Farm = request.app.state.farm
        model = a1111.model_name(body[MODEL_PREF])
        models = _models(farm)
        if model not in models:
            raise APIError(
                404,
                f"unknown model {model!r}; the farm has {', '.join(models) or 'none'}",
                param=MODEL_PREF,
                code="model_not_found",
            )
        try:
            farm.store.set_preference(caller(request).owner, MODEL_PREF, model)
        except Exception as exc:  # noqa: BLE001
            raise _farm_error(exc) from None
    return None


def _live_jobs(request: Request, who: Caller) -> list[tuple[str, str]]:
    """(id, state) of the caller's jobs this gateway submitted, newest first, with states."""
    farm: Farm = request.app.state.farm
    ids = request.app.state.recent.ids()
    try:
        rows = farm.store.jobs_fields(ids, ("state", "owner"))
    except Exception as exc:  # noqa: BLE001
        raise _farm_error(exc) from None
    return [(i, st) for i, (st, owner) in zip(ids, rows, strict=True) if st and who.may_see(owner)]


@router.get("/progress", responses=_errors(401, 503))
def progress(request: Request) -> Any:
    farm: Farm = request.app.state.farm
    jobs = _live_jobs(request, caller(request))
    live = [(i, st) for i, st in jobs if st in LIVE]
    if not live:
        return a1111.progress_doc(None, jobs[0][1] if jobs else None)
    job_id, state = live[0]
    try:
        job = farm.job(job_id)
        prog, preview = job.progress(), job.preview()
    except Exception as exc:  # noqa: BLE001
        raise _farm_error(exc) from None
    image = base64.b64encode(preview.data).decode() if preview is not None else None
    return a1111.progress_doc(prog, state, image)


@router.post("/interrupt", responses=_errors(401, 503))
def interrupt(request: Request) -> Any:
    """Cancel the caller's live jobs (queued, placed or running) that this gateway submitted."""
    farm: Farm = request.app.state.farm
    for job_id, state in _live_jobs(request, caller(request)):
        if state in LIVE:
            try:
                farm.cancel(job_id)
            except Exception as exc:  # noqa: BLE001
                raise _farm_error(exc) from None
    return {}


@router.post("/skip", responses=_errors(401, 503))
def skip(request: Request) -> Any:
    """A1111 skips the current image of a batch; a farm job is one call: cancelled."""
    return interrupt(request)
