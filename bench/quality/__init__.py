"""What a model gets wrong on the quality harness's retrieval items."""
