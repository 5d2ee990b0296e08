"""Every error the gateway answers, in OpenAI's shape `{"error": {"message", "type", "param",
"code"}}`: `APIError`, how the client's and the jobs' errors map to HTTP statuses, the
handlers that give FastAPI's own errors the same shape, and the models that document it.

One place for this so that every route, the body limit and the OpenAPI document agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from sdfarm.client.farm import FarmBusyError, FarmError, JobCancelled, JobFailed, UnknownModelError
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
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return JSONResponse({"error": error}, status_code=self.status, headers=self.headers)


def _farm_error(exc: BaseException, *, size_param: bool = False) -> APIError:
    """The HTTP answer for an error of the client or of a job. `size_param`: name parameters
    as OpenAI's images request does (width and height are `size`, batch_count is `n`)."""
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
    """Answer APIError, FastAPI's validation errors and Starlette's 404/405 in OpenAI's shape."""

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
