"""Checkpoints derived from SmolLM2 (QK-norm, Qwen3.5 hybrid) and the q-first conversion.
The checkpoints themselves and their deltas live in `models/zoo/`."""
