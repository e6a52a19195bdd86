"""Offline checkpoints: the SmolLM2 GGUF importer (`gguf_import`), the checkpoint
directories `make setup` builds here and the committed deltas (`deltas/`) the derived ones
are rebuilt from. The derivation code itself is research tooling, in `tools.zoo`."""
from pathlib import Path

ZOO_DIR = Path(__file__).parent
DELTA_DIR = ZOO_DIR / "deltas"
