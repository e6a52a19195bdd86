"""HTTP over plain sockets, for what clients like httpx will not send: bodies paced in
pieces, partial headers, declared lengths that never arrive.

Run as `python -m tests.helpers.raw_http PORT KEY`, it sends three 20 MB completion
bodies in 1 MiB pieces (20 ms apart) and then one of 40 MB, each on its own connection,
and prints each response's status line and body as a JSON line: a load of its own
process, so that building and sending the bodies takes nothing from the interpreter that
measures the server meanwhile."""
from __future__ import annotations

import json
import socket
import sys
import time


def read_response(s: socket.socket) -> bytes:
    """One whole response (head and Content-Length body) from `s`."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            return data
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += s.recv(4096)
    return head + b"\r\n\r\n" + body


def post(port: int, key: str, body: bytes, pace_s: float = 0.0) -> bytes:
    """POST `body` to /v1/completions in 1 MiB pieces, `pace_s` apart; the response."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json"
                  f"\r\nAuthorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n\r\n"
                  .encode())
        for start in range(0, len(body), 1 << 20):
            s.sendall(body[start:start + (1 << 20)])
            time.sleep(pace_s)
        return read_response(s)


def main(port: int, key: str) -> None:
    big = json.dumps({"model": "smollm2-135m",
                      "prompt": "hello world " * (20_000_000 // 12)}).encode()
    for body, pace in [(big, 0.02)] * 3 + [(b" " * (40 << 20), 0.0)]:
        head, _, payload = post(port, key, body, pace).partition(b"\r\n\r\n")
        print(json.dumps([head.split(b"\r\n")[0].decode(), payload.decode()]), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
