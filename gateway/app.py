"""The gateway's HTTP application: the OpenAI images API, the jobs API, devices, health and
Prometheus metrics, all over one `Farm` (through its Store; the gateway holds no state of its
own but the ids of the jobs it submitted, for the status page).

`create_app(redis_url, tokens=[...])` returns a FastAPI app; `sdfarm gateway` serves it with
uvicorn (sdfarm.gateway.cli). This module only wires the parts: the routes
(`routes_openai`, `routes_jobs`, `routes_farm`) read what they need from `app.state` (`farm`,
`gate`, `recent`, `timeout_s`). Errors always have OpenAI's shape:
`{"error": {"message", "type", "param", "code"}}` (sdfarm.gateway.errors).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute

from sdfarm.client.farm import Farm
from sdfarm.gateway import routes_farm, routes_jobs, routes_openai
from sdfarm.gateway.auth import Gate
from sdfarm.gateway.bodylimit import BodyLimit
from sdfarm.gateway.errors import APIError, add_handlers
from sdfarm.gateway.status import RecentJobs

DEFAULT_TIMEOUT_S = 600.0
DEFAULT_RATE_PER_MINUTE = 600.0
ROUTERS = (routes_openai.router, routes_jobs.router, routes_farm.router)

__all__ = ["APIError", "create_app"]


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
    app = FastAPI(title="sdfarm gateway", version="0.1.0")
    app.state.gate = Gate(tokens, rate_per_minute)
    app.state.farm = farm or Farm(redis_url, submitter="gateway")
    app.state.recent = RecentJobs()
    app.state.timeout_s = timeout_s
    app.add_middleware(BodyLimit)
    add_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, with the request bodies the routes describe themselves (the JSON
    schema of the model the handler validates with, `openapi_extra`) as pydantic writes them:
    FastAPI's own pass turns every bound into a float, and 2**63-1 (the largest seed) into 2**63.
    """
    if app.openapi_schema is None:
        doc = FastAPI.openapi(app)
        for route in (r for router in ROUTERS for r in router.routes):
            body = isinstance(route, APIRoute) and (route.openapi_extra or {}).get("requestBody")
            if body:
                for method in route.methods:
                    doc["paths"][route.path_format][method.lower()]["requestBody"] = body
        app.openapi_schema = doc
    return app.openapi_schema
