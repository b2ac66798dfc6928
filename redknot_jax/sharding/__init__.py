"""Meshes and the parameter sharding table (see `table`)."""

from redknot_jax.sharding.table import make_mesh, param_sharding, param_spec

__all__ = ["make_mesh", "param_sharding", "param_spec"]
