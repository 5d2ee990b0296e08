"""The farm as a whole: `GET /v1/devices`, the status page (`GET /`) and its JSON
(`GET /v1/status`), `GET /healthz` (open, for load balancers) and `GET /metrics`
(Prometheus).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse

from sdfarm.client.farm import Farm
from sdfarm.gateway.auth import gate, require_page, require_token
from sdfarm.gateway.errors import _errors, _farm_error
from sdfarm.gateway.metrics import prometheus_text
from sdfarm.gateway.page import PAGE_HTML
from sdfarm.gateway.status import status_doc

router = APIRouter()


@router.get("/v1/devices", dependencies=[Depends(require_token)], responses=_errors(401, 503))
def devices(request: Request) -> Any:
    farm: Farm = request.app.state.farm
    try:
        status = farm.status()
    except Exception as exc:  # noqa: BLE001
        raise _farm_error(exc) from None
    return {"object": "list", "data": status["devices"]}


@router.get(
    "/",
    response_class=HTMLResponse,
    dependencies=[Depends(require_page)],
    responses=_errors(401),
)
def status_page() -> Any:
    return HTMLResponse(PAGE_HTML, headers={"Cache-Control": "no-cache"})


@router.get("/v1/status", dependencies=[Depends(require_page)], responses=_errors(401, 503))
def farm_status(request: Request) -> Any:
    state = request.app.state
    try:
        return status_doc(state.farm, state.recent.ids(), gate(request).image_url)
    except Exception as exc:  # noqa: BLE001
        raise _farm_error(exc) from None


@router.get("/healthz", responses={503: {"description": "Redis is unreachable"}})
def healthz(request: Request) -> Any:
    farm: Farm = request.app.state.farm
    try:
        farm.store.ping()
    except Exception as exc:  # noqa: BLE001
        return JSONResponse({"ok": False, "redis": str(exc)}, status_code=503)
    return {"ok": True}


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    dependencies=[Depends(require_token)],
    responses=_errors(401, 503),
)
def metrics(request: Request) -> Any:
    try:
        text = prometheus_text(request.app.state.farm)
    except Exception as exc:  # noqa: BLE001
        raise _farm_error(exc) from None
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")
