"""The jobs API: `POST /v1/jobs` queues a job (`POST /v1/upscale` an upscale, `POST /v1/videos`
a video) and answers at once (202), then
`GET /v1/jobs/{id}` (its record), `/image.png` (an image, by token or signed URL; a video's
frames; a video's file is sdfarm.gateway.routes_videos'),
`/events` (server-sent events until it ends) and `DELETE` (cancel a live job; delete an
ended one with its images, from whichever result store holds them).

Images live where the worker's result store put them (sdfarm.store.results): Redis and a
shared folder are served from here; an S3 store's are a redirect to a presigned URL, so the
bytes never pass through the gateway.

With tokens, a job belongs to the token that submitted it (its fingerprint is the job's
`owner`): another normal token gets 404 for it on every route here, exactly as for a job that
does not exist, so an id says nothing about whether the job is there. Operator tokens see
every job.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import RedirectResponse, Response

from sdfarm.client.farm import Farm, Job
from sdfarm.gateway import sse
from sdfarm.gateway.auth import OPEN, Caller, caller, gate, job_quota, require_token
from sdfarm.gateway.errors import APIError, _errors, _farm_error, scrub_paths
from sdfarm.gateway.schemas import (
    JobRequest,
    UpscaleRequest,
    VideoRequest,
    body_doc,
    json_body,
    parse,
    submit_args,
    upscale_args,
    video_args,
)
from sdfarm.store.results import delete_job, image_of

router = APIRouter()
JOB_ID = re.compile(r"[0-9a-f]{32}")


def _not_found(job_id: str) -> APIError:
    return APIError(404, f"no job {job_id} (unknown or expired)", code="job_not_found")


def job_or_404(farm: Farm, job_id: str, who: Caller) -> Job:
    """The job, or the 404 when the id is malformed, the farm holds no record of it, or it
    belongs to another owner than `who` may see."""
    if not JOB_ID.fullmatch(job_id):
        raise APIError(404, f"no job {job_id}", param="id", code="job_not_found")
    try:
        state, owner = farm.store.jobs_fields([job_id], ("state", "owner"))[0]
    except Exception as exc:  # noqa: BLE001 - Redis away: 503
        raise _farm_error(exc) from None
    if not state or not who.may_see(owner):
        raise _not_found(job_id)
    return farm.job(job_id)


@router.post(
    "/v1/jobs",
    status_code=202,
    dependencies=[Depends(require_token)],
    responses=_errors(400, 401, 404, 413, 429, 503),
    openapi_extra=body_doc(JobRequest),
)
def create_job(request: Request, body: Any = Depends(json_body)) -> Any:  # noqa: B008
    model, prompt, kwargs = submit_args(parse(JobRequest, body).model_dump())
    farm = request.app.state.farm
    return _queued(request, lambda **who: farm.submit(model, prompt, **who, **kwargs))


def _queued(request: Request, submit: Any) -> dict[str, str]:
    """Submit a job for the caller (`submit(owner=..., quota=...)`), remember it for the
    status page and answer its id; a farm error becomes its HTTP error."""
    try:
        job = submit(owner=caller(request).owner, quota=job_quota(request))
    except Exception as exc:  # noqa: BLE001
        raise _farm_error(exc) from None
    request.app.state.recent.add(job.id)
    return {"id": job.id, "state": "queued"}


@router.post(
    "/v1/upscale",
    status_code=202,
    dependencies=[Depends(require_token)],
    responses=_errors(400, 401, 404, 413, 429, 503),
    openapi_extra=body_doc(UpscaleRequest),
)
def create_upscale(request: Request, body: Any = Depends(json_body)) -> Any:  # noqa: B008
    """An upscale job, queued like `POST /v1/jobs`: its result is read the same way
    (`GET /v1/jobs/{id}`, `/image.png`, `/events`), by the same owner."""
    values = upscale_args(parse(UpscaleRequest, body).model_dump())
    image, upscaler = values.pop("image"), values.pop("upscaler")
    farm = request.app.state.farm
    return _queued(request, lambda **who: farm.upscale(image, upscaler, **who, **values))


@router.post(
    "/v1/videos",
    status_code=202,
    dependencies=[Depends(require_token)],
    responses=_errors(400, 401, 404, 413, 429, 503),
    openapi_extra=body_doc(VideoRequest),
)
def create_video(request: Request, body: Any = Depends(json_body)) -> Any:  # noqa: B008
    """A video job, queued like `POST /v1/jobs`: `GET /v1/videos/{id}` answers its state
    and, once done, a signed URL of its video file (`format`: webp or mp4); its frames are
    the job's images (`/image.png?i=N`)."""
    model, prompt, values = video_args(parse(VideoRequest, body).model_dump())
    farm = request.app.state.farm
    return _queued(request, lambda **who: farm.video(model, prompt, **who, **values))


@router.get("/v1/upscalers", dependencies=[Depends(require_token)], responses=_errors(401, 503))
def list_upscalers(request: Request) -> Any:
    """The upscalers some live worker can load: name, bytes and scale (the only factor each
    makes); no paths, no devices."""
    try:
        found = request.app.state.farm.upscalers()
    except Exception as exc:  # noqa: BLE001
        raise _farm_error(exc) from None
    return {"data": [{k: u[k] for k in ("name", "bytes", "scale")} for u in found]}


@router.get(
    "/v1/jobs/{job_id}", dependencies=[Depends(require_token)], responses=_errors(401, 404, 503)
)
def get_job(request: Request, job_id: str) -> Any:
    farm: Farm = request.app.state.farm
    job = job_or_404(farm, job_id, caller(request))
    rec = job.record()
    spec = json.loads(rec.get("spec") or "{}")
    doc: dict[str, Any] = {
        "id": job_id,
        "state": rec.get("state", ""),
        "model": rec.get("model", ""),
        "kind": rec.get("kind") or "generate",
        "submitter": rec.get("submitter", ""),
        "priority": int(rec.get("priority") or 0),
        "params": spec.get("params", {}),
        "device": rec.get("device") or None,
        "created": float(rec["created"]) if rec.get("created") else None,
        "ended": float(rec["ended"]) if rec.get("ended") else None,
        "error": scrub_paths(rec["error"]) if rec.get("error") else None,
        "estimate": int(rec["estimate"]) if rec.get("estimate", "").isdigit() else None,
        "progress": job.progress(),
        "images": farm.store.image_count(job_id),
    }
    if doc["state"] == "done":
        if doc["kind"] == "video":  # the frames, then the video file (routes_videos)
            doc["images"] = max(0, doc["images"] - 1)
            fmt = doc["params"].get("format") or "webp"
            doc["video_url"] = f"/v1/jobs/{job_id}/video.{fmt}"
        doc["image_urls"] = [f"/v1/jobs/{job_id}/image.png?i={i}" for i in range(doc["images"])]
    return doc


async def image_reader(request: Request, job_id: str, i: int = 0, sig: str = "") -> Caller:
    """Dependency of an image: OPEN for a signed URL, else the token's Caller (rate-limited)."""
    g = gate(request)
    return OPEN if g.signed(job_id, i, sig) else await g.authorize(request)


@router.get(
    "/v1/jobs/{job_id}/image.png",
    responses={200: {"content": {"image/png": {}}}, **_errors(401, 404, 409, 503)},
)
def get_image(
    request: Request,
    job_id: str,
    i: int = 0,
    who: Caller = Depends(image_reader),  # noqa: B008
) -> Any:
    """By a signed URL (the gateway signs only URLs it hands to the job's owner), or by a
    token that may see the job."""
    farm: Farm = request.app.state.farm
    state = job_or_404(farm, job_id, who).state()
    if state != "done":
        raise APIError(409, f"job {job_id} is {state}, it has no image", code="job_not_done")
    try:
        png, url = image_of(farm.store.record(job_id), i, farm.store)
    except Exception as exc:  # noqa: BLE001 - Redis or the result store away: 503
        raise _farm_error(exc) from None
    if url is not None:
        return RedirectResponse(url, status_code=307)
    if png is None:
        raise APIError(404, f"job {job_id} has no image {i}", param="i", code="no_image")
    return Response(png, media_type="image/png")


@router.delete(
    "/v1/jobs/{job_id}", dependencies=[Depends(require_token)], responses=_errors(401, 404, 503)
)
def cancel_job(request: Request, job_id: str) -> Any:
    """A live job is cancelled (`cancelled`: true, its state as it is now); an ended one is
    deleted with its images (`deleted`: true); DELETE it again once a cancel took effect."""
    farm: Farm = request.app.state.farm
    job = job_or_404(farm, job_id, caller(request))
    try:
        deleted = delete_job(farm.store, job_id)
    except Exception as exc:  # noqa: BLE001 - Redis or the result store away: 503
        raise _farm_error(exc) from None
    if deleted > 0:
        return {"id": job_id, "cancelled": False, "deleted": True, "state": "deleted"}
    if deleted == 0:
        raise _not_found(job_id)
    cancelled = job.cancel()
    return {"id": job_id, "cancelled": cancelled, "deleted": False, "state": job.state()}


@router.get(
    "/v1/jobs/{job_id}/events",
    dependencies=[Depends(require_token)],
    responses={200: {"content": {"text/event-stream": {}}}, **_errors(401, 404, 503)},
)
async def job_events(request: Request, job_id: str) -> Any:
    """Async from end to end: the stream awaits notices of the job's events (pub/sub) and
    holds no thread of the pool, however long it stays open."""
    if not JOB_ID.fullmatch(job_id):
        raise APIError(404, f"no job {job_id}", param="id", code="job_not_found")
    store = request.app.state.aio.get()
    try:
        state, owner = await store.access(job_id)
    except Exception as exc:  # noqa: BLE001 - Redis away: 503
        raise _farm_error(exc) from None
    if not state or not caller(request).may_see(owner):
        raise _not_found(job_id)
    return sse.response(store, job_id, clean=scrub_paths)
