"""The same-host link to an MLP pool replica: the `grpc` transport's calls as
length-prefixed protobuf frames over a Unix socket, when the attention service and the pool
replica share a host (and a network namespace: one Kubernetes pod, or Ray actors on one
node). It skips gRPC's HTTP/2 framing and its thread hand-offs, which cost about 1 ms a
pool call on this CPU, 31 calls a token (docs/results/qfirst.md). Across hosts, and where
the link is off, calls keep the gRPC stream.

- The replica listens on `socket_name(port)` in Linux's abstract socket namespace (no file
  to clean up; it is gone with the process), beside its gRPC port.
- A client whose replica address names an IP of this host connects there, sends a hello
  (the gRPC token when one is set, and the address it dialled), and keeps the connection;
  a refused hello, or no listener, leaves it on gRPC.
- `SPLITSTACK_LOCAL_LINK=0` turns the link off on either side.
"""
from __future__ import annotations

import hmac
import json
import logging
import os
import socket
import struct
import sys
import threading
from typing import Callable, Iterator

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<I")
OK = b"ok"


def enabled() -> bool:
    return sys.platform == "linux" and os.environ.get("SPLITSTACK_LOCAL_LINK", "1") != "0"


def socket_name(port: int) -> str:
    """The abstract socket of the pool replica serving gRPC on `port` (a leading NUL)."""
    return f"\0splitstack-pool:{port}"


def is_local_ip(host: str) -> bool:
    """Whether `host` is an address of this host: one may bind to it."""
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
        return True
    except OSError:
        return False


def send_frame(sock: socket.socket, data: bytes) -> None:
    header = _HEADER.pack(len(data))
    if len(data) <= 1 << 16:
        sock.sendall(header + data)               # the usual small frame: one system call
    else:
        sock.sendall(header)
        sock.sendall(data)


def recv_frame(sock: socket.socket) -> bytearray:
    """One frame's bytes (protobuf and json parse them as they are); ConnectionError when
    the peer closed."""
    (size,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
    return _recv_exactly(sock, size)


def _recv_exactly(sock: socket.socket, size: int) -> bytearray:
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the pool replica closed the same-host link")
        got += n
    return buf


class LocalListener:
    """Accepts same-host clients of the pool replica whose gRPC server is at `address`
    (`host:port` as bound). Each connection gets a thread that passes its frames through
    `calls(frames) -> reply frames`, the servicer's generator; when that raises (the replica
    failed stop), the connection closes and the client retries elsewhere. `token`: the gRPC
    token a hello must carry (None: any)."""

    def __init__(self, address: str, calls: Callable[[Iterator[bytearray]], Iterator[bytes]],
                 token: str | None = None):
        host, port = address.rsplit(":", 1)
        self.host, self.port, self.calls, self.token = host.strip("[]"), int(port), calls, token
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(socket_name(self.port))       # OSError: taken; the caller goes without
        self.sock.listen(64)
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name=f"local-link-{port}", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name=f"local-link-{self.port}-conn").start()

    def _refusal(self, hello: bytearray) -> str | None:
        try:
            h = json.loads(hello)
            token, dialled = h.get("token"), str(h["address"])
        except (ValueError, KeyError, TypeError, AttributeError):
            return "malformed hello"
        if self.token is not None and not hmac.compare_digest(str(token or ""), self.token):
            return "bad token"
        host, _, port = dialled.rpartition(":")
        if port != str(self.port) or self.host not in ("0.0.0.0", "::", "", host.strip("[]")):
            return f"this replica serves {self.host}:{self.port}, not {dialled}"
        return None

    def _serve(self, conn: socket.socket) -> None:
        try:
            why = self._refusal(recv_frame(conn))
            send_frame(conn, OK if why is None else why.encode())
            if why is None:
                frames = _frames(conn)
                for reply in self.calls(frames):
                    send_frame(conn, reply)
        except ConnectionError:
            pass                                  # the client went away
        except Exception as exc:                  # failed stop: the client retries elsewhere
            log.warning("same-host pool link on port %d closed: %s", self.port, exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _frames(conn: socket.socket) -> Iterator[bytearray]:
    """The client's request frames until it closes."""
    while True:
        try:
            yield recv_frame(conn)
        except ConnectionError:
            return


def connect(address: str, token: str | None = None) -> socket.socket | None:
    """A connected, accepted same-host link to the pool replica at `address`, or None (the
    link is off, the replica is on another host, it does not listen, or it refused)."""
    host, _, port = address.rpartition(":")
    if not enabled() or not port.isdigit() or not is_local_ip(host):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(socket_name(int(port)))
        send_frame(sock, json.dumps({"token": token, "address": address}).encode())
        answer = recv_frame(sock)
    except OSError:
        sock.close()
        return None
    if answer != OK:
        log.info("pool replica %s refused the same-host link (%s); using gRPC", address,
                 answer.decode(errors="replace"))
        sock.close()
        return None
    return sock
