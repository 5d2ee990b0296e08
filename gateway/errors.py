"""Every error the gateway answers, in OpenAI's shape `{"error": {"message", "type", "param",
"code"}}`: `APIError`, how the client's and the jobs' errors map to HTTP statuses, the
handlers that give FastAPI's own errors the same shape, and the models that document it.

One place for this so that every route, the body limit, the host check and the OpenAPI
document agree; and so that no message leaves with a filesystem path in it (`scrub_paths`, run
on every error `APIError.response` writes): a worker's or the catalog's error names the model
folders it looked in, which are nobody's business over HTTP.

The statuses of a job's end: 507 only for a memory refusal (the failed job's record carries the
refusal's `figures`), 504 for a job failed by its deadline (or still unended well past it) and
for a wait that timed out, 500 `job_failed` for any other failure, 409 for a cancelled job.
Invalid parameters are 400 naming the parameter, a full queue, a spent rate or a token at its
live-jobs quota 429 with Retry-After, a farm whose Redis cannot be reached 503.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from sdfarm.client.farm import (
    FarmBusyError,
    FarmError,
    JobCancelled,
    JobFailed,
    QuotaExceededError,
    UnknownModelError,
)
from sdfarm.native.errors import InvalidParameterError

RETRY_AFTER_S = 5
OPENAI_NAMES = {
    "width": "size",
    "height": "size",
    "width x height": "size",
    "batch_count": "n",
    "submitter": "user",
}
"""The parameter an OpenAI images request carries each of these engine parameters in."""
DEADLINE = "deadline"
"""The reason of a job failed by its deadline (the scheduler's `failed` event says so)."""

_PATH = re.compile(
    r"""(?<![\w.~/\\-])"""  # not inside a word, a relative path or after another slash
    r"""(?:/(?!/)|[A-Za-z]:\\)"""  # POSIX "/x" (a URL's "//" is not a path) or Windows "C:\"
    r"""[^\s'"`<>|,;:()\[\]{}]+"""
)
PATH_MARK = "<path>"


def scrub_paths(text: str) -> str:
    """`text` with every absolute filesystem path replaced by PATH_MARK."""
    return _PATH.sub(PATH_MARK, text)


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
        """The error as HTTP, every path scrubbed from its message."""
        message = scrub_paths(self.message)
        error = {"message": message, "type": self.type, "param": self.param, "code": self.code}
        return JSONResponse({"error": error}, status_code=self.status, headers=self.headers)


def _farm_error(exc: BaseException, *, size_param: bool = False, reason: str = "") -> APIError:
    """The HTTP answer for an error of the client or of a job. `size_param`: name parameters
    as OpenAI's images request does (width and height are `size`, batch_count is `n`).
    `reason`: why a JobFailed's job failed, as its `failed` event says (DEADLINE: 504)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidParameterError):
        param = OPENAI_NAMES.get(exc.parameter, exc.parameter) if size_param else exc.parameter
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
    if isinstance(exc, QuotaExceededError):
        return APIError(
            429,
            str(exc),
            type="rate_limit_error",
            code="quota_exceeded",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    if isinstance(exc, JobFailed):
        return _job_failed(exc, reason)
    if isinstance(exc, JobCancelled):
        return APIError(409, str(exc), code="job_cancelled")
    if isinstance(exc, TimeoutError):
        return APIError(504, str(exc), type="server_error", code="timeout")
    if isinstance(exc, FarmError | RedisError | ConnectionError | OSError):
        return APIError(503, f"farm unavailable: {exc}", type="server_error", code="farm_error")
    return APIError(500, f"internal error: {exc}", type="server_error", code="internal_error")


def _job_failed(exc: JobFailed, reason: str) -> APIError:
    """507 for a memory refusal: the scheduler's or a worker's, both write the figures they
    refused with (every placed job has an estimate, so the estimate alone says nothing);
    504 for a job failed by its deadline; 500 otherwise."""
    if exc.figures:
        figs = ", ".join(
            f"{f.get('device', f.get('key', '?'))}: {f.get('figure', f)}"
            if isinstance(f, dict)
            else str(f)
            for f in exc.figures
        )
        return APIError(
            507,
            f"{exc} (estimate {exc.estimate} bytes; figures: {figs})",
            type="server_error",
            code="insufficient_memory",
        )
    if reason == DEADLINE:
        return APIError(504, str(exc), type="server_error", code="deadline_exceeded")
    return APIError(500, str(exc), type="server_error", code="job_failed")


def validation_error(errors: Sequence[Any]) -> APIError:
    """The 400 for pydantic's errors: the first one, naming its field as `param`."""
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = loc[-1] if loc else None
    msg = first.get("msg", "invalid request")
    return APIError(
        400, f"invalid {param or 'request'}: {msg}", param=param, code="invalid_parameter"
    )


def add_handlers(app: FastAPI) -> None:
    """Answer APIError, FastAPI's validation errors, Starlette's 404/405, a Redis that cannot
    be reached and any other error in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(RedisError)
    async def _redis(request: Request, exc: RedisError) -> JSONResponse:
        return _farm_error(exc).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return _farm_error(exc).response()


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
        403: "a signed URL that expired (code url_expired)",
        500: "the job failed (code job_failed)",
        409: "the job is not in a state that allows this", 413: "the body is too large",
        429: "the queue is full, or the caller's rate or live-jobs quota is spent (Retry-After)",
        503: "the farm (Redis) is unavailable",
        504: "the job did not finish in time (its deadline, or the wait's timeout)",
        507: "the model does not fit any device",
    }  # fmt: skip
    return {c: {"model": ErrorBody, "description": why[c]} for c in codes}
