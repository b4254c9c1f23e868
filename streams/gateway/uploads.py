"""Files uploaded as they are to ``POST /v1/documents``: their text extracted (``services.ingest.documents``) in a
worker thread, cut into overlapping parts; an unreadable file is a 422 that says why, never a 5xx."""

from __future__ import annotations

import asyncio
import hashlib
from datetime import UTC, datetime

from fastapi import Request

from schemas.events import Document
from services.ingest.documents import MEDIA_TYPES, Unreadable, Upload, document_parts, extract
from services.settings import Settings
from streams.gateway import inputs

__all__ = ["MEDIA_TYPES", "parts"]


async def parts(
    request: Request, media: str, user_id: str | None, document_id: str | None, title: str | None, settings: Settings
) -> list[Document]:
    data = await request.body()
    if not data:
        raise inputs.InvalidInput("the upload is empty")
    if user_id is None:
        raise inputs.InvalidInput("say whose document it is: ?user_id=...")
    inputs.check_user_id(user_id)
    kind = MEDIA_TYPES[media]
    try:
        text = await asyncio.to_thread(extract, data, kind)
        # the same file again is the same document (and the same parts: memorized once)
        named = document_id or f"doc_{hashlib.sha256(data).hexdigest()[:32]}"
        upload = Upload(user_id, named, title, datetime.now(UTC))
        return await asyncio.to_thread(
            document_parts, upload, text, settings.document_part_tokens, settings.document_part_overlap_tokens
        )
    except Unreadable as exc:
        raise inputs.InvalidInput(f"cannot read the {kind} file: {exc}") from exc
    except ValueError as exc:  # a document id or title the contract refuses
        raise inputs.InvalidInput(f"invalid upload: {exc}") from exc
