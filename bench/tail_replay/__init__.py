"""Tail-Replay: a prefix-cache hit against a full prefill."""
