"""Native CPU products (int8)."""
