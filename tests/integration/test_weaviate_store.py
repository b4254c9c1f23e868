"""The Weaviate vector store on a real Weaviate: tenants per user, our own vectors, replays that overwrite, batch
errors that raise, and a store that refuses collections of another vector size."""

from __future__ import annotations

import math

import pytest

from services.adapters.remote import RemoteMemoryStore
from services.adapters.weaviate import VectorWriteError, WeaviateVectorStore
from services.adapters.weaviate.collections import collection_name, item_uuid, tenant_name
from services.ports import VectorItem

pytestmark = [pytest.mark.server]

DIM = 8  # the remote_store fixture's vector size (tests/integration/conftest.py)


def unit(axis: int) -> list[float]:
    return [1.0 if i == axis else 0.0 for i in range(DIM)]


def items(*texts: str, kind: str = "thesis") -> list[VectorItem]:
    return [VectorItem(id=f"t_{n}", kind=kind, text=text, vector=unit(n % DIM)) for n, text in enumerate(texts)]


async def count(store: WeaviateVectorStore, kind: str, user: str) -> int:
    collection = store.client.collections.get(collection_name(store.prefix, kind))
    result = await collection.with_tenant(tenant_name(user)).aggregate.over_all(total_count=True)
    return int(result.total_count or 0)


async def test_a_users_tenant_appears_with_the_first_write(remote_store: RemoteMemoryStore, user: str) -> None:
    vectors = remote_store.vectors
    theses = vectors.client.collections.get(collection_name(vectors.prefix, "thesis"))
    assert not await theses.tenants.exists(tenant_name(user))
    assert await vectors.search(user, [], unit(0), "anything", k=5) == []  # no tenant yet: nothing, no error

    await vectors.upsert(user, items("Anna lives in Oslo"))
    assert await theses.tenants.exists(tenant_name(user))
    objects = vectors.client.collections.get(collection_name(vectors.prefix, "object"))
    assert not await objects.tenants.exists(tenant_name(user))  # only the kinds written
    assert [h.id for h in await vectors.search(user, [], unit(0), k=5)] == ["t_0"]
    assert await vectors.search(user, ["object"], unit(0), k=5) == []
    assert await vectors.search(user, ["no such kind"], unit(0), k=5) == []  # as in the embedded store


async def test_replays_overwrite_instead_of_duplicating(remote_store: RemoteMemoryStore, user: str) -> None:
    vectors = remote_store.vectors
    first = items("Anna lives in Oslo", "Ben plays chess")
    await vectors.upsert(user, first)
    await vectors.upsert(user, first)
    assert await count(vectors, "thesis", user) == 2

    changed = [first[0].model_copy(update={"text": "Anna lives in Bergen", "vector": unit(3)})]
    await vectors.upsert(user, changed)
    assert await count(vectors, "thesis", user) == 2
    assert (await vectors.get_vectors(user, ["t_0"]))["t_0"] == pytest.approx(unit(3))
    assert [h.id for h in await vectors.search(user, [], None, "Bergen", k=5)] == ["t_0"]
    assert await vectors.search(user, [], None, "Oslo", k=5) == []
    # the object's UUID is derived from our id, so any client finds it without a lookup table
    theses = vectors.client.collections.get(collection_name(vectors.prefix, "thesis"))
    collection = theses.with_tenant(tenant_name(user))
    stored = await collection.query.fetch_object_by_id(item_uuid("t_0"))
    assert stored is not None and stored.properties["item_id"] == "t_0"


async def test_our_vectors_are_stored_as_given(remote_store: RemoteMemoryStore, user: str) -> None:
    vector = [math.sin(i + 1) for i in range(DIM)]  # not normalised, not from any vectoriser
    await remote_store.vectors.upsert(user, [VectorItem(id="r_1", kind="triplet", text="a b c", vector=vector)])
    assert (await remote_store.vectors.get_vectors(user, ["r_1"]))["r_1"] == pytest.approx(vector, rel=1e-6)


async def test_batch_errors_raise(remote_store: RemoteMemoryStore, user: str) -> None:
    vectors = remote_store.vectors
    await vectors.upsert(user, items("Anna lives in Oslo"))
    # a store that believes in 4 dimensions writes into this tenant's 8-dimensional index: Weaviate refuses
    vectors.dim = 4
    try:
        short = [VectorItem(id="t_9", kind="thesis", text="short", vector=[1.0, 0.0, 0.0, 0.0])]
        with pytest.raises(VectorWriteError, match="thesis"):
            await vectors.upsert(user, short)
    finally:
        vectors.dim = DIM
    with pytest.raises(ValueError, match="dimensions"):
        await vectors.upsert(user, [VectorItem(id="t_9", kind="thesis", text="x", vector=[1.0])])
    with pytest.raises(ValueError, match="unknown vector item kind"):
        await vectors.upsert(user, [VectorItem(id="t_9", kind="nonsense", text="x", vector=unit(0))])
    assert await count(vectors, "thesis", user) == 1


async def test_collections_of_another_size_are_refused(remote_store: RemoteMemoryStore) -> None:
    vectors = remote_store.vectors
    assert vectors.dim == DIM
    with pytest.raises(ValueError, match=f"dim={DIM}"):
        await WeaviateVectorStore.open(vectors.http, vectors.grpc, dim=DIM + 1, prefix=vectors.prefix)


async def test_forgetting_a_user_drops_only_their_tenants(remote_store: RemoteMemoryStore, user: str) -> None:
    other = f"{user}-other"
    for who in (user, other):
        await remote_store.vectors.upsert(who, items("Anna lives in Oslo"))
    await remote_store.delete_user(user)
    assert await remote_store.vectors.search(user, [], unit(0), k=5) == []
    assert [h.id for h in await remote_store.vectors.search(other, [], unit(0), k=5)] == ["t_0"]
    await remote_store.delete_user(other)
