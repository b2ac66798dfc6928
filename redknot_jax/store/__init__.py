"""Artifact store (DESIGN §3, §5, §7; docs/store.md): immutable, generation-atomic,
certified artifacts on disk, tiered in host and device memory, prefetched by layer group.

* `store`   - `ArtifactStore`: content-addressed document ids, layout by document x
              generation x TP slice x layer group, atomic publication, verified reads, pins, gc;
              `lookup_for_request` for the runtime; `split_tp` rank slices.
* `codecs`  - how a layer group is laid out in files (raw tiles, or one Orbax item), checksums.
* `tiers`   - `TieredCache`: device / host LRU tiers by bytes, hit/miss counters, prefetch.

The store knows artifacts, not the runtime (a request's documents from the store:
`redknot_jax.reuse.from_store`). Importing this package does not import jax (builders and
fault-test subprocesses stay light); `tiers` and artifact assembly import it when used.
"""

from redknot_jax.store.store import (DEFAULT_TP, ArtifactStore, GCReport, InvalidDocumentId, LookupResult,
                                     PublishError, Published, SliceMeta, StoreError, StoreFullError,
                                     StoreIntegrityError, StoreMissError, certificate_document_id,
                                     check_document_id, document_id, flatten_layers, layer_groups, slice_name,
                                     split_tp)
from redknot_jax.store.tiers import LRUTier, TieredCache

__all__ = ["DEFAULT_TP", "ArtifactStore", "GCReport", "InvalidDocumentId", "LookupResult", "PublishError",
           "Published", "SliceMeta", "StoreError", "StoreFullError", "StoreIntegrityError", "StoreMissError",
           "certificate_document_id", "check_document_id", "document_id", "flatten_layers", "layer_groups",
           "slice_name", "split_tp", "LRUTier", "TieredCache"]
