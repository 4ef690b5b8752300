"""What the gateway keeps to avoid work: replayed deterministic answers and read-through database reads."""
