"""Offline checkpoints: importing the SmolLM2 GGUF and deriving other families from it."""
