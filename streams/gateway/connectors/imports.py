"""``POST /v1/imports``: platform history (exports read by ``memstream ingest``) into memory through the same
version book as the live connectors, so a message imported and received live is memorized once, and an export
that holds the edited text of a message memorized live replaces it as a live edit would."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from schemas.events import Forget
from services.ingest.platforms import PlatformPost
from streams.gateway import inputs
from streams.gateway.auth import Writer
from streams.gateway.connectors.base import (
    CONNECTOR_OPERATIONS,
    Mapped,
    Post,
    Produce,
    VersionBook,
    operations,
    publish,
)


class ImportedPost(BaseModel):
    key: str = Field(min_length=1, max_length=180)
    conversation_id: str = Field(min_length=1, max_length=200)
    speaker: str
    text: str
    time: datetime
    version: str = Field(default="", max_length=40)


class ImportBody(BaseModel):
    platform: Literal["slack", "telegram", "webhook"]
    user_id: str
    posts: list[ImportedPost] = Field(min_length=1, max_length=inputs.MAX_BATCH)


class Imported(BaseModel):
    messages: int
    forgotten: int
    already: int = Field(description="posts whose version memory holds already (imported before, or live)")


def import_router(
    produce: Produce, chat_topic: str, versions: VersionBook, sent: Callable[[Forget], object]
) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/imports", response_model=Imported)
    async def post_import(request: Request, principal: Writer) -> Any:
        """A batch of one platform's exported messages for one user (``write`` scope for that user)."""
        try:
            body = inputs.validate(ImportBody, await inputs.json_body(request), "import")
            inputs.check_user_id(body.user_id)
        except inputs.InvalidInput as exc:
            return inputs.invalid_response("imports", exc)
        principal.check_user(body.user_id)
        posts = [
            Post.of(PlatformPost(p.key, p.conversation_id, p.speaker, p.text, p.time, p.version), body.user_id)
            for p in body.posts
        ]
        try:
            ops = await operations(body.platform, Mapped(posts=posts), versions)
        except inputs.InvalidInput as exc:
            return inputs.invalid_response("imports", exc)
        await publish(ops, produce, chat_topic, versions, sent)
        messages = len(ops.events) - len(ops.forgets)
        CONNECTOR_OPERATIONS.labels(body.platform, "imported").inc(messages)
        return Imported(messages=messages, forgotten=len(ops.forgets), already=len(posts) - messages)

    return router
