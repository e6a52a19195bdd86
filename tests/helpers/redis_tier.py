"""The prefix cache's Redis tier under test: the server's address and the block size."""
from __future__ import annotations

REDIS_URL = "redis://127.0.0.1:6379/0"
BS = 16
