"""Restore a converted checkpoint (checkpoints_convert.convert's layout) into a `Model`,
every parameter straight into its target sharding.

Each Orbax item is restored against a tree of `jax.ShapeDtypeStruct`s that carry the target
`NamedSharding`, so each device reads only its own slice from disk; no full copy of a split
parameter is built on one device (replicated parameters are, by definition, whole on every
device). The mesh may differ from whatever wrote the checkpoint.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

import jax

from checkpoints_convert.convert import (COMPLETE_FILE, FORMAT, FORMAT_VERSION, METADATA_FILE, PARAMS_DIR,
                                         flatten, item_of, nest, parse_spec, path_of)
from redknot_jax.config import ConfigError, ModelConfig


class RestoreError(ValueError):
    """A converted checkpoint that is incomplete, corrupt, or does not fit the model."""


def read_metadata(out_dir) -> dict:
    """metadata.json of a complete conversion; RestoreError if COMPLETE or metadata.json is
    missing, they disagree, or the format is not this converter's."""
    d = Path(out_dir)
    complete, meta_path = d / COMPLETE_FILE, d / METADATA_FILE
    if not d.is_dir():
        raise RestoreError(f"{d}: not a directory")
    if not complete.is_file():
        raise RestoreError(f"{d}: no {COMPLETE_FILE} marker: not a complete conversion (interrupted or still "
                           f"being written?)")
    if not meta_path.is_file():
        raise RestoreError(f"{meta_path}: missing (the conversion is incomplete)")
    data = meta_path.read_bytes()
    if complete.read_text().strip() != hashlib.sha256(data).hexdigest():
        raise RestoreError(f"{meta_path}: does not match the SHA-256 in {complete} (edited or partly written)")
    try:
        meta = json.loads(data)
    except json.JSONDecodeError as e:
        raise RestoreError(f"{meta_path}: invalid JSON ({e})") from None
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise RestoreError(f"{meta_path}: format {meta.get('format')!r} v{meta.get('format_version')!r}, expected "
                           f"{FORMAT!r} v{FORMAT_VERSION}")
    return meta


def restore(out_dir, model_or_abstract=None, mesh: jax.sharding.Mesh | None = None,
            shardings_fn: Callable[[str, tuple, object], jax.sharding.Sharding] | None = None):
    """Restore the parameters in `out_dir` into a model and return it.

    model_or_abstract: a `Model` (concrete, or abstract from `nnx.eval_shape`) whose
    parameters are replaced; a `ModelConfig`; or None to use out_dir/config.json. For the
    last two an abstract model is built in the dtype the checkpoint was converted to.
    A model in another dtype than the checkpoint is filled by casting on read.
    Shardings: `shardings_fn(path, shape, dtype)` if given, else the `redknot_jax.sharding`
    table on `mesh`, else the default device.
    """
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from flax import nnx

    from redknot_jax.model import Model
    from redknot_jax.sharding import param_sharding
    from redknot_jax.weights import param_leaves

    d = Path(out_dir)
    meta = read_metadata(d)
    model = model_or_abstract
    if model is None or isinstance(model, ModelConfig):
        if model is None:
            try:
                model = ModelConfig.from_json(d / "config.json")
            except (ConfigError, OSError) as e:
                raise RestoreError(f"{d / 'config.json'}: {e}") from None
        cfg = model
        model = nnx.eval_shape(lambda: Model(cfg, jnp.dtype(meta["dtype"])))
    cfg = model.cfg
    if cfg.fingerprint() != meta["config_fingerprint"]:
        raise RestoreError(f"{d}: converted for another config (fingerprint {meta['config_fingerprint'][:12]}…, "
                           f"model's {cfg.fingerprint()[:12]}…); compare {d / 'config.json'} with the model's config")

    leaves = param_leaves(model)
    stored = {path_of(item, sub): parse_spec(spec)
              for item, m in meta["items"].items() for sub, spec in m["params"].items()}
    missing, extra = sorted(set(leaves) - set(stored)), sorted(set(stored) - set(leaves))
    if missing or extra:
        raise RestoreError(f"{d}: parameters do not match the model: missing {missing[:5]}, unexpected {extra[:5]}")
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def sharding(path, shape, dtype):
        if shardings_fn is not None:
            return shardings_fn(path, shape, dtype)
        return param_sharding(mesh, path, shape) if mesh is not None else default

    targets: dict[str, dict] = {}
    for path, var in leaves.items():
        item, sub = item_of(path)
        shape, dtype = tuple(var.shape), var.get_value().dtype
        if shape != stored[path][0]:
            raise RestoreError(f"{d / PARAMS_DIR / item}: {sub}: stored shape {stored[path][0]}, "
                               f"model expects {shape}")
        targets.setdefault(item, {})[sub] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding(path, shape, dtype))

    ckptr = ocp.StandardCheckpointer()
    try:
        for item, flat in sorted(targets.items()):
            where = d / PARAMS_DIR / item
            if not where.is_dir():
                raise RestoreError(f"{where}: missing item directory")
            try:
                restored = flatten(ckptr.restore(where, nest(flat)))
            except Exception as e:  # Orbax / TensorStore errors: name the item
                raise RestoreError(f"{where}: {type(e).__name__}: {e}") from e
            for sub, arr in restored.items():
                leaves[path_of(item, sub)].set_value(arr)
    finally:
        ckptr.close()
    return model
