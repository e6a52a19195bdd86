"""A loopback Hugging Face Hub for `hf download` (through `HF_ENDPOINT`): the files of one
directory as the model repository `repo` at commit SHA, every request recorded (method,
path, Authorization), and a 401 for a request without `token` where one is set."""
from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SHA = "0123456789abcdef0123456789abcdef01234567"


def serve(root: Path, repo: str, token: str | None = None) -> tuple[ThreadingHTTPServer, list]:
    """Start the mirror on 127.0.0.1 (a free port) in a thread; returns it and its request log."""
    files = {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _deny(self) -> bool:
            seen.append((self.command, self.path, self.headers.get("Authorization")))
            if token and self.headers.get("Authorization") != f"Bearer {token}":
                self._empty(401)
                return True
            return False

        def _file(self, body: bool):
            prefix = f"/{repo}/resolve/"
            name = self.path.split("?")[0][len(prefix):].split("/", 1)[1]
            path = files.get(name)
            if path is None:
                self._empty(404)
                return
            data = path.read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
            self.send_header("X-Repo-Commit", SHA)
            self.end_headers()
            if body:
                self.wfile.write(data)

        def do_HEAD(self):
            if not self._deny():
                self._file(body=False)

        def do_GET(self):
            if self._deny():
                return
            path = self.path.split("?")[0]
            if path.startswith(f"/api/models/{repo}"):
                info = {"id": repo, "modelId": repo, "sha": SHA, "private": False,
                        "siblings": [{"rfilename": n, "size": p.stat().st_size} for n, p in files.items()]}
                if "/tree/" in path:
                    info = [{"type": "file", "path": n, "size": p.stat().st_size, "oid": SHA}
                            for n, p in files.items()]
                data = json.dumps(info).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            elif path.startswith(f"/{repo}/resolve/"):
                self._file(body=True)
            else:
                self._empty(404)

        def _empty(self, status: int):
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen
