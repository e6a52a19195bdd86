"""Security of the internal gRPC channels (attention, MLP pool, prefill, prefix-cache
probe): a shared token on every call, and optional TLS.

- Token: every client channel adds `authorization: Bearer <token>` to each call's metadata
  (a client interceptor); every server refuses a call without it with UNAUTHENTICATED (a
  server interceptor, constant-time comparison). The token comes from a file (a mounted
  Secret; `--grpc-token-file` or `$SPLITSTACK_GRPC_TOKEN_FILE`) or `$SPLITSTACK_GRPC_TOKEN`,
  never a flag's value (which `ps` would show); a deployment given none makes its own.
- TLS: servers present `cert_chain` / `private_key`, clients verify them against
  `root_ca`. Every process of a deployment is a server and a client, so all three are set
  together or not at all.

A `GrpcSecurity` travels to the Ray actors inside their config (pickled, never printed:
its repr says only what is set), and no log line carries the token.
"""
from __future__ import annotations

import collections
import hmac
import os
import secrets
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc

TOKEN_ENV = "SPLITSTACK_GRPC_TOKEN"
TOKEN_FILE_ENV = "SPLITSTACK_GRPC_TOKEN_FILE"
METADATA_KEY = "authorization"
REFUSAL = "missing or invalid splitstack gRPC token"


@dataclass(frozen=True)
class GrpcSecurity:
    token: str | None = field(default=None, repr=False)
    cert_chain: bytes | None = field(default=None, repr=False)     # PEM, this server's
    private_key: bytes | None = field(default=None, repr=False)    # PEM
    root_ca: bytes | None = field(default=None, repr=False)        # PEM, verifies servers

    def __post_init__(self):
        if self.token is not None and not (self.token.isascii() and self.token.isprintable()
                                           and self.token.strip() == self.token
                                           and self.token):
            # gRPC metadata values are printable ASCII; the value itself is not repeated
            raise ValueError("the gRPC token must be non-empty printable ASCII without "
                             "surrounding whitespace")
        tls = (self.cert_chain, self.private_key, self.root_ca)
        if any(v is not None for v in tls) and not all(v is not None for v in tls):
            raise ValueError("gRPC TLS needs the certificate, its private key and the CA "
                             "together (--grpc-tls-cert, --grpc-tls-key, --grpc-tls-ca)")

    def __repr__(self) -> str:
        return (f"GrpcSecurity(token={'set' if self.token else 'none'}, "
                f"tls={'on' if self.tls else 'off'})")

    @property
    def tls(self) -> bool:
        return self.cert_chain is not None

    @classmethod
    def load(cls, token_file: str | None = None, cert: str | None = None,
             key: str | None = None, ca: str | None = None, generate: bool = False,
             env: dict | None = None) -> GrpcSecurity:
        """The token from `token_file`, else `$SPLITSTACK_GRPC_TOKEN`, else the file
        `$SPLITSTACK_GRPC_TOKEN_FILE` names, else (with `generate`) a fresh random one; the
        TLS files as given. A missing file raises OSError naming the path."""
        env = os.environ if env is None else env
        token_file = token_file or env.get(TOKEN_FILE_ENV) or None
        if token_file:
            token = Path(token_file).read_text().strip()
            if not token:
                raise ValueError(f"the gRPC token file {token_file} is empty")
        else:
            token = env.get(TOKEN_ENV) or (secrets.token_urlsafe(32) if generate else None)
        files = [Path(p).read_bytes() if p else None for p in (cert, key, ca)]
        return cls(token, *files)

    # ---- servers ----------------------------------------------------------------------
    def server(self, max_workers: int, options=()) -> grpc.Server:
        """A thread-pool server that refuses calls without the token (when one is set)."""
        interceptors = [TokenCheck(self.token)] if self.token else []
        return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                           options=list(options), interceptors=interceptors)

    def add_port(self, server: grpc.Server, address: str) -> int:
        if not self.tls:
            return server.add_insecure_port(address)
        return server.add_secure_port(
            address, grpc.ssl_server_credentials([(self.private_key, self.cert_chain)]))

    # ---- clients ----------------------------------------------------------------------
    def channel(self, address: str, options=()) -> grpc.Channel:
        """A blocking-API channel whose calls carry the token."""
        if self.tls:
            ch = grpc.secure_channel(address, grpc.ssl_channel_credentials(self.root_ca),
                                     options=list(options))
        else:
            ch = grpc.insecure_channel(address, options=list(options))
        return grpc.intercept_channel(ch, TokenMetadata(self.token)) if self.token else ch

    def aio_channel(self, address: str, options=()) -> grpc.aio.Channel:
        """A grpc.aio channel (create it on the event loop that uses it) whose calls carry
        the token."""
        interceptors = ([cls(self.token) for cls in _AIO_INTERCEPTORS] if self.token
                        else None)
        if self.tls:
            return grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(self.root_ca),
                                           options=list(options), interceptors=interceptors)
        return grpc.aio.insecure_channel(address, options=list(options),
                                         interceptors=interceptors)


INSECURE = GrpcSecurity()


class TokenCheck(grpc.ServerInterceptor):
    """Server side: a call whose metadata lacks the token is answered UNAUTHENTICATED by
    a handler of the method's own shape, before the servicer runs."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, details):
        given = dict(details.invocation_metadata or ()).get(METADATA_KEY, "")
        handler = continuation(details)
        if handler is None or hmac.compare_digest(given.encode(), self._expected):
            return handler
        return _refusing(handler)


def _refuse(request, context):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    make = {(False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}[
        (handler.request_streaming, handler.response_streaming)]
    return make(_refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class _CallDetails(collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                         "compression")), grpc.ClientCallDetails):
    pass


class TokenMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                    grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Client side (blocking API): the token joins every call's metadata."""

    def __init__(self, token: str):
        self._entry = (METADATA_KEY, f"Bearer {token}")

    def _details(self, d) -> _CallDetails:
        return _CallDetails(d.method, d.timeout, [*(d.metadata or ()), self._entry],
                            d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


class _AioToken:
    def __init__(self, token: str):
        self._entry = (METADATA_KEY, f"Bearer {token}")

    def _details(self, d) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(d.metadata or ()), self._entry)
        return grpc.aio.ClientCallDetails(d.method, d.timeout, metadata, d.credentials,
                                          d.wait_for_ready)


class _AioUnaryUnary(_AioToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _AioUnaryStream(_AioToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _AioStreamUnary(_AioToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _AioStreamStream(_AioToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


# grpc.aio dispatches on the interceptor's class, so each call shape gets its own
_AIO_INTERCEPTORS = (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)
