"""The HTTP server `splitstack serve` runs: uvicorn with its h11 protocol, plus the
connection limits uvicorn lacks.

uvicorn times out only idle kept-alive connections, after a response. A connection that
never sends a request, or sends its headers a byte at a time (slowloris), is held as long
as the client likes, and any client may open as many as it likes. `GuardedH11Protocol`
adds:

- a header timeout: from the connection (or a kept-alive request's first byte) to the
  end of the request's headers; past it the connection is closed (it also ends the
  discarding of a refused body that goes on longer);
- a cap on open connections per client address: past it the connection is answered 429
  (Retry-After) and closed before a request is read.

Headers are limited to `MAX_HEADER_BYTES` (h11; larger ones get 400), idle kept-alive
connections to `HttpLimits.keep_alive_s`, and bodies by `limits.BodyLimit`.
"""
from __future__ import annotations

import collections
import functools
import json

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from services.gateway.drain import EXIT_ENGINE_DEAD, DrainingServer
from services.gateway.http_metrics import UNPARSED
from services.gateway.limits import HttpLimits
from services.gateway.protocol import APIError

MAX_HEADER_BYTES = 16 << 10


class ClientConnections:
    """Open connections per client address (one event loop: no lock needed)."""

    def __init__(self, cap: int):
        self.cap = cap
        self.open = collections.Counter()

    def add(self, client: str) -> bool:
        if self.open[client] >= self.cap:
            return False
        self.open[client] += 1
        return True

    def remove(self, client: str) -> None:
        self.open[client] -= 1
        if self.open[client] <= 0:
            del self.open[client]


def _raw_response(status: int, reason: str, error: APIError, retry_after: int | None) -> bytes:
    """A whole response written before any request was parsed (h11 cannot send one)."""
    body = json.dumps(error.body()).encode()
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json",
            f"content-length: {len(body)}", "connection: close"]
    if retry_after is not None:
        head.append(f"retry-after: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    def __init__(self, config, server_state, app_state, _loop=None, *, limits: HttpLimits,
                 clients: ClientConnections, refused):
        """`refused(reason, code)`: counts a refusal (`splitstack_http_refusals_total`) and,
        when `code` is not None, the response this protocol wrote for it
        (`splitstack_http_requests_total`: no ASGI middleware saw it)."""
        super().__init__(config, server_state, app_state, _loop)
        self.limits, self.clients, self.refused = limits, clients, refused
        self.address: str | None = None          # the client address, once counted
        self.header_timer = None
        self.awaited = None     # the cycle that was current when the header timer started

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        address = self.client[0] if self.client else "unknown"
        if not self.clients.add(address):
            self.refused("too_many_connections", 429)
            error = APIError(429, f"too many open connections from {address} (at most "
                                  f"{self.clients.cap})", code="too_many_connections")
            transport.write(_raw_response(429, "Too Many Requests", error, retry_after=1))
            transport.close()
            return
        self.address = address
        self._start_header_timer()

    def connection_lost(self, exc) -> None:
        self._stop_header_timer()
        if self.address is not None:
            self.clients.remove(self.address)
            self.address = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.header_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._start_header_timer()         # the first bytes of a kept-alive request
        super().data_received(data)
        if self.header_timer is not None and self.cycle is not self.awaited:
            self._stop_header_timer()          # its headers are in: a new cycle started

    def _start_header_timer(self) -> None:
        self.awaited = self.cycle
        self.header_timer = self.loop.call_later(self.limits.header_timeout_s,
                                                 self._header_timeout)

    def _stop_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _header_timeout(self) -> None:
        self.header_timer = None
        if self.transport.is_closing():
            return
        # not idle: still sending a refused body, whose response was written and counted
        answer = self.conn.their_state is h11.IDLE
        self.refused("header_timeout", 408 if answer else None)
        if answer:
            error = APIError(408, f"the request headers did not arrive within "
                                  f"{self.limits.header_timeout_s:g} s", code="request_timeout")
            self.transport.write(_raw_response(408, "Request Timeout", error, None))
        self.transport.close()


def server_config(app, host: str, port: int, limits: HttpLimits,
                  log_level: str = "info") -> uvicorn.Config:
    """uvicorn's config for `app` (built by `build_app` with `limits`) behind the guarded
    protocol."""
    refusals = app.state.limit_metrics.refusals
    responses = app.state.gateway.metrics.http_requests

    def refused(reason: str, code: int | None) -> None:
        refusals.labels(reason).inc()
        if code is not None:
            responses.labels(UNPARSED, str(code)).inc()

    protocol = functools.partial(GuardedH11Protocol, limits=limits,
                                 clients=ClientConnections(limits.max_connections_per_client),
                                 refused=refused)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol,
                          timeout_keep_alive=limits.keep_alive_s,
                          h11_max_incomplete_event_size=MAX_HEADER_BYTES)


def serve(app, host: str, port: int, limits: HttpLimits, log_level: str = "info",
          drain_timeout_s: float = 30.0) -> int:
    """Until SIGTERM, then drains (`services.gateway.drain`) for at most `drain_timeout_s`;
    or until the engine failed stop. Returns the process's exit status: 0, or
    `EXIT_ENGINE_DEAD`."""
    config = server_config(app, host, port, limits, log_level)
    server = DrainingServer(config, app.state.drain, drain_timeout_s,
                            dead_since=app.state.gateway.backend.dead_since)
    server.run()
    return EXIT_ENGINE_DEAD if server.engine_died else 0
