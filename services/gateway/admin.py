"""The gateway's operations routes: pool membership (`/admin/pools`) and readiness (`/ready`).

    GET /admin/pools                      every pool: its replica count, bounds, and each
                                          member's state, address and load
    PUT /admin/pools/{pool} {"replicas": N}   202: the pool's new count; members are placed
                                          or drained in the background (poll GET)
    GET /admin/scrape-targets             the members serving their own /metrics, as
                                          Prometheus' HTTP service discovery reads them
                                          (`[]` when one embedded engine serves)
    GET /ready                            200 while serving; 503 while draining (SIGTERM) or
                                          when no engine serves or the engine is dead
                                          (`/health` is liveness)

The admin routes need the API key when one is set (`RequireAPIKey`). The composition root
hands in what changes the pools as `app.state.pools` (a `PoolControl`: the Ray deployment's
`PoolManager`); the embedded deployment has no pools, and `/admin/pools` answers 404 there.
"""
from __future__ import annotations

from typing import Protocol

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from services.gateway.drain import Drain, RefuseWhileDraining
from services.gateway.protocol import APIError


class PoolError(ValueError):
    """A scale request the deployment refuses: `status` 404 (no such pool), 400 (a count
    out of bounds) or 409 (a pool this deployment cannot resize); `param` the field."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


class PoolControl(Protocol):
    """What the admin routes drive. Its methods return at once (no placement waits) and
    may be called from the gateway's event loop."""

    def view(self) -> dict:
        """`{"object": "list", "data": [pool, ...]}`; a pool: `pool`, `replicas` (the
        desired count), `min_replicas`, `max_replicas`, `scalable` (and `reason` when not),
        `members`: `name`, `state` (pending | starting | ready | draining), `address`,
        `load` (per pool kind), `since_s` (in that state)."""

    def scale(self, pool: str, replicas: int) -> dict:
        """Set `pool`'s desired count; returns the pool as `view` shows it. Raises
        `PoolError`."""

    def scrape_targets(self) -> list[dict]:
        """`[{"targets": ["host:port"], "labels": {"pool": pool}}, ...]`: each ready or
        draining member's /metrics."""


class ScaleRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    replicas: int


router = APIRouter()


def _pools(request: Request) -> PoolControl:
    pools = getattr(request.app.state, "pools", None)
    if pools is None:
        raise APIError(404, "this deployment has no pools: one embedded engine serves "
                            "(pools are the Ray deployment's: splitstack serve "
                            "--disaggregated)", code="no_pools")
    return pools


@router.get("/admin/pools")
async def list_pools(request: Request):
    return _pools(request).view()


@router.put("/admin/pools/{pool}", status_code=202)
async def scale_pool(pool: str, body: ScaleRequest, request: Request):
    control = _pools(request)
    try:
        return control.scale(pool, body.replicas)
    except PoolError as err:
        raise APIError(err.status, str(err), err.param, code=err.code) from err


@router.get("/admin/scrape-targets")
async def scrape_targets(request: Request):
    pools = getattr(request.app.state, "pools", None)
    return pools.scrape_targets() if pools is not None else []


@router.get("/ready")
async def ready(request: Request):
    drain: Drain = request.app.state.drain
    if drain.draining:
        status = "draining"
    elif request.app.state.gateway.backend.dead_since() is not None:
        status = "engine dead"
    elif not request.app.state.gateway.backend.healthy():
        status = "no engine is serving"
    else:
        status = "ready"
    return JSONResponse({"status": status}, status_code=200 if status == "ready" else 503)


def install(app) -> None:
    """The routes, and the drain state `/ready` and the HTTP server read (`app.state.drain`);
    after `limits.install` (its refusal counter)."""
    app.state.drain = Drain()
    app.add_middleware(RefuseWhileDraining, drain=app.state.drain)
    app.include_router(router)
