"""Stateless MLP pool: embeddings, feed-forwards, K/V (and GDN input) projections, LM head."""
from services.mlp_pool.pool import MLPPool, StageOutput

__all__ = ["MLPPool", "StageOutput"]
