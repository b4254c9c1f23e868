"""The Weaviate collections: one per kind of indexed text, multi-tenant with one tenant per user, own vectors.

Collections are created on first use, with the vector size in their description so that a store opened with
another size fails at once (as the embedded store does) instead of at the first insert.
"""

from __future__ import annotations

import re
import uuid

from weaviate.classes.config import Configure, DataType, Property, Tokenization, VectorDistances
from weaviate.collections.classes.config import MultiTenancyConfigCreate, VectorConfigCreate

from services.ids import digest

#: kind of a VectorItem -> collection name suffix (collections are ``<prefix><suffix>``)
KIND_SUFFIX = {"object": "Object", "thesis": "Thesis", "episodic": "Episode", "triplet": "Triplet"}
#: the kind services.ids gives each id prefix: where get_vectors looks first
KIND_OF_PREFIX = {"o_": "object", "t_": "thesis", "e_": "episodic", "r_": "triplet"}
#: namespace of the object UUIDs: uuid5(ITEM_NAMESPACE, item id), so a replay overwrites the same object
ITEM_NAMESPACE = uuid.UUID("6f1d3c1e-6d2b-5a55-9a0e-6d656d737472")
_DIM = re.compile(r"\bdim=(\d+)\b")
_PREFIX = re.compile(r"^[A-Z][A-Za-z0-9_]*$")


def check_prefix(prefix: str) -> str:
    if not _PREFIX.match(prefix):
        raise ValueError(f"collection prefix {prefix!r} must start with a capital letter, then letters/digits/_")
    return prefix


def collection_name(prefix: str, kind: str) -> str:
    try:
        return prefix + KIND_SUFFIX[kind]
    except KeyError:
        raise ValueError(f"unknown vector item kind {kind!r}; known: {sorted(KIND_SUFFIX)}") from None


def tenant_name(user_id: str) -> str:
    """Weaviate tenant names allow [A-Za-z0-9_-] up to 64 characters; a user id may hold anything."""
    return "u" + digest(user_id)


def item_uuid(item_id: str) -> uuid.UUID:
    return uuid.uuid5(ITEM_NAMESPACE, item_id)


def description(kind: str, dim: int) -> str:
    return f"memstream {kind} texts with their vectors, dim={dim}"


def described_dim(text: str | None) -> int | None:
    match = _DIM.search(text or "")
    return int(match.group(1)) if match else None


PROPERTIES = [
    # our id (vertex or edge id): returned with every hit; the object's UUID is derived from it
    Property(name="item_id", data_type=DataType.TEXT, tokenization=Tokenization.FIELD, index_searchable=False),
    # BM25 over the text; word tokenization lower-cases and splits on anything not a letter or digit
    Property(name="text", data_type=DataType.TEXT, tokenization=Tokenization.WORD),
]


def vector_config() -> VectorConfigCreate:
    # no vectorizer: vectors come from memstream's embedder; cosine, as the embedded store
    return Configure.Vectors.self_provided(
        vector_index_config=Configure.VectorIndex.hnsw(distance_metric=VectorDistances.COSINE)
    )


def multi_tenancy() -> MultiTenancyConfigCreate:
    # a user's tenant appears with the first write and wakes up by itself if it was offloaded
    return Configure.multi_tenancy(enabled=True, auto_tenant_creation=True, auto_tenant_activation=True)
