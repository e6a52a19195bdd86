"""The prefix cache's settings (the store's and each tier's)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixCacheConfig:
    namespace: str                       # model fingerprint; seeds the chained hash
    block_size: int = 16
    capacity_bytes: int = 1 << 30        # payload bytes of the memory tier
    reuse_filled: bool = False           # when False a hit ends at its first filled row
    redis_url: str | None = None         # e.g. redis://127.0.0.1:6379/0; None: memory only
    redis_prefix: str = "splitstack:prefix_cache"
    redis_timeout_s: float = 0.25        # socket connect and read timeouts
    redis_ttl_s: int | None = None
    redis_backoff_s: float = 1.0         # no Redis call for this long after a failure
    device_capacity_bytes: int = 0       # device tier (FA KV on the GPU); 0: none

    def __post_init__(self):
        if not self.namespace:
            raise ValueError("namespace must be non-empty")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {self.capacity_bytes}")
        if self.device_capacity_bytes < 0:
            raise ValueError(f"device_capacity_bytes must be >= 0, got "
                             f"{self.device_capacity_bytes}")
        if self.redis_timeout_s <= 0 or self.redis_backoff_s < 0:
            raise ValueError(f"bad redis timeout/backoff {self.redis_timeout_s}, "
                             f"{self.redis_backoff_s}")
        if self.redis_ttl_s is not None and self.redis_ttl_s < 1:
            raise ValueError(f"redis_ttl_s must be >= 1 or None, got {self.redis_ttl_s}")
