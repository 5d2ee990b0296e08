"""OpenAI's images API over the farm: `POST /v1/images/generations` (one job of `n` images,
waited for, answered as base64 or as signed URLs), `POST /v1/images/edits` (the same, from a
multipart form whose image is the job's init image and whose mask is OpenAI's, converted:
sdfarm.gateway.edits) and `GET /v1/models`, so the `openai` package and other OpenAI clients
work unchanged.
"""

from __future__ import annotations

import base64
import functools
import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from sdfarm.client.farm import Farm, JobFailed
from sdfarm.gateway.auth import caller, gate, job_quota, require_token
from sdfarm.gateway.edits import IMAGE, MASK, EditForm, auto_size, checked_images, form_body
from sdfarm.gateway.errors import DEADLINE, APIError, _errors, _farm_error
from sdfarm.gateway.schemas import (
    AUTO_SIZE,
    RESPONSE_FORMATS,
    EditRequest,
    ImagesRequest,
    body_doc,
    form_doc,
    json_body,
    parse,
    parse_size,
    submit_args,
)

router = APIRouter(dependencies=[Depends(require_token)])
OPENAI_FIELDS = {"n", "size", "response_format", "user"}


@router.post(
    "/v1/images/generations",
    responses=_errors(400, 401, 404, 409, 413, 429, 500, 503, 504, 507),
    openapi_extra=body_doc(ImagesRequest),
)
async def images_generations(request: Request, body: Any = Depends(json_body)) -> Any:  # noqa: B008
    req = parse(ImagesRequest, body)
    _check_format(req.response_format)
    width, height = parse_size(req.size)
    return await _run(request, req, width=width, height=height)


EDIT_FILES = {
    IMAGE: "the image to edit (PNG, JPEG or WebP): the job's init_image; repeated as image[], "
    "the others are reference images",
    MASK: "where to edit: the mask's fully transparent pixels (without a mask, the image's); "
    "a PNG of the image's size with an alpha channel",
}


@router.post(
    "/v1/images/edits",
    responses=_errors(400, 401, 404, 409, 413, 429, 500, 503, 504, 507),
    openapi_extra=form_doc(EditRequest, EDIT_FILES, required=(IMAGE,)),
)
async def images_edits(request: Request, form: EditForm = Depends(form_body)) -> Any:  # noqa: B008
    req = parse(EditRequest, form.fields)
    _check_format(req.response_format)
    try:  # decoding images is CPU work: off the event loop
        image, refs, mask = await run_in_threadpool(checked_images, form)
    except Exception as exc:  # noqa: BLE001 - InvalidParameterError names the form's field
        raise _farm_error(exc) from None
    size = (req.size or "").strip().lower()
    width, height = auto_size(image) if size == AUTO_SIZE else parse_size(req.size)
    images = {"init_image": image, "mask_image": mask, "ref_images": refs}
    return await _run(request, req, width=width, height=height, images=images)


def _check_format(response_format: str) -> None:
    if response_format not in RESPONSE_FORMATS:
        raise APIError(
            400,
            f"invalid response_format: {response_format!r} (url or b64_json)",
            param="response_format",
            code="invalid_parameter",
        )


async def _run(
    request: Request,
    req: Any,
    *,
    width: int,
    height: int,
    images: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Submit the job of an OpenAI images request (`images`: input images, already bytes),
    wait for it and answer as OpenAI does: base64 PNGs or signed URLs. The submit (a few
    quick Redis round trips and the memory estimate) runs in the threadpool; the wait awaits
    the job's notices on the event loop, so a waiting request holds no thread."""
    values = req.model_dump(exclude=OPENAI_FIELDS)
    values.update(width=width, height=height, batch_count=req.n, submitter=req.user)
    model, prompt, kwargs = submit_args(values)
    kwargs.update(images or {})
    farm: Farm = request.app.state.farm
    owner, quota = caller(request).owner, job_quota(request)
    try:
        job = await run_in_threadpool(
            functools.partial(farm.submit, model, prompt, owner=owner, quota=quota, **kwargs)
        )
        request.app.state.recent.add(job.id)
        result = await job.result_async(request.app.state.aio.get(), request.app.state.timeout_s)
    except JobFailed as exc:
        reason = await run_in_threadpool(failure_reason, farm, exc.job_id)
        raise _farm_error(exc, size_param=True, reason=reason) from None
    except Exception as exc:  # noqa: BLE001 - every error becomes an OpenAI error
        raise _farm_error(exc, size_param=True) from None
    if req.response_format == "b64_json":
        data = [{"b64_json": base64.b64encode(p).decode()} for p in result.pngs]
    else:
        base = str(request.base_url).rstrip("/")
        urls = (gate(request).image_url(job.id, i) for i in range(len(result.pngs)))
        data = [{"url": f"{base}/{url}"} for url in urls]
    return {"created": int(time.time()), "data": data}


def failure_reason(farm: Farm, job_id: str) -> str:
    """Why a failed job failed, as its `failed` event says ("deadline", "poison", ...; ""
    when it gives none); DEADLINE too when the farm recorded no end at all (the client gave
    up well past the job's deadline)."""
    try:
        if farm.store.state(job_id) in ("queued", "placed", "running"):
            return DEADLINE
        failed = [e for e in farm.store.events(job_id) if e.get("event") == "failed"]
    except Exception:  # noqa: BLE001 - the failure is answered anyway, as a plain one
        return ""
    return str(failed[-1].get("reason") or "") if failed else ""


@router.get("/v1/models", responses=_errors(401, 503))
def list_models(request: Request) -> Any:
    farm: Farm = request.app.state.farm
    try:
        models = farm.models()
    except Exception as exc:  # noqa: BLE001
        raise _farm_error(exc) from None
    return {
        "object": "list",
        "data": [
            {"id": m["name"], "object": "model", "created": 0, "owned_by": "sdfarm"} for m in models
        ],
    }
