"""Quality harness: filled-region retrieval, key-token loss, new-token loss, agreement."""
