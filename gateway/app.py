"""The gateway's HTTP application: the OpenAI images API, the jobs API, devices, health and
Prometheus metrics, all over one `Farm` (Redis only; the gateway holds no state of its own).

`create_app(redis_url, tokens=[...])` returns a FastAPI app; `sdfarm gateway` serves it with
uvicorn (sdfarm.gateway.cli). Errors always have OpenAI's shape:
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import math
import re
import time
from collections.abc import Iterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from sdfarm.gateway.page import PAGE_HTML
from sdfarm.gateway.ratelimit import RateLimiter
from sdfarm.gateway.status import RecentJobs, status_doc
from sdfarm.native.errors import InvalidParameterError
from sdfarm.scheduler.client import (
    Farm,
    FarmBusyError,
    FarmError,
    JobCancelled,
    JobFailed,
    UnknownModelError,
)
from sdfarm.worker import protocol

MAX_BODY = 64 * 1024
MAX_N = 4
MIN_SIDE, MAX_SIDE, SIDE_STEP = 64, 2048, 8
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_RATE_PER_MINUTE = 600.0
RETRY_AFTER_S = 5
SSE_POLL_S = 0.1
SSE_KEEPALIVE_S = 15.0
EVENT_FINAL = frozenset(protocol.FINAL_STATES)

__all__ = ["APIError", "create_app"]


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(
            {
                "error": {
                    "message": self.message,
                    "type": self.type,
                    "param": self.param,
                    "code": self.code,
                }
            },
            status_code=self.status,
            headers=self.headers,
        )


def _farm_error(exc: BaseException, *, size_param: bool = False) -> APIError:
    """The HTTP answer for an error of the client or of a job."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidParameterError):
        param = exc.parameter
        if size_param and param in ("width", "height"):
            param = "size"
        if size_param and param == "batch_count":
            param = "n"
        return APIError(400, str(exc), param=param, code="invalid_parameter")
    if isinstance(exc, UnknownModelError):
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, FarmBusyError):
        return APIError(
            429,
            str(exc),
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    if isinstance(exc, JobFailed):
        if exc.figures or exc.estimate:
            figs = ", ".join(
                f"{f.get('device', f.get('key', '?'))}: {f.get('figure', f)}"
                if isinstance(f, dict)
                else str(f)
                for f in exc.figures
            )
            return APIError(
                507,
                f"{exc} (estimate {exc.estimate} bytes; figures: {figs or 'none'})",
                type="server_error",
                code="insufficient_memory",
            )
        return APIError(500, str(exc), type="server_error", code="job_failed")
    if isinstance(exc, JobCancelled):
        return APIError(409, str(exc), code="job_cancelled")
    if isinstance(exc, TimeoutError):
        return APIError(504, str(exc), type="server_error", code="timeout")
    from redis.exceptions import RedisError

    if isinstance(exc, FarmError | RedisError | ConnectionError | OSError):
        return APIError(503, f"farm unavailable: {exc}", type="server_error", code="farm_error")
    return APIError(500, f"internal error: {exc}", type="server_error", code="internal_error")


# -- request bodies ----------------------------------------------------------------------------


class ImagesRequest(BaseModel):
    """OpenAI's images/generations body; unknown OpenAI fields (quality, style) are ignored.
    sdfarm's own parameters may come as extras (steps, seed, negative_prompt, cfg_scale,
    sampler, priority)."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    prompt: str
    n: int = Field(default=1, ge=1, le=MAX_N)
    size: str = "256x256"
    response_format: str = "url"
    user: str | None = None
    steps: int = 4
    seed: int = -1
    negative_prompt: str = ""
    cfg_scale: float = 1.0
    sampler: str = "default"
    priority: int = 5


class JobRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    prompt: str
    negative_prompt: str = ""
    width: int = 256
    height: int = 256
    steps: int = 4
    seed: int = -1
    cfg_scale: float = 1.0
    sampler: str = "default"
    scheduler: str = "default"
    batch_count: int = Field(default=1, ge=1, le=MAX_N)
    clip_skip: int = -1
    priority: int = 5
    submitter: str | None = None


def _check_side(value: int, param: str) -> None:
    if not (MIN_SIDE <= value <= MAX_SIDE) or value % SIDE_STEP:
        raise APIError(
            400,
            f"invalid {param}: {value} is not {MIN_SIDE}..{MAX_SIDE} and a multiple of {SIDE_STEP}",
            param=param,
            code="invalid_parameter",
        )


def parse_size(size: str) -> tuple[int, int]:
    """ "WxH" -> (W, H), each 64..2048 and a multiple of 8; APIError(400, param="size")."""
    m = re.fullmatch(r"\s*(\d{1,5})\s*[xX]\s*(\d{1,5})\s*", size or "")
    if not m:
        raise APIError(
            400, f"invalid size: {size!r} is not WIDTHxHEIGHT", param="size", code="invalid_size"
        )
    w, h = int(m.group(1)), int(m.group(2))
    for v in (w, h):
        _check_side(v, "size")
    return w, h


def _validate(model: type[BaseModel], body: Any) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc.errors()) from None


def _validation_error(errors: Sequence[Any]) -> APIError:
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = loc[-1] if loc else None
    msg = first.get("msg", "invalid request")
    return APIError(
        400,
        f"invalid {param or 'request'}: {msg}",
        param=param,
        code="invalid_parameter",
    )


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw or b"null")
    except ValueError as exc:
        raise APIError(400, f"the body is not JSON: {exc}", code="invalid_json") from None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """Every error the gateway answers, in OpenAI's shape."""

    error: ErrorDetail


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for the error statuses an endpoint documents."""
    why = {
        400: "invalid request", 401: "missing or invalid bearer token", 404: "not found",
        409: "the job is not in a state that allows this", 413: "the body is too large",
        429: "the queue is full (Retry-After)", 503: "the farm (Redis) is unavailable",
        504: "the job did not finish in time", 507: "the model does not fit any device",
    }  # fmt: skip
    return {c: {"model": ErrorBody, "description": why[c]} for c in codes}


def _json_body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI requestBody of a JSON body that the handler validates itself."""
    return {
        "required": True,
        "content": {"application/json": {"schema": model.model_json_schema()}},
    }


# -- body size limit (pure ASGI, so a chunked body is counted too) -----------------------------


class BodyLimit:
    def __init__(self, app: Any, limit: int = MAX_BODY) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = APIError(
            413,
            f"the request body is over {self.limit} bytes",
            code="request_too_large",
        ).response()
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await too_large(scope, receive, send)
            return
        if scope.get("method") in ("GET", "HEAD", "DELETE", "OPTIONS") and length is None:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        total = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            total += len(chunk)
            if total > self.limit:
                await too_large(scope, receive, send)
                return
            chunks.append(chunk)
            if not msg.get("more_body"):
                break
        body = b"".join(chunks)
        sent = False

        async def replay() -> Any:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


# -- the app -----------------------------------------------------------------------------------


def _url_key(tokens: Sequence[str]) -> bytes:
    """The key that signs image URLs: derived from the tokens, so replicas of a gateway with
    the same tokens accept each other's URLs."""
    return hashlib.sha256(b"sdfarm-gateway-url\0" + "\0".join(sorted(tokens)).encode()).digest()


def create_app(
    redis_url: str,
    *,
    tokens: Sequence[str] = (),
    timeout_s: float = DEFAULT_TIMEOUT_S,
    farm: Farm | None = None,
    rate_per_minute: float = DEFAULT_RATE_PER_MINUTE,
) -> FastAPI:
    """The gateway over the farm at `redis_url`. With `tokens`, every endpoint except
    /healthz needs `Authorization: Bearer <token>` (image URLs the gateway hands out carry a
    signature instead, so OpenAI clients can fetch them). Each token (or, without tokens,
    each client address) gets `rate_per_minute` API requests a minute, in bursts of 10 s'
    worth; beyond that: 429 with Retry-After."""
    tokens = [t for t in tokens if t]
    limiter = RateLimiter(rate_per_minute)
    url_key = _url_key(tokens)
    the_farm = farm or Farm(redis_url, submitter="gateway")
    app = FastAPI(title="sdfarm gateway", version="0.1.0")
    app.state.farm = the_farm
    recent = RecentJobs()
    app.state.recent = recent
    app.add_middleware(BodyLimit)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    def sign(job_id: str, i: int) -> str:
        return hmac.new(url_key, f"{job_id}:{i}".encode(), hashlib.sha256).hexdigest()[:32]

    def authorize(request: Request) -> None:
        if not tokens:
            limit(request.client.host if request.client else "")
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() == "bearer" and given:
            for t in tokens:
                if hmac.compare_digest(given.strip().encode(), t.encode()):
                    limit("token:" + t)
                    return
            raise APIError(
                401, "invalid bearer token", type="authentication_error", code="invalid_api_key"
            )
        raise APIError(
            401,
            "missing bearer token: send Authorization: Bearer <token>",
            type="authentication_error",
            code="missing_api_key",
        )

    def limit(key: str) -> None:
        wait = limiter.take(key)
        if wait > 0:
            raise APIError(
                429,
                f"rate limit: more than {rate_per_minute:g} requests a minute; retry in "
                f"{wait:.1f} s",
                type="rate_limit_error",
                code="rate_limited",
                headers={"Retry-After": str(max(1, math.ceil(wait)))},
            )

    def authorize_page(request: Request) -> None:
        """The status page and its JSON: open to loopback clients, else as the API."""
        host = request.client.host if request.client else ""
        try:
            if ipaddress.ip_address(host).is_loopback:
                return
        except ValueError:
            pass
        authorize(request)

    def image_url(job_id: str, i: int) -> str:
        q = f"i={i}" + (f"&sig={sign(job_id, i)}" if tokens else "")
        return f"v1/jobs/{job_id}/image.png?{q}"

    def job_or_404(job_id: str) -> Any:
        if not re.fullmatch(r"[0-9a-f]{32}", job_id):
            raise APIError(404, f"no job {job_id}", param="id", code="job_not_found")
        job = the_farm.job(job_id)
        if not job.state():
            raise APIError(404, f"no job {job_id} (unknown or expired)", code="job_not_found")
        return job

    # -- OpenAI ---------------------------------------------------------------------------

    @app.post(
        "/v1/images/generations",
        responses=_errors(400, 401, 404, 409, 413, 429, 503, 504, 507),
    )
    def images_generations(request: Request, body: dict[str, Any] | None = None) -> Any:
        authorize(request)
        req = _validate(ImagesRequest, body)
        if req.response_format not in ("url", "b64_json"):
            raise APIError(
                400,
                f"invalid response_format: {req.response_format!r} (url or b64_json)",
                param="response_format",
                code="invalid_parameter",
            )
        width, height = parse_size(req.size)
        try:
            job = the_farm.submit(
                req.model,
                req.prompt,
                negative_prompt=req.negative_prompt,
                width=width,
                height=height,
                steps=req.steps,
                seed=req.seed,
                cfg_scale=req.cfg_scale,
                sampler=req.sampler,
                batch_count=req.n,
                priority=req.priority,
                submitter=req.user or "gateway",
            )
            recent.add(job.id)
            result = job.result(timeout_s)
        except Exception as exc:  # noqa: BLE001 - every error becomes an OpenAI error
            raise _farm_error(exc, size_param=True) from None
        created = int(time.time())
        if req.response_format == "b64_json":
            data = [{"b64_json": base64.b64encode(p).decode()} for p in result.pngs]
        else:
            base = str(request.base_url).rstrip("/")
            data = []
            for i in range(len(result.pngs)):
                data.append({"url": f"{base}/{image_url(job.id, i)}"})
        return {"created": created, "data": data}

    @app.get("/v1/models", responses=_errors(401, 503))
    def list_models(request: Request) -> Any:
        authorize(request)
        try:
            models = the_farm.models()
        except Exception as exc:  # noqa: BLE001
            raise _farm_error(exc) from None
        return {
            "object": "list",
            "data": [
                {"id": m["name"], "object": "model", "created": 0, "owned_by": "sdfarm"}
                for m in models
            ],
        }

    # -- jobs -----------------------------------------------------------------------------

    @app.post(
        "/v1/jobs",
        status_code=202,
        responses=_errors(400, 401, 404, 413, 429, 503),
    )
    def create_job(request: Request, body: dict[str, Any] | None = None) -> Any:
        authorize(request)
        req = _validate(JobRequest, body)
        _check_side(req.width, "width")
        _check_side(req.height, "height")
        try:
            job = the_farm.submit(
                req.model,
                req.prompt,
                negative_prompt=req.negative_prompt,
                width=req.width,
                height=req.height,
                steps=req.steps,
                seed=req.seed,
                cfg_scale=req.cfg_scale,
                sampler=req.sampler,
                scheduler=req.scheduler,
                batch_count=req.batch_count,
                clip_skip=req.clip_skip,
                priority=req.priority,
                submitter=req.submitter or "gateway",
            )
        except Exception as exc:  # noqa: BLE001
            raise _farm_error(exc) from None
        recent.add(job.id)
        return {"id": job.id, "state": "queued"}

    @app.get("/v1/jobs/{job_id}", responses=_errors(401, 404, 503))
    def get_job(request: Request, job_id: str) -> Any:
        authorize(request)
        job = job_or_404(job_id)
        rec = job.record()
        spec = json.loads(rec.get("spec") or "{}")
        count = protocol.decode(the_farm.r.hget(protocol.result_key(job_id), "count"))
        doc: dict[str, Any] = {
            "id": job_id,
            "state": rec.get("state", ""),
            "model": rec.get("model", ""),
            "submitter": rec.get("submitter", ""),
            "priority": int(rec.get("priority") or 0),
            "params": spec.get("params", {}),
            "device": rec.get("device") or None,
            "created": float(rec["created"]) if rec.get("created") else None,
            "ended": float(rec["ended"]) if rec.get("ended") else None,
            "error": rec.get("error") or None,
            "estimate": int(rec["estimate"]) if rec.get("estimate", "").isdigit() else None,
            "progress": job.progress(),
            "images": int(count) if count.isdigit() else 0,
        }
        if doc["state"] == "done":
            doc["image_urls"] = [f"/v1/jobs/{job_id}/image.png?i={i}" for i in range(doc["images"])]
        return doc

    @app.get(
        "/v1/jobs/{job_id}/image.png",
        responses={200: {"content": {"image/png": {}}}, **_errors(401, 404, 409, 503)},
    )
    def get_image(request: Request, job_id: str, i: int = 0, sig: str = "") -> Any:
        if not (tokens and sig and hmac.compare_digest(sig.encode(), sign(job_id, i).encode())):
            authorize(request)
        job = job_or_404(job_id)
        state = job.state()
        if state != "done":
            raise APIError(409, f"job {job_id} is {state}, it has no image", code="job_not_done")
        png = the_farm.r.hget(protocol.result_key(job_id), f"png:{i}")
        if png is None:
            raise APIError(404, f"job {job_id} has no image {i}", param="i", code="no_image")
        return Response(png, media_type="image/png")

    @app.delete("/v1/jobs/{job_id}", responses=_errors(401, 404, 503))
    def cancel_job(request: Request, job_id: str) -> Any:
        authorize(request)
        job = job_or_404(job_id)
        cancelled = job.cancel()
        return {"id": job_id, "cancelled": cancelled, "state": job.state()}

    @app.get(
        "/v1/jobs/{job_id}/events",
        responses={200: {"content": {"text/event-stream": {}}}, **_errors(401, 404, 503)},
    )
    def job_events(request: Request, job_id: str) -> Any:
        authorize(request)
        job_or_404(job_id)
        return StreamingResponse(
            _sse(the_farm, job_id),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    # -- farm -----------------------------------------------------------------------------

    @app.get("/v1/devices", responses=_errors(401, 503))
    def devices(request: Request) -> Any:
        authorize(request)
        try:
            status = the_farm.status()
        except Exception as exc:  # noqa: BLE001
            raise _farm_error(exc) from None
        return {"object": "list", "data": status["devices"]}

    @app.get("/", response_class=HTMLResponse, responses=_errors(401))
    def status_page(request: Request) -> Any:
        authorize_page(request)
        return HTMLResponse(PAGE_HTML, headers={"Cache-Control": "no-cache"})

    @app.get("/v1/status", responses=_errors(401, 503))
    def farm_status(request: Request) -> Any:
        authorize_page(request)
        try:
            return status_doc(the_farm, recent.ids(), image_url)
        except Exception as exc:  # noqa: BLE001
            raise _farm_error(exc) from None

    @app.get("/healthz", responses={503: {"description": "Redis is unreachable"}})
    def healthz() -> Any:
        try:
            the_farm.r.ping()
        except Exception as exc:  # noqa: BLE001
            return JSONResponse({"ok": False, "redis": str(exc)}, status_code=503)
        return {"ok": True}

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses=_errors(401, 503),
    )
    def metrics(request: Request) -> Any:
        authorize(request)
        try:
            text = prometheus_text(the_farm)
        except Exception as exc:  # noqa: BLE001
            raise _farm_error(exc) from None
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        """FastAPI's document, with the bodies the handlers validate themselves described."""
        if app.openapi_schema is None:
            doc = default_openapi()
            paths = doc["paths"]
            paths["/v1/images/generations"]["post"]["requestBody"] = _json_body_doc(ImagesRequest)
            paths["/v1/jobs"]["post"]["requestBody"] = _json_body_doc(JobRequest)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


# -- server-sent events ------------------------------------------------------------------------


def _sse(farm: Farm, job_id: str) -> Iterator[bytes]:
    """The job's events as SSE (`event: <kind>`, `data: <json>`), from the first one; ends
    after done, failed or cancelled. Reads the events list every SSE_POLL_S (an LRANGE of at
    most EVENTS_CAP short strings); the list is trimmed from the front, so the position is
    found again by the last event sent."""
    key = protocol.events_key(job_id)
    last: bytes | None = None
    last_t = 0.0
    idle = time.monotonic()
    while True:
        raw = farm.r.lrange(key, 0, -1)
        start = 0
        if last is not None:
            try:
                start = len(raw) - raw[::-1].index(last)
            except ValueError:  # trimmed past it: what is newer than it
                start = next((k for k, x in enumerate(raw) if _event_t(x) > last_t), len(raw))
        for item in raw[start:]:
            last, last_t = item, _event_t(item)
            try:
                ev = json.loads(item)
            except ValueError:
                continue
            kind = str(ev.get("event", "message"))
            yield f"event: {kind}\ndata: {json.dumps(ev)}\n\n".encode()
            idle = time.monotonic()
            if kind in EVENT_FINAL:
                return
        state = protocol.decode(farm.r.hget(protocol.job_key(job_id), "state"))
        if not state or (state in EVENT_FINAL and not farm.r.exists(key)):
            yield f"event: {state or 'expired'}\ndata: {json.dumps({'state': state})}\n\n".encode()
            return
        if time.monotonic() - idle > SSE_KEEPALIVE_S:
            idle = time.monotonic()
            yield b": keepalive\n\n"
        time.sleep(SSE_POLL_S)


def _event_t(raw: bytes) -> float:
    try:
        return float(json.loads(raw).get("t", 0.0))
    except (ValueError, AttributeError, TypeError):
        return 0.0


# -- Prometheus --------------------------------------------------------------------------------


def prometheus_text(farm: Farm) -> str:
    """Jobs by state (the job records Redis holds: recent ones, within the result TTL), queue
    depth by priority, devices known and alive."""
    r = farm.r
    by_state = dict.fromkeys(protocol.STATES, 0)
    keys = list(r.scan_iter(match=protocol.job_key("*"), count=1000))
    for i in range(0, len(keys), 1000):
        pipe = r.pipeline(transaction=False)
        for k in keys[i : i + 1000]:
            pipe.hget(k, "state")
        for s in pipe.execute():
            s = protocol.decode(s)
            if s in by_state:
                by_state[s] += 1
    status = farm.status()
    lines = [
        "# HELP sdfarm_jobs Jobs Redis holds a record of, by state.",
        "# TYPE sdfarm_jobs gauge",
        *(f'sdfarm_jobs{{state="{s}"}} {n}' for s, n in by_state.items()),
        "# HELP sdfarm_queue_depth Jobs waiting for placement, by priority.",
        "# TYPE sdfarm_queue_depth gauge",
        *(f'sdfarm_queue_depth{{priority="{p}"}} {n}' for p, n in status["queues"].items()),
        "# HELP sdfarm_queue_pending Jobs waiting for placement (the queue limit counts these).",
        "# TYPE sdfarm_queue_pending gauge",
        f"sdfarm_queue_pending {status['pending']}",
        "# HELP sdfarm_devices Devices known to the farm.",
        "# TYPE sdfarm_devices gauge",
        f"sdfarm_devices {len(status['devices'])}",
        "# HELP sdfarm_devices_alive Devices with a live heartbeat.",
        "# TYPE sdfarm_devices_alive gauge",
        f"sdfarm_devices_alive {sum(1 for d in status['devices'] if d.get('alive'))}",
        "# HELP sdfarm_jobs_running Jobs placed or running on a device.",
        "# TYPE sdfarm_jobs_running gauge",
        f"sdfarm_jobs_running {len(status['running'])}",
    ]
    return "\n".join(lines) + "\n"
