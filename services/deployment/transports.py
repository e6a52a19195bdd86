"""The data-plane transport a deployment's attention services reach their pool through,
chosen by name (`--transport`). Each is imported only when chosen, so the gRPC stubs and
cupy load only where they are used. `nccl` links are made by the Ray deployment itself
(`NcclTransport.connect`), since they need the pool actors' handles."""
from __future__ import annotations

import importlib

from services.common.grpc_security import INSECURE, GrpcSecurity
from services.common.transport import Transport

TRANSPORTS = {"local": ("services.common.transport", "LocalTransport"),
              "grpc": ("services.common.grpc_transport", "GrpcTransport")}


def make_transport(name: str, replicas: list, security: GrpcSecurity | None = None) -> Transport:
    """`replicas`: pool objects (`local`) or `host:port` addresses (`grpc`); `security`:
    the gRPC channels' token and TLS (None: none)."""
    if name not in TRANSPORTS:
        raise ValueError(f"unknown transport {name!r}; available: {sorted(TRANSPORTS)}")
    module, cls = TRANSPORTS[name]
    transport = getattr(importlib.import_module(module), cls)
    if name == "local":
        return transport(replicas)
    return transport(replicas, security or INSECURE)
