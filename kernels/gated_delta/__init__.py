"""Gated delta rule (Gated DeltaNet core): recurrent reference and chunked form."""
from kernels.gated_delta.chunked import chunk_gated_delta_rule
from kernels.gated_delta.naive import l2norm, recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "recurrent_gated_delta_rule", "l2norm"]
