"""The arms by name: importing this module registers the built-in arms (exact, the RidgeFill
family, Tail-Replay), and `make_arm` builds one, `ARM@DTYPE` running a fill arm's filled rows
in DTYPE."""
from __future__ import annotations

import evals.ridgefill_arms  # noqa: F401  (the built-in arms register on import)
import evals.tailreplay_arms  # noqa: F401
from evals.arms import ARMS, Arm
from models.model import CausalLM
from services.prefill.fill_layers import FILL_DTYPES

# `ARM@DTYPE` runs a fill arm's filled rows (map, norm, projections) in DTYPE
# (services/prefill/fill_layers.py); it is paired with ARM itself when both run
FILL_DTYPE_SUFFIXES = tuple(name for name in FILL_DTYPES if name != "model")


def make_arm(name: str, model: CausalLM, **options) -> Arm:
    base, _, fill_dtype = name.partition("@")
    if base not in ARMS:
        raise ValueError(f"unknown arm {base!r}; registered: {sorted(ARMS)}")
    if fill_dtype:
        cls = ARMS[base]
        if fill_dtype not in FILL_DTYPE_SUFFIXES or not getattr(cls, "takes_fill_dtype", False):
            raise ValueError(f"arm {name!r}: only RidgeFill-family arms take a fill dtype, "
                             f"one of {FILL_DTYPE_SUFFIXES}")
        arm = cls(model, fill_dtype=fill_dtype, **options)
        arm.name = name
        return arm
    return ARMS[base](model, **options)
