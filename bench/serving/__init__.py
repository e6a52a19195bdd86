"""The serving path: engine and gateway speed, decode modes, soak and elastic pools."""
