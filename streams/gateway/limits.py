"""The request body limit, enforced for every route before the app sees the body."""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyLimitMiddleware:
    """Reads at most ``max_bytes`` of a request body, then hands the app the whole body at once; a larger body
    (declared or sent) gets a 413 with a JSON message and the app is not called."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send, f"{int(declared)} bytes")
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client is gone: nobody to answer
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self._too_large(scope, receive, send, f"more than {self.max_bytes} bytes")
                return
            if not message.get("more_body", False):
                break
        read = False

        async def replay() -> Message:
            nonlocal read
            if read:
                return await receive()  # after the body: the disconnect, when it comes
            read = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send, size: str) -> None:
        detail = f"request body is {size}, over the limit of {self.max_bytes} bytes (MEMSTREAM_MAX_BODY_BYTES)"
        await JSONResponse(status_code=413, content={"detail": detail})(scope, receive, send)
