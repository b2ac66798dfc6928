"""Meshes, the parameter sharding table (`table`), the shard_map'd tensor-parallel forward
(`tp`) and cross-rank certificate agreement (`agree`). docs/sharding.md."""

from redknot_jax.sharding.table import batch_spec, check_tp, make_mesh, param_sharding, param_spec

__all__ = ["batch_spec", "check_tp", "make_mesh", "param_sharding", "param_spec"]
