"""Prefill service: exact or RidgeFill prefill of a prompt, written into the decode side."""
from services.prefill.maps import MapsError, RidgeMaps, model_fingerprint
from services.prefill.ridgefill import PrefillResult, RidgeFill
from services.prefill.settings import FillError, FillSettings

__all__ = ["FillError", "FillSettings", "MapsError", "PrefillResult", "RidgeFill", "RidgeMaps",
           "model_fingerprint"]
