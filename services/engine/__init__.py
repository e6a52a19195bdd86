"""The exact single-process engine (reference for every distributed path)."""
from services.engine.engine import EngineConfig, LLMEngine, PromptExport, StepOutput
from services.engine.sequence import GenerationParams, RequestError, Sequence

__all__ = ["LLMEngine", "EngineConfig", "PromptExport", "StepOutput", "GenerationParams",
           "RequestError", "Sequence"]
