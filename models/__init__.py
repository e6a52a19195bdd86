"""Pure-PyTorch model families and the stage API (see models/model.py)."""
from models.config import ConfigError, ModelConfig
from models.loader import CheckpointError, load_model
from models.model import AttnInputs, CausalLM

__all__ = ["load_model", "ModelConfig", "CausalLM", "AttnInputs", "ConfigError",
           "CheckpointError"]
