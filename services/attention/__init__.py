"""Cache side of Q-First decode: KV shards and the request-owning attention service."""
