"""Checkpoint conversion: hub safetensors shards -> RedKnot-JAX parameters (numpy-only I/O layer)."""
