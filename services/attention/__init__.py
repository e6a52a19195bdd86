"""Cache side of Q-First decode: KV shards and the Q-First runner under the engine."""
