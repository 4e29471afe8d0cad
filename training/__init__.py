"""Training: CLI, trainer loop, optimizer, checkpointing, data and metrics."""
