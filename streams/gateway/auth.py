"""Who is calling, and for which users: authentication of every gateway request, scopes, and key management.

A credential is ``Authorization: Bearer <token>``: an API key (``msk_...``, see ``keys.py``) or, when an issuer is
configured, an OIDC/JWT access token (signature from the issuer's JWKS, issuer, audience, expiry). Either names
the users it acts for (a tenant; ``*`` for all) and its scopes: ``write`` (messages, documents), ``ask``
(questions), ``read`` (answers, traces, stats, graph, the user's dead letters), ``metrics``, ``admin`` (everything,
dead-letter replay and key management included).

``AuthMiddleware`` refuses (401) every request without a valid credential but those to ``OPEN_PATHS`` (health, the
static page, and /metrics when ``MEMSTREAM_METRICS_PUBLIC``): a route added later is closed by default. Routes then
ask for a scope with ``Depends(require(...))`` and check the users they touch with ``Principal.check_user``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

import jwt
from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import JSONResponse
from prometheus_client import Counter
from pydantic import BaseModel, Field
from starlette.types import ASGIApp, Receive, Scope, Send

from services.logging import get_logger
from services.observability.context import bind
from services.settings import Settings
from streams.gateway.keys import KeyRequestError, KeyStore
from streams.gateway.ratelimit import RateLimiter

log = get_logger(__name__)

AUTH_FAILURES = Counter("memstream_gateway_auth_failures_total", "Requests refused: no or a bad credential", ["why"])
FORBIDDEN = Counter("memstream_gateway_forbidden_total", "Requests refused: outside the credential's scope", ["why"])

ALL_USERS = "*"
OPEN_PATHS = ("/healthz", "/", "/favicon.ico")
#: connectors' requests carry their platform's signature instead of a memstream credential (checked by each)
OPEN_PREFIXES = ("/static/", "/v1/connectors/")


class Action(StrEnum):
    WRITE = "write"
    ASK = "ask"
    READ = "read"
    METRICS = "metrics"
    ADMIN = "admin"


@dataclass(frozen=True)
class Principal:
    """A verified credential: ``id`` (``key:<key id>`` or ``jwt:<issuer>#<subject>``), its users and scopes."""

    id: str
    users: frozenset[str]
    scopes: frozenset[str]

    @property
    def all_users(self) -> bool:
        return ALL_USERS in self.users

    def can(self, action: Action) -> bool:
        return action.value in self.scopes or Action.ADMIN.value in self.scopes

    def covers(self, user_id: str | None) -> bool:
        return self.all_users or (user_id is not None and user_id in self.users)

    @property
    def only_user(self) -> str | None:
        """The one user the credential acts for, if it acts for exactly one."""
        return next(iter(self.users)) if len(self.users) == 1 and not self.all_users else None

    def check_user(self, user_id: str) -> None:
        """403 unless the credential acts for ``user_id``."""
        if not self.covers(user_id):
            FORBIDDEN.labels(why="user").inc()
            raise HTTPException(status_code=403, detail=f"this credential does not act for user {user_id!r}")


class Unauthenticated(Exception):
    """No credential, or one that did not verify; ``why`` is safe to show the caller."""

    def __init__(self, why: str, reason: str) -> None:
        super().__init__(why)
        self.why = why
        self.reason = reason  # metric label


class _Jwks:
    """The issuer's signing keys: from a URL (PyJWKClient, cached) or a file (read again when it changes)."""

    def __init__(self, url: str | None, path: Path | None) -> None:
        self._client = jwt.PyJWKClient(url, cache_keys=True, lifespan=600, timeout=10) if url else None
        self._path = path
        self._file: tuple[float, jwt.PyJWKSet] | None = None

    def key_for(self, token: str) -> Any:
        if self._client is not None:
            return self._client.get_signing_key_from_jwt(token).key
        assert self._path is not None
        mtime = self._path.stat().st_mtime
        if self._file is None or self._file[0] != mtime:
            self._file = (mtime, jwt.PyJWKSet.from_dict(json.loads(self._path.read_text())))
        kid = jwt.get_unverified_header(token).get("kid")
        keys = self._file[1].keys
        found = [k for k in keys if k.key_id == kid] if kid is not None else keys[:1]
        if not found:
            raise jwt.InvalidTokenError(f"no key {kid!r} in the JWKS")
        return found[0].key


class Authenticator:
    def __init__(self, settings: Settings, keys: KeyStore | None = None) -> None:
        self.settings = settings
        self.keys = keys or KeyStore.of(settings)
        self._jwks: _Jwks | None = None
        if settings.oidc_issuer:
            if not (settings.oidc_jwks_url or settings.oidc_jwks_file) or not settings.oidc_audience:
                raise ValueError("OIDC needs MEMSTREAM_OIDC_AUDIENCE and MEMSTREAM_OIDC_JWKS_URL or _JWKS_FILE")
            self._jwks = _Jwks(settings.oidc_jwks_url, settings.oidc_jwks_file)

    async def principal(self, authorization: str | None) -> Principal:
        if not authorization:
            raise Unauthenticated("send a credential: Authorization: Bearer <API key or token>", "missing")
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("use Authorization: Bearer <API key or token>", "scheme")
        if token.startswith("msk_"):
            record = await asyncio.to_thread(self.keys.verify, token)
            if record is None:
                raise Unauthenticated("unknown, wrong or revoked API key", "api_key")
            return Principal(f"key:{record.key_id}", frozenset(record.users), frozenset(record.scopes))
        if self._jwks is None:
            raise Unauthenticated("not an API key, and no token issuer is configured", "no_issuer")
        return await asyncio.to_thread(self._verify_jwt, token)

    def _verify_jwt(self, token: str) -> Principal:
        s = self.settings
        try:
            assert self._jwks is not None
            claims = jwt.decode(
                token,
                self._jwks.key_for(token),
                algorithms=s.oidc_algorithms,
                audience=s.oidc_audience,
                issuer=s.oidc_issuer,
                leeway=s.oidc_leeway_s,
                options={"require": ["exp", "iss", "aud", "sub"]},
            )
        except (jwt.PyJWTError, OSError, ValueError) as exc:
            raise Unauthenticated(f"token refused: {exc}", "jwt") from exc
        users = _names(claims.get(s.oidc_users_claim, [claims["sub"]]))
        scopes = _names(claims.get(s.oidc_scopes_claim, []))
        return Principal(f"jwt:{claims['iss']}#{claims['sub']}", frozenset(users), frozenset(scopes))


def _names(value: Any) -> list[str]:
    """A claim as a list of names: a list, or a space-separated string (OAuth's ``scope``)."""
    items = value.split() if isinstance(value, str) else value if isinstance(value, list) else []
    return [str(i) for i in items if isinstance(i, str | int)]


def is_open(path: str, settings: Settings) -> bool:
    if path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
        return True
    return path == "/metrics" and settings.metrics_public


class AuthMiddleware:
    """401 (with ``WWW-Authenticate``) for a request without a valid credential, before its body is read; the
    verified ``Principal`` goes to ``request.state.principal``."""

    def __init__(self, app: ASGIApp, authenticator: Authenticator) -> None:
        self.app = app
        self.authenticator = authenticator

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or is_open(scope["path"], self.authenticator.settings):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        header = headers.get(b"authorization")
        if header is None and kind == "websocket":
            header = _subprotocol_bearer(headers.get(b"sec-websocket-protocol", b""))
        try:
            principal = await self.authenticator.principal(header.decode("latin-1") if header else None)
        except Unauthenticated as exc:
            AUTH_FAILURES.labels(why=exc.reason).inc()
            log.info("auth_refused", why=exc.reason, path=scope["path"])
            if kind == "websocket":  # closed before the handshake completes: the client sees an HTTP 403
                await send({"type": "websocket.close", "code": 1008, "reason": exc.why[:120]})
                return
            challenge = 'Bearer realm="memstream"' + ("" if exc.reason == "missing" else ', error="invalid_token"')
            response = JSONResponse(
                status_code=401, content={"detail": exc.why}, headers={"WWW-Authenticate": challenge}
            )
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})["principal"] = principal
        bind(credential=principal.id)
        await self.app(scope, receive, send)


def _subprotocol_bearer(offered: bytes) -> bytes | None:
    """A browser's WebSocket cannot send headers: it offers the subprotocols ``memstream, bearer.<token>`` instead
    (the token never lands in a URL, so not in logs or history)."""
    for item in offered.split(b","):
        item = item.strip()
        if item.startswith(b"bearer."):
            return b"Bearer " + item[len(b"bearer.") :]
    return None


def require(action: Action) -> Callable[[Request], Principal]:
    """A dependency: the caller's ``Principal``, 403 unless it holds ``action`` (admin holds all)."""

    def dependency(request: Request) -> Principal:
        principal: Principal | None = getattr(request.state, "principal", None)
        if principal is None:  # the middleware is not installed: refuse rather than serve
            raise HTTPException(status_code=401, detail="not authenticated")
        if not principal.can(action):
            FORBIDDEN.labels(why="scope").inc()
            raise HTTPException(status_code=403, detail=f"this credential lacks the {action.value!r} scope")
        return principal

    dependency.__name__ = f"require_{action.value}"
    return dependency


def metrics_access(settings: Settings) -> Callable[[Request], Principal | None]:
    """/metrics: open when ``MEMSTREAM_METRICS_PUBLIC``, else the ``metrics`` scope (or admin)."""
    needed = require(Action.METRICS)

    def dependency(request: Request) -> Principal | None:
        return None if settings.metrics_public else needed(request)

    return dependency


Writer = Annotated[Principal, Depends(require(Action.WRITE))]
Asker = Annotated[Principal, Depends(require(Action.ASK))]
Reader = Annotated[Principal, Depends(require(Action.READ))]
Admin = Annotated[Principal, Depends(require(Action.ADMIN))]


def own_user(principal: Principal, user_id: str | None) -> str | None:
    """The user a request acts for: the one given (403 outside the scope), or the credential's only user."""
    if user_id is None:
        return principal.only_user
    principal.check_user(user_id)
    return user_id


def scoped_body(body: Any, principal: Principal) -> Any:
    """A body of one event or a list of them with ``user_id`` filled in where it is missing and the credential
    acts for exactly one user (the parser then names what is still missing)."""
    user = principal.only_user
    if user is None:
        return body
    items = body if isinstance(body, list) else [body]
    filled = [{**i, "user_id": user} if isinstance(i, dict) and "user_id" not in i else i for i in items]
    return filled if isinstance(body, list) else filled[0]


def scoped_parse(
    parse: Callable[[Any], Sequence[Any]], principal: Principal, limiter: RateLimiter, kind: str
) -> Callable[[Any], Sequence[Any]]:
    """``parse`` for one credential: missing user ids filled in, every event's user checked (403), then the
    events counted against the credential's ``kind`` rate limit (429)."""

    def parse_scoped(body: Any) -> Sequence[Any]:
        events = parse(scoped_body(body, principal))
        for event in events:
            principal.check_user(event.user_id)
        limiter.take(principal.id, kind, len(events))
        return events

    return parse_scoped


def rate_limiter(settings: Settings) -> RateLimiter:
    return RateLimiter({"write": settings.rate_writes_per_min, "question": settings.rate_questions_per_min})


# -- key management (admin) -----------------------------------------------------------------------------------------


class KeyRequest(BaseModel):
    users: list[str] = Field(min_length=1, max_length=1000, description='users the key acts for; "*" for all')
    scopes: list[str] = Field(min_length=1, description="write, ask, read, metrics, admin")
    label: str = Field(default="", max_length=200)


class PlaceRequest(BaseModel):
    user_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:@-]*$")


def keys_router(store: KeyStore) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/keys", status_code=201)
    async def create_key(body: KeyRequest, principal: Admin) -> Any:
        """A new API key; the key itself is in this answer only."""
        try:
            record, key = await asyncio.to_thread(store.create, body.users, body.scopes, body.label)
        except KeyRequestError as exc:
            return JSONResponse(status_code=422, content={"detail": str(exc)})
        log.info("api_key_created", key_id=record.key_id, users=record.users, scopes=record.scopes, by=principal.id)
        return {**record.public(), "key": key}

    @router.get("/v1/keys")
    async def list_keys(_: Admin) -> Any:
        return {"keys": [k.public() for k in store.keys().values()]}

    @router.put("/v1/connector-places/{platform}/{place}")
    async def map_place(
        platform: Literal["slack", "telegram"], place: str, body: PlaceRequest, principal: Admin
    ) -> Any:
        """Messages of this Slack workspace (team id) or Telegram chat (chat id) belong to ``user_id``."""
        await asyncio.to_thread(store.map_place, platform, place, body.user_id)
        log.info("connector_place_mapped", platform=platform, place=place, user_id=body.user_id, by=principal.id)
        return {"platform": platform, "place": place, "user_id": body.user_id}

    @router.delete("/v1/connector-places/{platform}/{place}")
    async def unmap_place(platform: Literal["slack", "telegram"], place: str, principal: Admin) -> Any:
        await asyncio.to_thread(store.map_place, platform, place, None)
        log.info("connector_place_unmapped", platform=platform, place=place, by=principal.id)
        return {"platform": platform, "place": place, "user_id": None}

    @router.get("/v1/connector-places")
    async def list_places(_: Admin) -> Any:
        return {"places": store.places()}

    @router.delete("/v1/keys/{key_id}")
    async def revoke_key(key_id: str, principal: Admin) -> Any:
        try:
            record = await asyncio.to_thread(store.revoke, key_id)
        except KeyRequestError as exc:
            return JSONResponse(status_code=404, content={"detail": str(exc)})
        log.info("api_key_revoked", key_id=key_id, by=principal.id)
        return record.public()

    return router
