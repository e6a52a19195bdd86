"""The exact single-process engine (reference for every distributed path)."""
from services.engine.engine import EngineConfig, LLMEngine, StepOutput
from services.engine.sequence import GenerationParams, RequestError, Sequence

__all__ = ["LLMEngine", "EngineConfig", "StepOutput", "GenerationParams", "RequestError",
           "Sequence"]
