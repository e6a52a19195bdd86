"""Q-First wiring: decode latency with the MLP pool in another process, and the pool transports."""
