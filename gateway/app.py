"""The gateway's HTTP application: the OpenAI images API, AUTOMATIC1111's API, the jobs API,
devices, health and
Prometheus metrics, all over one `Farm` (through its Store; the gateway holds no state of its
own but the ids of the jobs it submitted, for the status page) and, for what the event loop
reads itself (waiting for a job's end, server-sent events, health), an `AsyncStore`
(sdfarm.store.aio) whose one pub/sub connection wakes every waiting request and stream.

`create_app(redis_url, tokens=[...])` returns a FastAPI app; `sdfarm gateway` serves it with
uvicorn (sdfarm.gateway.cli). This module only wires the parts: the routes
(`routes_openai`, `routes_jobs`, `routes_farm`) read what they need from `app.state` (`farm`,
`aio`, `gate`, `recent`, `timeout_s`, `metrics`: its prometheus_client registry); the Host
check and the body limit wrap them all, and the request metrics wrap those.
Errors always have OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`
(sdfarm.gateway.errors).
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute

from sdfarm.client.farm import Farm
from sdfarm.gateway import routes_a1111, routes_farm, routes_jobs, routes_openai, routes_videos
from sdfarm.gateway.auth import Gate
from sdfarm.gateway.bodylimit import BodyLimit
from sdfarm.gateway.errors import APIError, add_handlers
from sdfarm.gateway.hosts import LOCAL_HOSTS, AllowedHosts, HostCheck
from sdfarm.gateway.metrics import HttpMetrics, gateway_registry
from sdfarm.gateway.status import RecentJobs
from sdfarm.store.aio import AsyncStore

DEFAULT_TIMEOUT_S = 600.0
DEFAULT_RATE_PER_MINUTE = 600.0
ROUTERS = (
    routes_openai.router,
    routes_jobs.router,
    routes_videos.router,
    routes_farm.router,
    routes_a1111.router,
)
AIO_OPTIONS = {"socket_connect_timeout": 5.0, "socket_timeout": 30.0}

GATEWAY_RETRY_S = 2.0

__all__ = ["APIError", "create_app"]


class AioStores:
    """The app's AsyncStore, one per event loop (a redis.asyncio connection belongs to the
    loop that opened it; a server has one loop, a test client may start several), made on
    first use and closed with the app's lifespan."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._stores: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncStore] = (
            weakref.WeakKeyDictionary()
        )

    def get(self) -> AsyncStore:
        loop = asyncio.get_running_loop()
        store = self._stores.get(loop)
        if store is None:
            store = self._stores[loop] = AsyncStore.connect(self.url, **AIO_OPTIONS)
        return store

    async def close(self) -> None:
        """Close the running loop's store (the others went with their loops)."""
        store = self._stores.pop(asyncio.get_running_loop(), None)
        if store is not None:
            with contextlib.suppress(Exception):
                await store.close()


def create_app(
    redis_url: str,
    *,
    tokens: Sequence[str] = (),
    operator_tokens: Sequence[str] = (),
    timeout_s: float = DEFAULT_TIMEOUT_S,
    farm: Farm | None = None,
    rate_per_minute: float = DEFAULT_RATE_PER_MINUTE,
    trusted_proxies: Sequence[str] = (),
    allowed_hosts: Sequence[str] = LOCAL_HOSTS,
    rate_storage: str | None = None,
    max_jobs_per_token: int = 0,
) -> FastAPI:
    """The gateway over the farm at `redis_url`. With `tokens` or `operator_tokens`, every
    endpoint except /healthz needs `Authorization: Bearer <token>` (image URLs the gateway
    hands out carry a signature instead, so OpenAI clients can fetch them); a normal token
    sees only the jobs it submitted, an operator token every job (sdfarm.gateway.auth).
    Each token (or, without one, each client address: the peer, or what X-Forwarded-For says
    when the peer is in `trusted_proxies`, CIDRs) gets `rate_per_minute` API requests a
    minute, in bursts of 10 s' worth; beyond that: 429 with Retry-After. The counts live in
    `rate_storage`, by default the farm's Redis, so every gateway on one farm shares one limit
    ("memory://": this process only). With `max_jobs_per_token`, a token may have that many
    live jobs (queued, placed, running) at once, counted in the farm's Redis; a submit beyond
    it: 429 quota_exceeded with Retry-After. A request whose Host header is not in `allowed_hosts`
    (names, "*.suffix", or "*" for any) gets 400."""
    app = FastAPI(title="sdfarm gateway", version="0.1.0", lifespan=_lifespan)
    app.state.gate = Gate(
        tokens,
        rate_per_minute,
        operator_tokens=operator_tokens,
        trusted_proxies=trusted_proxies,
        rate_storage=rate_storage or redis_url,
        job_quota=max_jobs_per_token,
    )
    # A request does not hang on a Redis that is away: 503 after a short wait, not 30 s.
    app.state.farm = farm or Farm(redis_url, submitter="gateway", retry_s=GATEWAY_RETRY_S)
    app.state.aio = AioStores(redis_url)
    app.state.recent = RecentJobs()
    app.state.timeout_s = timeout_s
    app.state.metrics = gateway_registry(app.state.farm)
    app.add_middleware(BodyLimit)
    app.add_middleware(HostCheck, allowed=AllowedHosts(allowed_hosts))
    app.add_middleware(HttpMetrics, registry=app.state.metrics)  # outermost: counts refusals
    add_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    yield
    await app.state.aio.close()
    await app.state.gate.limiter.close()


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
