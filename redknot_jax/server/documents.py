"""Tenant-scoped document registry.

A document belongs to the tenant that registered it. Its content id is
`sha256(tenant_salt || token ids)` with `tenant_salt = HMAC-SHA256(server_secret, tenant)`, so
the same text registered by two tenants gets two unrelated ids, and an id says nothing about
the content to anyone without the secret. A tenant sees (cites, reads, lists, deletes) only its
own documents, plus documents another tenant published with `shared=true` (cite and read
only). Everything else answers exactly like an unknown id (`None` here, 404 at the HTTP layer),
so one tenant cannot probe another's ids.

With `store_dir`, each record (tokens, owner, shared flag) is written as JSON and reloaded at
start-up; the server secret is kept beside it so ids stay stable across restarts. Artifacts
are the scheduler's: held in memory, published to the tenant's `ArtifactStore` under
`store_dir/artifacts` when built, and read back (verified) after a restart.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import pathlib
import re
import secrets
import threading
import time

import numpy as np

ID_RE = re.compile(r"^[0-9a-f]{64}$")


def valid_id(doc_id: str) -> bool:
    """Exactly 64 lowercase hex characters (anything else, e.g. `../x`, is rejected early)."""
    return bool(ID_RE.match(doc_id))


@dataclasses.dataclass
class Document:
    id: str
    tenant: str
    tokens: np.ndarray
    shared: bool
    created: int
    artifact: object | None = None  # reuse.artifact.Artifact once built

    def describe(self) -> dict:
        return {"id": self.id, "object": "document", "created": self.created, "tokens": int(len(self.tokens)),
                "shared": self.shared, "artifact_ready": self.artifact is not None}


class DocumentRegistry:
    """Thread-safe map id -> Document with tenant visibility rules (see module docstring)."""

    def __init__(self, store_dir: str | None = None):
        self._lock = threading.Lock()
        self._docs: dict[str, Document] = {}
        self.store = pathlib.Path(store_dir) if store_dir else None
        if self.store is not None:
            self.store.mkdir(parents=True, exist_ok=True)
            key = self.store / "server_secret"
            if not key.exists():
                fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(secrets.token_hex(32))
            self._secret = bytes.fromhex(key.read_text().strip())
            for p in sorted(self.store.glob("*.json")):
                r = json.loads(p.read_text())
                self._docs[r["id"]] = Document(r["id"], r["tenant"], np.asarray(r["tokens"], np.int32),
                                               bool(r["shared"]), int(r["created"]))
        else:
            self._secret = secrets.token_bytes(32)

    def content_id(self, tenant: str, tokens) -> str:
        salt = hmac.new(self._secret, tenant.encode("utf-8"), hashlib.sha256).digest()
        return hashlib.sha256(salt + np.asarray(tokens, "<i4").tobytes()).hexdigest()

    def add(self, tenant: str, tokens, shared: bool) -> tuple[Document, bool]:
        """Register (idempotent per tenant and content). Returns (document, created)."""
        tokens = np.asarray(tokens, np.int32)
        did = self.content_id(tenant, tokens)
        with self._lock:
            if did in self._docs:
                doc = self._docs[did]
                if shared and not doc.shared:
                    doc.shared = True
                    self._persist(doc)
                return doc, False
            doc = Document(did, tenant, tokens, bool(shared), int(time.time()))
            self._docs[did] = doc
            self._persist(doc)
            return doc, True

    def _persist(self, doc: Document) -> None:
        if self.store is None:
            return
        tmp = self.store / f".{doc.id}.tmp"
        tmp.write_text(json.dumps({"id": doc.id, "tenant": doc.tenant, "tokens": doc.tokens.tolist(),
                                   "shared": doc.shared, "created": doc.created}))
        os.replace(tmp, self.store / f"{doc.id}.json")  # atomic: a record is whole or absent

    def get(self, tenant: str, doc_id: str) -> Document | None:
        """The document if `tenant` may read / cite it (own or shared), else None."""
        if not valid_id(doc_id):
            return None
        with self._lock:
            doc = self._docs.get(doc_id)
        if doc is None or not (doc.tenant == tenant or doc.shared):
            return None
        return doc

    def list(self, tenant: str) -> list[Document]:
        with self._lock:
            return sorted((d for d in self._docs.values() if d.tenant == tenant), key=lambda d: (d.created, d.id))

    def delete(self, tenant: str, doc_id: str) -> bool:
        """Only the owner deletes; anyone else gets False (same as unknown)."""
        if not valid_id(doc_id):
            return False
        with self._lock:
            doc = self._docs.get(doc_id)
            if doc is None or doc.tenant != tenant:
                return False
            del self._docs[doc_id]
        if self.store is not None:
            (self.store / f"{doc_id}.json").unlink(missing_ok=True)
        return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._docs)
