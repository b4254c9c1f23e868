"""Turn request bodies into validated events: the gateway is where events enter, so it validates them.

The server fills what a client may leave out: ``event_id`` (a hash of the content, so a retried POST is the same
event), ``event_time`` (now, when absent) and always ``ingest_time``; ``document_id`` defaults to the event id.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from prometheus_client import Counter
from pydantic import BaseModel, TypeAdapter, ValidationError

from schemas.events import ChatMessage, Document, Forget, Query, UserId
from schemas.validation import MalformedJSON, parse_json
from services.ids import digest

E = TypeVar("E", bound=BaseModel)

MAX_BATCH = 1000
_USER_ID: TypeAdapter[str] = TypeAdapter(UserId)


class InvalidInput(ValueError):
    """A request body that does not describe valid events; ``errors`` is JSON-ready, ``status`` the 4xx to answer."""

    def __init__(self, message: str, errors: list[dict[str, Any]] | None = None, status: int = 422) -> None:
        super().__init__(message)
        self.errors = errors or []
        self.status = status


GATEWAY_REJECTED = Counter("memstream_gateway_rejected_total", "Requests rejected as invalid", ["route"])


def invalid_response(route: str, exc: InvalidInput) -> JSONResponse:
    """The 4xx of a rejected request, counted by route."""
    GATEWAY_REJECTED.labels(route=route).inc()
    return JSONResponse(status_code=exc.status, content={"detail": str(exc), "errors": exc.errors})


def _items(body: Any, what: str) -> list[dict[str, Any]]:
    items = body if isinstance(body, list) else [body]
    if not items:
        raise InvalidInput(f"expected one {what} object or a non-empty list of them")
    if len(items) > MAX_BATCH:
        raise InvalidInput(f"at most {MAX_BATCH} {what}s per request, got {len(items)}")
    for n, item in enumerate(items):
        if not isinstance(item, dict):
            raise InvalidInput(f"{what} #{n} is not a JSON object")
    return items


def _raw_time(item: dict[str, Any]) -> str:
    value = item.get("event_time")
    return "" if value is None else str(value)


def invalid_input(exc: ValidationError, label: str) -> InvalidInput:
    """``exc`` as an ``InvalidInput`` naming ``label`` and the first failing field."""
    errors = [
        {"loc": [label, *[str(p) for p in e["loc"]]], "msg": e["msg"], "type": e["type"]}
        for e in exc.errors(include_url=False, include_context=False)
    ]
    first = errors[0]
    return InvalidInput(f"invalid {label}: {'.'.join(first['loc'][1:]) or '<root>'}: {first['msg']}", errors)


def validate(model: type[E], item: dict[str, Any], label: str) -> E:
    try:
        return model.model_validate(item)
    except ValidationError as exc:
        raise invalid_input(exc, label) from exc


async def json_body(request: Request) -> Any:
    """The body as JSON within ``schemas.validation``'s limits (the same the workers apply to records)."""
    check_content_type(request.headers.get("content-type"))
    try:
        return parse_json(await request.body(), request.app.state.max_body_bytes, "request body")
    except MalformedJSON as exc:
        raise InvalidInput(str(exc), status=exc.status) from exc


def check_content_type(value: str | None) -> None:
    """JSON in UTF-8 (RFC 8259); a request without a content type is taken as JSON; anything else is a 415."""
    if value is None:
        return
    media, _, params = value.partition(";")
    media = media.strip().lower()
    if media not in ("application/json", "text/json") and not re.fullmatch(r"application/[\w.+-]+\+json", media):
        raise InvalidInput(f"send the body as JSON (content-type: application/json), not {value[:100]!r}", status=415)
    for param in params.split(";"):
        name, _, charset = param.partition("=")
        if name.strip().lower() == "charset" and charset.strip().strip('"').lower() not in ("utf-8", "utf8"):
            raise InvalidInput(f"the body must be UTF-8 JSON, not charset {charset.strip()[:40]!r}", status=415)


def _events(
    body: Any, model: type[E], what: str, fill: Callable[[dict[str, Any]], None], now: datetime | None
) -> list[E]:
    now = now or datetime.now(UTC)
    events = []
    for n, raw in enumerate(_items(body, what)):
        item = dict(raw)
        fill(item)
        item.setdefault("event_time", now)
        if item.get("event_time") is None:
            item["event_time"] = now
        item["ingest_time"] = now  # the server's clock, whatever the client sent
        events.append(validate(model, item, f"{what} #{n}"))
    return events


def chat_messages(body: Any, now: datetime | None = None) -> list[ChatMessage]:
    def fill(item: dict[str, Any]) -> None:
        if not item.get("event_id"):
            item["event_id"] = "m_" + digest(
                str(item.get("user_id", "")),
                str(item.get("conversation_id", "default")),
                str(item.get("speaker", "")),
                str(item.get("text", "")),
                _raw_time(item),
            )

    return _events(body, ChatMessage, "message", fill, now)


def documents(body: Any, now: datetime | None = None) -> list[Document]:
    def fill(item: dict[str, Any]) -> None:
        if not item.get("event_id"):
            item["event_id"] = "d_" + digest(
                str(item.get("user_id", "")),
                str(item.get("document_id", "")),
                str(item.get("title", "")),
                str(item.get("text", "")),
                _raw_time(item),
            )
        if not item.get("document_id"):
            item["document_id"] = item["event_id"]

    return _events(body, Document, "document", fill, now)


def query(body: Any, now: datetime | None = None) -> Query:
    if not isinstance(body, dict):
        raise InvalidInput("expected a JSON object with user_id and question")

    if "event_id" in body:
        # a query id chosen by a client could be another's: their answer and trace would be overwritten or shown
        raise InvalidInput("query ids are made by the server: leave out event_id")

    def fill(item: dict[str, Any]) -> None:
        # every question is a new query with an unguessable id: asking twice gets two answers
        item["event_id"] = "q_" + uuid.uuid4().hex

    return _events(body, Query, "question", fill, now)[0]


def forget(body: Any, now: datetime | None = None) -> Forget:
    """A tombstone from ``{"user_id", "scope", "target"}``; its id (the forget id) is made here, unguessable."""
    if not isinstance(body, dict):
        raise InvalidInput("expected a JSON object with user_id, scope and (but for scope user) target")
    unknown = sorted(set(body) - {"user_id", "scope", "target", "event_time"})
    if unknown:
        # a forget id chosen by a client could be another's: its status would be shown, its id replayed
        raise InvalidInput(f"a forget takes user_id, scope, target (and event_time), not {', '.join(unknown)}")

    def fill(item: dict[str, Any]) -> None:
        item["event_id"] = "f_" + uuid.uuid4().hex

    return _events(body, Forget, "forget", fill, now)[0]


def check_user_id(user_id: str) -> str:
    try:
        return _USER_ID.validate_python(user_id)
    except ValidationError as exc:
        raise InvalidInput(f"invalid user_id {user_id!r}: {exc.errors()[0]['msg']}") from exc
