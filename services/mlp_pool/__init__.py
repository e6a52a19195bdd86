"""Stateless MLP pool: embeddings, feed-forwards, K/V (and GDN input) projections, LM head."""
from services.common.messages import StageOutput
from services.mlp_pool.pool import MLPPool

__all__ = ["MLPPool", "StageOutput"]
