"""Numerical ops: each has a readable fp32 reference beside its fast path."""
