"""``DgraphGraphStore``: the GraphStore port, the applied-event log and the LLM cache on a Dgraph cluster (pydgraph).

Reads are read-only transactions (nothing to commit; they see every committed write). Writes are upsert blocks
committed at once; a transaction that loses a conflict (another writer created the same id first) is retried
whole, and then finds the other writer's node. Every query is built by ``queries``/``write`` from constants and
DQL variables only.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any, Self

import grpc
import pydgraph
from prometheus_client import Histogram
from pydantic import SecretStr
from pydgraph import AsyncDgraphClient, AsyncDgraphClientStub

from services.backends import RetryPolicy
from services.domain import Announcement, ApplyResult, ChangeSet, EdgeKind, Erasure, Stats, Triplet, Vertex, VertexKind
from services.logging import get_logger
from services.ports import AnnouncementLog, CacheScope, GraphStore, KeyValueCache

from . import forget, queries, upgrade
from .codec import is_vertex, parse_dt, read_edge, read_vertex
from .write import (
    Ended,
    Mutation,
    Upsert,
    announced_upsert,
    change_set_result,
    change_set_upsert,
    delete_user_upsert,
    events_upsert,
    kv_put_upsert,
    nquads,
)

log = get_logger(__name__)

DGRAPH_LATENCY = Histogram(
    "memstream_dgraph_request_seconds",
    "Dgraph request latency (one round trip)",
    ["op"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
_UNREACHABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


#: gRPC backs off up to 120 s between reconnects by default: after an outage, calls would wait for it long after
#: alpha is back. Capped at the retry policy's own ceiling.
RECONNECT = (("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 5000))


def unreachable(error: BaseException) -> bool:
    """Alpha could not be reached, or did not answer within the call's deadline (every call is idempotent)."""
    if isinstance(error, pydgraph.ConnectionError | ConnectionError | TimeoutError):
        return True
    return isinstance(error, grpc.RpcError) and getattr(error, "code", lambda: None)() in _UNREACHABLE_CODES


def login_expired(error: BaseException) -> bool:
    """Alpha refused the ACL login: the access JWT, and the refresh JWT that pydgraph renews it with, expired."""
    text = str(error)
    return "Token is expired" in text or "refresh jwt should not be empty" in text or "unauthenticated" in text.lower()


def _secret(value: SecretStr | str | None) -> SecretStr | None:
    return SecretStr(value) if isinstance(value, str) else value


def transient(error: BaseException) -> bool:
    """Reachable, and worth another attempt: a lost write conflict, or the cluster not ready yet."""
    return isinstance(error, pydgraph.AbortedError | pydgraph.RetriableError)


def schema_text() -> str:
    """The DQL schema shipped in ``schemas/dgraph.dql``."""
    return resources.files("schemas").joinpath("dgraph.dql").read_text(encoding="utf-8")


class DgraphGraphStore(GraphStore, AnnouncementLog, KeyValueCache):
    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 30.0,
        attempts: int = 5,
        outage_s: float = 600.0,
        user: str | None = None,
        password: SecretStr | str | None = None,
        namespace: int = 0,
        token: SecretStr | str | None = None,
    ) -> None:
        """``address``: alpha's gRPC ``host:port``; ``outage_s``: how long a call waits for an unreachable alpha.
        ``user``/``password``: log in (alpha's ACL) to ``namespace``, and again whenever the login expired;
        ``token``: alpha's ``--security token=``, sent with schema changes. Call ``open`` (or ``connect``) first."""
        if (user is None) != (password is None):
            raise ValueError("a Dgraph ACL login needs both a user and a password")
        self.address = address
        self.user, self.namespace = user, namespace
        self._password, self._token = _secret(password), _secret(token)
        self.timeout_s = timeout_s
        self.policy = RetryPolicy("dgraph", unreachable, transient, attempts=attempts, outage_s=outage_s, first_s=0.05)
        self._stub: AsyncDgraphClientStub | None = None
        self._client: AsyncDgraphClient | None = None

    @classmethod
    async def open(cls, address: str, *, apply_schema: bool = True, **options: Any) -> Self:
        """A connected store; ``options`` are the constructor's."""
        store = cls(address, **options)
        await store.connect(apply_schema=apply_schema)
        return store

    async def connect(self, apply_schema: bool = True) -> None:
        # the gRPC channel belongs to the running event loop, so it is made here and not in __init__
        self._stub = AsyncDgraphClientStub(self.address, options=list(RECONNECT))
        self._client = AsyncDgraphClient(self._stub)
        try:
            if self.user is not None:
                await self._retrying("login", self._login)
            version = await self._retrying("version", lambda: self.client.check_version(timeout=self.timeout_s))
            if apply_schema:
                # altering to the same schema is a no-op; new predicates and indexes are added in place
                operation = pydgraph.Operation(schema=schema_text())
                metadata = self._admin_metadata()
                await self._retrying(
                    "alter", lambda: self.client.alter(operation, timeout=self.timeout_s, metadata=metadata)
                )
                # data written by older code brought up to date, once (recorded in the graph)
                await upgrade.derive_edge_validity(self._query, self._request)
        except BaseException:
            await self.close()
            raise
        log.info("dgraph_store_opened", address=self.address, version=version, user=self.user)

    async def _login(self) -> None:
        """An ACL login with the password (and the admin token, which alpha wants with a login too, when set);
        pydgraph then renews the access JWT with the refresh JWT by itself."""
        assert self.user is not None and self._password is not None
        password, metadata = self._password.get_secret_value(), self._admin_metadata()
        if self.namespace:
            await self.client.login_into_namespace(
                self.user, password, self.namespace, timeout=self.timeout_s, metadata=metadata
            )
        else:
            await self.client.login(self.user, password, timeout=self.timeout_s, metadata=metadata)

    def _admin_metadata(self) -> list[tuple[str, str]] | None:
        """alpha's ``--security token=`` as gRPC metadata, for admin operations (login, schema changes)."""
        return [("auth-token", self._token.get_secret_value())] if self._token else None

    @property
    def client(self) -> AsyncDgraphClient:
        if self._client is None:
            raise RuntimeError("DgraphGraphStore is not connected (use DgraphGraphStore.open)")
        return self._client

    async def close(self) -> None:
        stub, self._stub, self._client = self._stub, None, None
        if stub is not None:
            await stub.close()

    # -- round trips ---------------------------------------------------------------------------------------------

    async def _retrying(self, op: str, call: Any) -> Any:
        started = time.perf_counter()

        async def logged_in() -> Any:
            try:
                return await call()
            except Exception as error:
                # pydgraph renews an expired access JWT itself; past the refresh JWT's life, log in anew, once
                if self.user is None or op == "login" or not login_expired(error):
                    raise
                log.info("dgraph_login_renewed", address=self.address, user=self.user)
                await self._login()
                return await call()

        try:
            return await self.policy.run(op, logged_in)
        finally:
            DGRAPH_LATENCY.labels(op=op).observe(time.perf_counter() - started)

    async def _query(self, op: str, query: str, variables: Mapping[str, str]) -> dict[str, Any]:
        async def call() -> dict[str, Any]:
            txn = self.client.txn(read_only=True)
            response = await txn.query(query, variables=dict(variables), timeout=self.timeout_s)
            result: dict[str, Any] = json.loads(response.json)
            return result

        result: dict[str, Any] = await self._retrying(op, call)
        return result

    async def _upsert(self, op: str, up: Upsert) -> dict[str, Any]:
        return await self._request(op, up.query, up.params.values, up.mutations)

    async def _request(
        self, op: str, query: str, variables: Mapping[str, str], mutations: Sequence[Mutation]
    ) -> dict[str, Any]:
        """One upsert request: the query, then the mutations whose conditions hold, committed at once."""

        async def call() -> dict[str, Any]:
            txn = self.client.txn()
            built = [m.proto() for m in mutations]
            request = txn.create_request(query=query, variables=dict(variables), mutations=built, commit_now=True)
            response = await txn.do_request(request, timeout=self.timeout_s)
            result: dict[str, Any] = json.loads(response.json) if response.json else {}
            return result

        result: dict[str, Any] = await self._retrying(op, call)
        return result

    # -- writes ----------------------------------------------------------------------------------------------------

    async def apply_graph(self, change_set: ChangeSet) -> ApplyResult:
        """Vertices, edges and invalidations of a change set, in one transaction; events are not marked yet."""
        up = change_set_upsert(change_set, await self._ended(change_set))
        return change_set_result(up, await self._upsert("apply", up))

    async def _ended(self, change_set: ChangeSet) -> dict[str, Ended]:
        """The change set's restated theses and relation edges that the store has ended: it reopens them. Read
        before the upsert, which reopens each only if it is still ended as read (a concurrent write wins)."""
        theses = [v.id for v in change_set.restated_theses()]
        edges = [e.id for e in change_set.edges if e.kind is EdgeKind.RELATION and e.t_invalid is None]
        if not theses and not edges:
            return {}
        params, query = queries.ended(change_set.user_id, dict.fromkeys(theses), dict.fromkeys(edges))
        result = await self._query("ended", query, params.values)
        found: dict[str, Ended] = {}
        for block, prefix in (("v", "vertex"), ("e", "edge")):
            for node in result.get(block, []):
                t_invalid = parse_dt(node.get(f"{prefix}.t_invalid"))
                if t_invalid is not None:
                    props = json.loads(node.get(f"{prefix}.props", "{}"))
                    found[node[f"{prefix}.id"]] = Ended(t_invalid, props, node.get(f"{prefix}.invalidated_by"))
        return found

    async def mark_applied(self, change_set: ChangeSet, announcement: Announcement | None = None) -> None:
        """The change set's events as applied and, in the same transaction, its announcement as pending."""
        if change_set.event_ids or announcement is not None:
            up = events_upsert(change_set.user_id, change_set.event_ids, change_set.id, announcement)
            await self._upsert("mark_applied", up)

    async def pending_announcements(self, user_id: str, event_ids: Sequence[str]) -> list[Announcement]:
        if not event_ids:
            return []
        params, query = queries.change_sets_of(user_id, dict.fromkeys(event_ids))
        applied_by = (await self._query("change_sets_of", query, params.values)).get("q", [])
        change_sets = dict.fromkeys(str(node["event.change_set"]) for node in applied_by if "event.change_set" in node)
        if not change_sets:
            return []
        params, query = queries.pending_announcements(user_id, change_sets)
        nodes = (await self._query("pending_announcements", query, params.values)).get("q", [])
        found = [Announcement.model_validate_json(node["announce.body"]) for node in nodes]
        return sorted(found, key=lambda a: (a.committed_at, a.change_set_id))

    async def mark_announced(self, user_id: str, change_set_ids: Sequence[str]) -> None:
        if change_set_ids:
            await self._upsert("mark_announced", announced_upsert(user_id, list(dict.fromkeys(change_set_ids))))

    async def delete_user(self, user_id: str) -> None:
        """Forget one user: every vertex, edge and applied event (the LLM cache is not per user)."""
        await self._upsert("delete_user", delete_user_upsert(user_id))

    # -- GraphStore ----------------------------------------------------------------------------------------------

    async def get_vertices(self, user_id: str, ids: Sequence[str]) -> dict[str, Vertex]:
        if not ids:
            return {}
        params, query = queries.get_vertices(user_id, dict.fromkeys(ids))
        result = await self._query("get_vertices", query, params.values)
        return {node["vertex.id"]: read_vertex(node) for node in result.get("q", [])}

    async def find_objects(self, user_id: str, normalized_names: Sequence[str]) -> dict[str, Vertex]:
        if not normalized_names:
            return {}
        params, query = queries.find_objects(user_id, dict.fromkeys(normalized_names))
        result = await self._query("find_objects", query, params.values)
        found: dict[str, Vertex] = {}
        for node in result.get("q", []):  # ordered by id: the smallest id wins a (theoretical) name clash
            found.setdefault(node["vertex.norm_name"], read_vertex(node))
        return found

    async def neighbors(
        self,
        user_id: str,
        vertex_ids: Sequence[str],
        edge_kinds: Sequence[EdgeKind] | None = None,
        limit_per_vertex: int | None = None,
        far_kinds: Sequence[VertexKind] | None = None,
    ) -> list[Triplet]:
        frontier = list(dict.fromkeys(vertex_ids))
        empty = (edge_kinds is not None and not edge_kinds) or (far_kinds is not None and not far_kinds)
        if not frontier or empty or limit_per_vertex == 0:
            return []
        wanted = None if far_kinds is None else {VertexKind(kind) for kind in far_kinds}
        kinds = None if edge_kinds is None else [EdgeKind(kind).value for kind in edge_kinds]
        # the far end's kind is checked here, so the server cuts to the limit only when no kind is asked
        params, query = queries.neighbors(user_id, frontier, kinds, limit_per_vertex if wanted is None else None)
        result = await self._query("neighbors", query, params.values)
        by_id = {node["vertex.id"]: node for node in result.get("q", [])}
        triplets: dict[str, Triplet] = {}
        for vid in frontier:  # frontier order, then newest edge first, as the embedded store returns them
            node = by_id.get(vid)
            if node is None:
                continue
            here = read_vertex(node)
            found: list[tuple[dict[str, Any], Triplet]] = []
            for edge in node.get("out", []):
                far = edge.get("edge.target")
                if is_vertex(far):
                    end = read_vertex(far)
                    if wanted is None or end.kind in wanted:
                        found.append((edge, Triplet(start=here, edge=read_edge(edge, here.id, end.id), end=end)))
            for edge in node.get("in", []):
                far = edge.get("edge.source")
                if is_vertex(far) and far["vertex.id"] != here.id:  # a self-loop comes back once, as outgoing
                    start = read_vertex(far)
                    if wanted is None or start.kind in wanted:
                        found.append((edge, Triplet(start=start, edge=read_edge(edge, start.id, here.id), end=here)))
            found.sort(key=lambda item: str(item[0]["edge.id"]))
            found.sort(key=lambda item: str(item[0].get("edge.rank", "0")), reverse=True)  # stable: id breaks ties
            for _, triplet in found[:limit_per_vertex]:
                triplets.setdefault(triplet.edge.id, triplet)  # an edge between two frontier vertices: once
        return list(triplets.values())

    async def get_triplets(self, user_id: str, edge_ids: Sequence[str]) -> dict[str, Triplet]:
        if not edge_ids:
            return {}
        params, query = queries.get_triplets(user_id, dict.fromkeys(edge_ids))
        result = await self._query("get_triplets", query, params.values)
        out: dict[str, Triplet] = {}
        for node in result.get("q", []):
            source, target = node.get("edge.source"), node.get("edge.target")
            if is_vertex(source) and is_vertex(target):
                start, end = read_vertex(source), read_vertex(target)
                out[node["edge.id"]] = Triplet(start=start, edge=read_edge(node, start.id, end.id), end=end)
        return out

    async def valid_theses(self, user_id: str, about: Sequence[str] | None = None, limit: int = 50) -> list[Vertex]:
        if limit <= 0 or (about is not None and not about):
            return []
        objects = None if about is None else list(dict.fromkeys(about))
        params, query = queries.valid_theses(user_id, objects, limit)
        result = await self._query("valid_theses", query, params.values)
        return [read_vertex(node) for node in result.get("q", [])]

    async def seen_events(self, user_id: str, event_ids: Sequence[str]) -> set[str]:
        if not event_ids:
            return set()
        params, query = queries.seen_events(user_id, dict.fromkeys(event_ids))
        result = await self._query("seen_events", query, params.values)
        return {node["event.id"] for node in result.get("q", [])}

    async def stats(self, user_id: str) -> Stats:
        params, query = queries.stats(user_id)
        result = await self._query("stats", query, params.values)
        vertices = dict.fromkeys((k.value for k in VertexKind), 0)
        vertices.update(_grouped(result, "vertices", "vertex.kind"))
        edges = dict.fromkeys((k.value for k in EdgeKind), 0)
        edges.update(_grouped(result, "edges", "edge.kind"))
        return Stats(
            user_id=user_id,
            vertices=vertices,
            edges=edges,
            theses_valid=_count(result, "valid"),
            theses_invalidated=_count(result, "invalid"),
            events=_count(result, "events"),
        )

    # -- KeyValueCache -------------------------------------------------------------------------------------------

    async def get(self, key: str) -> str | None:
        variables, query = queries.kv_get(key)
        nodes = (await self._query("kv_get", query, variables)).get("q", [])
        return str(nodes[0]["kv.value"]) if nodes else None

    async def put(self, key: str, value: str, scope: CacheScope | None = None) -> None:
        query, variables, mutation = kv_put_upsert(key, value)
        mutation.nquads += nquads("uid(entry)", forget.kv_sources(scope))
        await self._request("kv_put", query, variables, [mutation])

    async def forget(self, user_id: str, event_ids: Sequence[str] | None) -> int:
        up = forget.kv_forget_upsert(user_id, None if event_ids is None else list(dict.fromkeys(event_ids)))
        return _count(await self._upsert("kv_forget", up), "removed")

    # -- the graph's part of forgetting (``RemoteMemoryStore`` is the ForgetStore) -----------------------------

    async def episodes(self, user_id: str, match: Mapping[str, str] | None) -> list[Vertex]:
        params, query = forget.episodes_query(user_id)
        nodes = (await self._query("episodes", query, params.values)).get("q", [])
        found = [read_vertex(node) for node in nodes]
        return [v for v in found if all(v.props.get(k) == value for k, value in (match or {}).items())]

    async def invalidated_by(self, user_id: str, thesis_ids: Sequence[str]) -> list[Vertex]:
        if not thesis_ids:
            return []
        params, query = forget.invalidated_by_query(user_id, list(dict.fromkeys(thesis_ids)))
        return [read_vertex(node) for node in (await self._query("invalidated_by", query, params.values)).get("q", [])]

    async def forget_outcome(self, user_id: str, forget_id: str) -> str | None:
        params, query = forget.outcome_query(user_id, forget_id)
        nodes = (await self._query("forget_outcome", query, params.values)).get("q", [])
        return str(nodes[0]["forget.outcome"]) if nodes else None

    async def erase(self, erasure: Erasure) -> None:
        """The graph part of a forget, in one transaction (the vector store's part comes first)."""
        await self._upsert("erase", forget.erase_upsert(erasure))


def _grouped(result: Mapping[str, Any], block: str, predicate: str) -> dict[str, int]:
    groups = result.get(block) or [{}]
    return {row[predicate]: int(row["count"]) for row in groups[0].get("@groupby", [])}


def _count(result: Mapping[str, Any], block: str) -> int:
    rows = result.get(block) or [{}]
    return int(rows[0].get("count", 0))
