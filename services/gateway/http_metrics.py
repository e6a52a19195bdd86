"""Every HTTP response the gateway writes, counted by route and status code
(`splitstack_http_requests_total{route, code}`): the availability objective's errors and
total.

`CountResponses` is the outermost ASGI middleware, so it sees what every inner layer
refuses (the API key's 401, the body limit's 413 and 408, the admission queue's and the
drain's 503, the rate limit's 429) as well as the routes' answers, the 503 of a deployment
with no attention service among them. The HTTP server counts the two responses it writes
before a request exists (`services.gateway.http_server`: 429 past the per-client connection
cap, 408 when headers never arrive) under route `none`.

`route` is the matched route's template (`/v1/models/{model:path}`), the path itself when a
middleware answered before routing, or `other` for a path no route serves, so its values
stay few. A request whose client left before any response is counted under code `499`
(nginx's "client closed request"); one whose handler raised is counted `500`, the response
Starlette's outermost error handler writes.
"""
from __future__ import annotations

import asyncio

from prometheus_client import Counter

UNPARSED = "none"       # the route of a response written before any request was read
CLIENT_LEFT = "499"


def route_of(scope) -> str:
    route = scope.get("route")
    if route is not None and getattr(route, "path", None):
        return route.path
    app = scope.get("app")
    paths = {getattr(r, "path", None) for r in getattr(app, "routes", ())}
    return scope["path"] if scope["path"] in paths else "other"


class CountResponses:
    """ASGI middleware: counts each HTTP response once, when its status line is sent."""

    def __init__(self, app, counter: Counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        code = None

        async def counted(message):
            nonlocal code
            if message["type"] == "http.response.start" and code is None:
                code = str(message["status"])
                self.counter.labels(route_of(scope), code).inc()
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except asyncio.CancelledError:
            if code is None:
                self.counter.labels(route_of(scope), CLIENT_LEFT).inc()
            raise
        except Exception:
            if code is None:
                self.counter.labels(route_of(scope), "500").inc()
            raise
        if code is None:
            self.counter.labels(route_of(scope), CLIENT_LEFT).inc()


def install(app) -> None:
    """Last of `build_app`'s middlewares, so that it is the outermost."""
    app.add_middleware(CountResponses, counter=app.state.gateway.metrics.http_requests)
