"""``WeaviateVectorStore``: the VectorStore port on Weaviate (weaviate-client v4, async, gRPC).

One collection per kind (objects, theses, episodes, triplets), one tenant per user in each, created by the first
write. A search over several kinds asks each collection concurrently and merges the hits by score. Hybrid search
runs the dense and the BM25 ranking and fuses them by reciprocal rank (k=60, rank from 1), as the port defines it
for every store: Weaviate's own fusion ranks from 0 and weights by alpha, which would give other scores.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Self, TypeVar

import httpx
import weaviate
from prometheus_client import Histogram
from pydantic import SecretStr
from weaviate.classes.data import DataObject
from weaviate.classes.init import Auth
from weaviate.classes.query import Filter, MetadataQuery
from weaviate.client import WeaviateAsyncClient
from weaviate.collections import CollectionAsync
from weaviate.config import AdditionalConfig, Timeout
from weaviate.exceptions import (
    UnexpectedStatusCodeError,
    WeaviateConnectionError,
    WeaviateGRPCUnavailableError,
    WeaviateInsertManyAllFailedError,
    WeaviateQueryError,
    WeaviateTimeoutError,
)

from services.adapters.sqlite.search import HYBRID_DEPTH, fuse
from services.backends import RetryPolicy
from services.logging import get_logger
from services.ports import Vector, VectorHit, VectorItem, VectorStore

from .collections import (
    KIND_OF_PREFIX,
    KIND_SUFFIX,
    PROPERTIES,
    check_prefix,
    collection_name,
    described_dim,
    description,
    item_uuid,
    multi_tenancy,
    tenant_name,
    vector_config,
)

T = TypeVar("T")
log = get_logger(__name__)

WEAVIATE_LATENCY = Histogram(
    "memstream_weaviate_request_seconds",
    "Weaviate request latency (one call, all collections it touches)",
    ["op"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
_UNREACHABLE = (
    WeaviateConnectionError,
    WeaviateGRPCUnavailableError,
    WeaviateTimeoutError,
    ConnectionError,
    TimeoutError,
)
#: how the client words a query or batch that failed because the server was unreachable (it wraps the gRPC error)
_UNREACHABLE_WORDS = (
    "StatusCode.UNAVAILABLE",
    "StatusCode.DEADLINE_EXCEEDED",
    "failed to connect",
    "Connection refused",
)


def unreachable(error: BaseException) -> bool:
    """Weaviate could not be reached or did not answer in time (every call made through the policy is idempotent)."""
    if isinstance(error, (*_UNREACHABLE, httpx.TransportError)):
        return True
    if isinstance(error, (WeaviateQueryError, WeaviateInsertManyAllFailedError, UnexpectedStatusCodeError)):
        return any(word in str(error) for word in _UNREACHABLE_WORDS)
    return False


#: The client retries a gRPC call that finds the server unreachable by itself, 6 times over 63 s (1 + 2 + ... + 32
#: s; not configurable in weaviate-client 4). A query attempt ends after this long, so that an outage is seen,
#: counted and waited out by the one policy (``services.backends``), and a gateway read answers 503 in seconds.
#: Writes keep the whole ``timeout_s``: a large batch under load may take that long without anything being wrong.
QUERY_ATTEMPT_S = 10.0
BATCH_SIZE = 500
MAX_QUERY_TOKENS = 64
_WORD = re.compile(r"\w+", re.UNICODE)


def _flat(vector: Sequence[float] | Sequence[Sequence[float]]) -> list[float]:
    """An object's single vector (the client types it as possibly a multi-vector, which these collections lack)."""
    return [float(x) for x in vector]  # type: ignore[arg-type]


class VectorWriteError(RuntimeError):
    """Weaviate refused some objects of a batch import."""


def bm25_text(text: str) -> str | None:
    """Distinct word tokens of ``text`` (at most 64), or None when it has none: what BM25 can match anyway."""
    tokens = dict.fromkeys(token.casefold() for token in _WORD.findall(text))
    return " ".join(list(tokens)[:MAX_QUERY_TOKENS]) or None


def _endpoint(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"Weaviate address {address!r} is not host:port")
    return host, int(port)


class WeaviateVectorStore(VectorStore):
    def __init__(
        self,
        http: str,
        grpc: str,
        dim: int,
        *,
        prefix: str = "Memstream",
        timeout_s: float = 30.0,
        attempts: int = 3,
        outage_s: float = 600.0,
        api_key: SecretStr | str | None = None,
    ) -> None:
        """``http``/``grpc``: ``host:port`` of Weaviate's REST and gRPC ports; ``api_key``: sent with every request
        (REST and gRPC) when Weaviate requires one. Call ``open`` before use."""
        if dim <= 0:
            raise ValueError("dim must be positive")
        self.http, self.grpc = http, grpc
        self.dim = dim
        self.prefix = check_prefix(prefix)
        self._api_key = SecretStr(api_key) if isinstance(api_key, str) else api_key
        self.timeout_s = timeout_s
        self.policy = RetryPolicy("weaviate", unreachable, attempts=attempts, outage_s=outage_s, first_s=0.1)
        self._client: WeaviateAsyncClient | None = None

    @classmethod
    async def open(cls, http: str, grpc: str, dim: int, **options: Any) -> Self:
        """A connected store; ``options`` are the constructor's."""
        store = cls(http, grpc, dim, **options)
        await store.connect()
        return store

    async def connect(self) -> None:
        (http_host, http_port), (grpc_host, grpc_port) = _endpoint(self.http), _endpoint(self.grpc)
        timeout = Timeout(query=self.timeout_s, insert=self.timeout_s, init=min(self.timeout_s, 10))

        async def attempt() -> None:
            client = weaviate.use_async_with_custom(
                http_host,
                http_port,
                False,
                grpc_host,
                grpc_port,
                False,
                additional_config=AdditionalConfig(timeout=timeout),
                auth_credentials=Auth.api_key(self._api_key.get_secret_value()) if self._api_key else None,
            )
            try:
                await client.connect()
            except BaseException:
                await client.close()
                raise
            self._client = client

        try:
            await self._retrying("connect", attempt, attempt_s=self.timeout_s)
            await self._retrying("ensure_collections", self.ensure_collections, attempt_s=self.timeout_s)
        except BaseException:
            await self.close()
            raise
        log.info(
            "weaviate_store_opened",
            http=self.http,
            grpc=self.grpc,
            prefix=self.prefix,
            dim=self.dim,
            api_key=self._api_key is not None,  # whether one is sent, never the key
        )

    @property
    def client(self) -> WeaviateAsyncClient:
        if self._client is None:
            raise RuntimeError("WeaviateVectorStore is not connected (use WeaviateVectorStore.open)")
        return self._client

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    async def ensure_collections(self) -> None:
        """Create the missing collections; refuse existing ones made for another vector size."""
        await asyncio.gather(*(self._ensure_collection(kind) for kind in KIND_SUFFIX))

    async def _ensure_collection(self, kind: str) -> None:
        name = collection_name(self.prefix, kind)
        if not await self.client.collections.exists(name):
            try:
                await self.client.collections.create(
                    name,
                    description=description(kind, self.dim),
                    properties=PROPERTIES,
                    vector_config=vector_config(),
                    multi_tenancy_config=multi_tenancy(),
                )
                log.info("weaviate_collection_created", name=name, dim=self.dim)
                return
            except UnexpectedStatusCodeError:
                if not await self.client.collections.exists(name):
                    raise  # not a creation race with another process: a real failure
        config = await self.client.collections.get(name).config.get(simple=True)
        stored = described_dim(config.description)
        if stored != self.dim:
            raise ValueError(f"Weaviate collection {name} holds dim={stored} vectors, the store has dim={self.dim}")

    # -- helpers ----------------------------------------------------------------------------------------------------

    def _tenant(self, kind: str, user_id: str) -> CollectionAsync[Any, Any]:
        return self.client.collections.get(collection_name(self.prefix, kind)).with_tenant(tenant_name(user_id))

    async def _retrying(self, op: str, call: Callable[[], Awaitable[T]], attempt_s: float = QUERY_ATTEMPT_S) -> T:
        async def attempt() -> T:
            async with asyncio.timeout(min(attempt_s, self.timeout_s)):
                return await call()

        started = time.perf_counter()
        try:
            return await self.policy.run(op, attempt)
        finally:
            WEAVIATE_LATENCY.labels(op=op).observe(time.perf_counter() - started)

    async def _writing(self, op: str, call: Callable[[], Awaitable[T]]) -> T:
        """A write's attempt keeps the whole ``timeout_s``: a write given up on keeps running in Weaviate while its
        retry does it again (a tenant dropped twice at once left its buckets registered in 1.35)."""
        return await self._retrying(op, call, attempt_s=self.timeout_s)

    async def _per_kind(
        self, user_id: str, kinds: Sequence[str], call: Callable[[CollectionAsync[Any, Any]], Awaitable[list[T]]]
    ) -> list[T]:
        """``call`` on this user's tenant of each kind's collection, concurrently; no tenant yet: nothing."""

        async def one(kind: str) -> list[T]:
            tenant = self._tenant(kind, user_id)
            try:
                return await call(tenant)
            except WeaviateQueryError:
                # the user never wrote this kind (the tenant appears with the first write): an empty result
                collection = self.client.collections.get(collection_name(self.prefix, kind))
                if not await collection.tenants.exists(tenant_name(user_id)):
                    return []
                raise

        results = await asyncio.gather(*(one(kind) for kind in dict.fromkeys(kinds or KIND_SUFFIX)))
        return [hit for result in results for hit in result]

    @staticmethod
    def _id_filter(restrict_to: Sequence[str] | None) -> Any:
        return None if restrict_to is None else Filter.by_id().contains_any([item_uuid(i) for i in restrict_to])

    # -- writes ----------------------------------------------------------------------------------------------------

    async def upsert(self, user_id: str, items: Sequence[VectorItem]) -> None:
        """Write (or overwrite: UUIDs come from our ids) ``items`` into this user's tenants. Raises on any error."""
        by_kind: dict[str, dict[str, VectorItem]] = {}
        for item in items:
            if len(item.vector) != self.dim:
                raise ValueError(f"vector {item.id} has {len(item.vector)} dimensions, the store has {self.dim}")
            by_kind.setdefault(item.kind, {}).setdefault(item.id, item)  # first per id wins, as in one batch
        for kind in by_kind:
            collection_name(self.prefix, kind)  # unknown kinds fail before anything is written

        async def write(kind: str, batch: list[VectorItem]) -> None:
            objects = [
                DataObject(properties={"item_id": i.id, "text": i.text}, uuid=item_uuid(i.id), vector=list(i.vector))
                for i in batch
            ]
            try:
                result = await self._tenant(kind, user_id).data.insert_many(objects)
            except WeaviateInsertManyAllFailedError as exc:
                raise VectorWriteError(f"{kind}: every object of the batch failed: {exc}") from exc
            if result.has_errors:
                first = next(iter(result.errors.values()))
                raise VectorWriteError(
                    f"{kind}: {len(result.errors)} of {len(objects)} objects failed, e.g. {first.message}"
                )

        batches = [
            (kind, list(kind_items.values())[start : start + BATCH_SIZE])
            for kind, kind_items in by_kind.items()
            for start in range(0, len(kind_items), BATCH_SIZE)
        ]
        if batches:
            await self._writing("upsert", lambda: asyncio.gather(*(write(k, b) for k, b in batches)))

    async def delete(self, user_id: str, ids: Sequence[str]) -> None:
        """Remove these items from this user's tenants (each from the collection its id's prefix names; ids of
        another shape from every one). Items already gone are no error: a replayed forget deletes again."""
        routed: dict[str, list[str]] = {}
        for item_id in dict.fromkeys(ids):
            kind = KIND_OF_PREFIX.get(item_id[:2])
            for one in [kind] if kind else list(KIND_SUFFIX):
                routed.setdefault(one, []).append(item_id)

        async def drop(kind: str, kind_ids: list[str]) -> None:
            for start in range(0, len(kind_ids), BATCH_SIZE):
                part = kind_ids[start : start + BATCH_SIZE]

                async def one(tenant: CollectionAsync[Any, Any], part: list[str] = part) -> list[None]:
                    await tenant.data.delete_many(where=self._id_filter(part))
                    return []

                await self._per_kind(user_id, [kind], one)

        if routed:
            await self._writing("delete", lambda: asyncio.gather(*(drop(k, i) for k, i in routed.items())))

    async def delete_user(self, user_id: str) -> None:
        """Drop this user's tenant from every collection."""
        tenant = tenant_name(user_id)

        async def drop(kind: str) -> None:
            await self.client.collections.get(collection_name(self.prefix, kind)).tenants.remove([tenant])

        await self._writing("delete_user", lambda: asyncio.gather(*(drop(kind) for kind in KIND_SUFFIX)))

    # -- VectorStore ------------------------------------------------------------------------------------------------

    async def search(
        self,
        user_id: str,
        kinds: Sequence[str],
        query_vector: Vector | None,
        query_text: str | None = None,
        k: int = 10,
        restrict_to: Sequence[str] | None = None,
    ) -> list[VectorHit]:
        """``kinds`` empty: every kind. Dense if only a vector, BM25 if only text, RRF (k=60) if both."""
        if kinds:
            # a kind no collection holds has no items, as an unknown kind matches no row in the embedded store
            kinds = [kind for kind in kinds if kind in KIND_SUFFIX]
            if not kinds:
                return []
        if k <= 0 or (restrict_to is not None and not restrict_to):
            return []
        if query_vector is not None and query_text:
            depth = max(HYBRID_DEPTH * k, 30)
            dense, lexical = await asyncio.gather(
                self._dense(user_id, kinds, query_vector, depth, restrict_to),
                self._lexical(user_id, kinds, query_text, depth, restrict_to),
            )
            return fuse([dense, lexical], k)
        if query_vector is not None:
            return await self._dense(user_id, kinds, query_vector, k, restrict_to)
        if query_text:
            return await self._lexical(user_id, kinds, query_text, k, restrict_to)
        return []

    async def _dense(
        self, user_id: str, kinds: Sequence[str], vector: Vector, k: int, restrict_to: Sequence[str] | None
    ) -> list[VectorHit]:
        if len(vector) != self.dim:
            raise ValueError(f"query vector has {len(vector)} dimensions, the store has {self.dim}")

        async def near(tenant: CollectionAsync[Any, Any]) -> list[VectorHit]:
            response = await tenant.query.near_vector(
                list(vector),
                limit=k,
                filters=self._id_filter(restrict_to),
                return_properties=["item_id"],
                return_metadata=MetadataQuery(distance=True),
            )
            # cosine distance is 1 - cos; the port wants the similarity
            return [
                VectorHit(id=o.properties["item_id"], score=1.0 - (o.metadata.distance or 0.0))
                for o in response.objects
            ]

        hits = await self._retrying("search_dense", lambda: self._per_kind(user_id, kinds, near))
        return sorted(hits, key=lambda h: (-h.score, h.id))[:k]

    async def _lexical(
        self, user_id: str, kinds: Sequence[str], text: str, k: int, restrict_to: Sequence[str] | None
    ) -> list[VectorHit]:
        query = bm25_text(text)
        if query is None:
            return []

        async def bm25(tenant: CollectionAsync[Any, Any]) -> list[VectorHit]:
            response = await tenant.query.bm25(
                query,
                query_properties=["text"],
                limit=k,
                filters=self._id_filter(restrict_to),
                return_properties=["item_id"],
                return_metadata=MetadataQuery(score=True),
            )
            return [VectorHit(id=o.properties["item_id"], score=o.metadata.score or 0.0) for o in response.objects]

        # BM25 scores come from each collection's own statistics; across kinds they are merged as they are
        hits = await self._retrying("search_lexical", lambda: self._per_kind(user_id, kinds, bm25))
        return sorted(hits, key=lambda h: (-h.score, h.id))[:k]

    async def get_vectors(self, user_id: str, ids: Sequence[str]) -> dict[str, list[float]]:
        """First from the collection each id's prefix points at (services.ids), then the rest from all others."""
        wanted = list(dict.fromkeys(ids))
        found: dict[str, list[float]] = {}
        routed: dict[str, list[str]] = {}
        for item_id in wanted:
            routed.setdefault(KIND_OF_PREFIX.get(item_id[:2], ""), []).append(item_id)
        unrouted = routed.pop("", [])
        if routed:
            found.update(await self._fetch_vectors(user_id, routed))
        missing = unrouted + [i for kind_ids in routed.values() for i in kind_ids if i not in found]
        if missing:  # ids of another shape, or indexed under another kind
            others = {kind: missing for kind in KIND_SUFFIX if not set(routed.get(kind, [])) >= set(missing)}
            found.update(await self._fetch_vectors(user_id, others))
        return found

    async def _fetch_vectors(self, user_id: str, ids_by_kind: dict[str, list[str]]) -> dict[str, list[float]]:
        async def fetch(kind: str, kind_ids: list[str]) -> list[tuple[str, list[float]]]:
            async def one(tenant: CollectionAsync[Any, Any]) -> list[tuple[str, list[float]]]:
                response = await tenant.query.fetch_objects(
                    filters=self._id_filter(kind_ids),
                    limit=len(kind_ids),
                    include_vector=True,
                    return_properties=["item_id"],
                )
                # one unnamed vector per object ("default"), a flat list of floats
                return [(o.properties["item_id"], _flat(o.vector["default"])) for o in response.objects]

            return await self._per_kind(user_id, [kind], one)

        async def all_kinds() -> list[list[tuple[str, list[float]]]]:
            return await asyncio.gather(*(fetch(kind, kind_ids) for kind, kind_ids in ids_by_kind.items()))

        results = await self._retrying("get_vectors", all_kinds)
        return {item_id: vector for result in results for item_id, vector in result}
