"""Tail-Replay prefix cache: FA KV, FA output hiddens and provenance per cached token."""
from services.prefix_cache.block import EXACT, FILLED, PrefixCacheError
from services.prefix_cache.metrics import PrefixCacheMetrics
from services.prefix_cache.config import PrefixCacheConfig
from services.prefix_cache.store import CacheStats, Hit, Inserted, PrefixCache

__all__ = ["EXACT", "FILLED", "CacheStats", "Hit", "Inserted", "PrefixCache",
           "PrefixCacheConfig", "PrefixCacheError", "PrefixCacheMetrics"]
