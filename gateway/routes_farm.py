"""The farm as a whole: `GET /v1/devices`, the status page (`GET /`) and its JSON
(`GET /v1/status`), `GET /healthz` (open, for load balancers) and `GET /metrics`
(Prometheus).

With tokens, the status page and its JSON need a token like the API, from loopback clients
too. A browser signs in once: `GET /?token=<token>` answers with a session cookie (the token's
fingerprint, an expiry and the gateway's signature; never the token) and a redirect to `/`;
`GET /` without a token shows a form that does that.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sdfarm.client.farm import Farm
from sdfarm.gateway.auth import (
    SESSION_COOKIE,
    SESSION_TTL_S,
    caller,
    gate,
    require_page,
    require_token,
)
from sdfarm.gateway.errors import APIError, _errors, _farm_error, scrub_paths
from sdfarm.gateway.page import LOGIN_HTML, PAGE_HTML
from sdfarm.gateway.status import status_doc

router = APIRouter()
HEALTH_TIMEOUT_S = 5.0
NO_CACHE = {"Cache-Control": "no-cache"}


@router.get("/v1/devices", dependencies=[Depends(require_token)], responses=_errors(401, 503))
def devices(request: Request) -> Any:
    farm: Farm = request.app.state.farm
    try:
        status = farm.status()
    except Exception as exc:  # noqa: BLE001
        raise _farm_error(exc) from None
    data = [
        {**d, "bad_models": {k: scrub_paths(str(v)) for k, v in d["bad_models"].items()}}
        if isinstance(d.get("bad_models"), dict)
        else d
        for d in status["devices"]
    ]
    return {"object": "list", "data": data}


@router.get("/", response_class=HTMLResponse, responses=_errors(401, 429))
async def status_page(request: Request, token: str = "") -> Any:
    """The page; with tokens, for a token or the page's session cookie. `?token=` signs a
    browser in: a session cookie and a redirect to the page without the token in the URL."""
    g = gate(request)
    try:
        if token and g.tokens_on:
            who = await g.token_caller(request, token)
            signed_in = RedirectResponse("./", status_code=303, headers=NO_CACHE)
            signed_in.set_cookie(
                SESSION_COOKIE,
                g.session_cookie(who),
                max_age=SESSION_TTL_S,
                path="/",
                httponly=True,
                samesite="strict",
            )
            return signed_in
        request.state.caller = await g.authorize(request, cookie=True)
    except APIError as exc:
        if exc.status != 401 or "text/html" not in request.headers.get("accept", ""):
            raise
        return HTMLResponse(LOGIN_HTML, status_code=401, headers=NO_CACHE)
    return HTMLResponse(PAGE_HTML, headers=NO_CACHE)


@router.get("/v1/status", dependencies=[Depends(require_page)], responses=_errors(401, 503))
def farm_status(request: Request) -> Any:
    state = request.app.state
    try:
        return status_doc(
            state.farm, state.recent.ids(), gate(request).image_url, viewer=caller(request)
        )
    except Exception as exc:  # noqa: BLE001
        raise _farm_error(exc) from None


@router.get("/healthz", responses={503: {"description": "Redis is unreachable"}})
async def healthz(request: Request) -> Any:
    """Async: a PING on the event loop, never queued behind the thread pool."""
    try:
        await asyncio.wait_for(request.app.state.aio.get().ping(), HEALTH_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001
        why = scrub_paths(str(exc) or type(exc).__name__)
        return JSONResponse({"ok": False, "redis": why}, status_code=503)
    return {"ok": True}


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    dependencies=[Depends(require_token)],
    responses=_errors(401, 503),
)
def metrics(request: Request) -> Any:
    """prometheus_client's exposition of the app's registry (sdfarm.gateway.metrics)."""
    try:
        text = generate_latest(request.app.state.metrics)
    except Exception as exc:  # noqa: BLE001
        raise _farm_error(exc) from None
    return PlainTextResponse(text, media_type=CONTENT_TYPE_LATEST)
