"""The exact single-process engine (reference for every distributed path)."""
from services.common.messages import PromptExport, StepOutput
from services.engine.engine import EngineConfig, LLMEngine
from services.common.messages import GenerationParams, RequestError
from services.engine.sequence import Sequence

__all__ = ["LLMEngine", "EngineConfig", "PromptExport", "StepOutput", "GenerationParams",
           "RequestError", "Sequence"]
