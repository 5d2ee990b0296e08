"""A video job's result over HTTP: `GET /v1/videos/{id}` (the job, and once done a URL of its
video file that the client fetches without the API token, until it expires) and
`GET /v1/jobs/{id}/video.webp` or `/video.mp4` (the file, by that URL or by a token that may
see the job). `POST /v1/videos` queues one (sdfarm.gateway.routes_jobs).

Why a signed, expiring URL: a video is fetched by whatever plays it (a browser's <video>, a
CDN, a downstream service) that should not hold the API token; unlike an image URL, which a
client fetches once right away, a video URL gets passed around, so it stops working after
`Gate.url_ttl_s` (an hour, as an S3 store's presigned URL) and `GET /v1/videos/{id}` hands out
a fresh one. The signature covers the job, the format and the expiry (sdfarm.gateway.auth).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import RedirectResponse, Response

from sdfarm.client.farm import Farm
from sdfarm.gateway.auth import OPEN, Caller, caller, gate, require_token
from sdfarm.gateway.errors import APIError, _errors, _farm_error, scrub_paths
from sdfarm.gateway.routes_jobs import job_or_404
from sdfarm.native.videofile import MEDIA_TYPES, VIDEO_FORMATS, format_of
from sdfarm.store.results import image_of

router = APIRouter()


def _video_record(farm: Farm, job_id: str, who: Caller) -> tuple[dict[str, str], str]:
    """(the record of a video job `who` may see, its video format); 404 for any other job."""
    rec = job_or_404(farm, job_id, who).record()
    if (rec.get("kind") or "generate") != "video":
        raise APIError(404, f"job {job_id} is not a video job", code="no_video")
    params = json.loads(rec.get("spec") or "{}").get("params") or {}
    return rec, str(params.get("format") or "webp")


@router.get(
    "/v1/videos/{job_id}", dependencies=[Depends(require_token)], responses=_errors(401, 404, 503)
)
def get_video_job(request: Request, job_id: str) -> Any:
    """A video job: its state and progress, and once done its frame count, the URL of its
    video file (absolute; signed and expiring when tokens are on: `expires_at`, Unix time)
    and its frames' image URLs. Call again for a fresh URL."""
    farm: Farm = request.app.state.farm
    rec, fmt = _video_record(farm, job_id, caller(request))
    state = rec.get("state", "")
    doc: dict[str, Any] = {
        "id": job_id,
        "object": "video",
        "state": state,
        "model": rec.get("model", ""),
        "format": fmt,
        "progress": farm.job(job_id).progress(),
        "error": scrub_paths(rec["error"]) if rec.get("error") else None,
    }
    if state == "done":
        g = gate(request)
        base = str(request.base_url).rstrip("/")
        path, expires = g.video_url(job_id, fmt)
        frames = max(0, farm.store.image_count(job_id) - 1)  # the frames, then the file
        doc.update(
            url=f"{base}/{path}",
            expires_at=expires,
            media_type=MEDIA_TYPES[fmt],
            frames=frames,
            frame_urls=[f"{base}/{g.image_url(job_id, i)}" for i in range(frames)],
        )
    return doc


async def video_reader(
    request: Request, job_id: str, fmt: str, exp: int = 0, sig: str = ""
) -> Caller:
    """Dependency of a video file: OPEN for a valid signed URL; 403 for one of this gateway's
    that expired (so the client knows to ask for a fresh one); else the token's Caller."""
    g = gate(request)
    verdict = g.video_signature(job_id, fmt, exp, sig)
    if verdict == "valid":
        return OPEN
    if verdict == "expired":
        raise APIError(
            403,
            f"this signed URL of job {job_id}'s video expired at {exp} (Unix time); GET "
            f"v1/videos/{job_id} with the token for a fresh one",
            type="authentication_error",
            code="url_expired",
        )
    return await g.authorize(request)


@router.get(
    "/v1/jobs/{job_id}/video.{fmt}",
    responses={
        200: {"content": {t: {} for t in MEDIA_TYPES.values()}},
        **_errors(401, 403, 404, 409, 503),
    },
)
def get_video(
    request: Request,
    job_id: str,
    fmt: str,
    who: Caller = Depends(video_reader),  # noqa: B008
) -> Any:
    """A video job's file (stored after its frames) as `fmt`, the job's format: by a signed
    URL (`GET /v1/videos/{id}` hands them out) or by a token that may see the job."""
    if fmt not in VIDEO_FORMATS:
        raise APIError(404, f"no video.{fmt}; the formats are {', '.join(VIDEO_FORMATS)}")
    farm: Farm = request.app.state.farm
    rec, made = _video_record(farm, job_id, who)
    if fmt != made:
        raise APIError(404, f"job {job_id} made video.{made}, not video.{fmt}", code="no_video")
    state = rec.get("state", "")
    if state != "done":
        raise APIError(409, f"job {job_id} is {state}, it has no video", code="job_not_done")
    try:
        last = farm.store.image_count(job_id) - 1
        data, url = image_of(rec, last, farm.store)
    except Exception as exc:  # noqa: BLE001 - Redis or the result store away: 503
        raise _farm_error(exc) from None
    if url is not None:
        return RedirectResponse(url, status_code=307)
    if data is None or format_of(data) != fmt:
        raise APIError(404, f"job {job_id} has no video", code="no_video")
    return Response(data, media_type=MEDIA_TYPES[fmt])
