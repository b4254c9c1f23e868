"""A small synchronous client of the gateway, for the CLI and scripts."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Generator, Iterator, Sequence
from typing import Any

import httpx
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from schemas.events import ChatMessage, Document


class GatewayError(RuntimeError):
    """The gateway was unreachable (``status_code`` None) or answered with an error status."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


#: a 429 is waited out (its ``Retry-After``, at most this long each time) this many times before it is an error
RATE_LIMIT_WAITS = 5
MAX_RETRY_AFTER_S = 60.0


def bearer(key: str | None) -> dict[str, str]:
    """The header that sends ``key`` (an API key or a token); none without one."""
    return {"Authorization": f"Bearer {key}"} if key else {}


class GatewayClient:
    """``api_key``: an API key (``msk_...``) or a bearer token, sent with every request (default:
    ``MEMSTREAM_API_KEY``)."""

    def __init__(self, url: str, timeout_s: float = 60.0, api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        api_key = api_key if api_key is not None else os.environ.get("MEMSTREAM_API_KEY")
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, headers=bearer(api_key))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """The response; a rate-limited request (429) is sent again after the ``Retry-After`` it names."""
        for _ in range(RATE_LIMIT_WAITS):
            response = self._send(method, path, **kwargs)
            if response.status_code != 429:
                return response
            try:
                wait_s = float(response.headers.get("retry-after", "1"))
            except ValueError:
                wait_s = 1.0
            time.sleep(min(max(wait_s, 0.1), MAX_RETRY_AFTER_S))  # the server's own back-off
        return self._send(method, path, **kwargs)

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        # transient network errors are retried; an HTTP error status is an answer, not a transient failure
        try:
            for attempt in Retrying(
                stop=stop_after_attempt(4),
                wait=wait_exponential(multiplier=0.25, max=4),
                retry=retry_if_exception_type(httpx.TransportError),
                reraise=True,
            ):
                with attempt:
                    return self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise GatewayError(f"cannot reach the gateway at {self.url}: {exc}") from exc
        raise GatewayError("unreachable")  # pragma: no cover

    @staticmethod
    def _check(response: httpx.Response) -> Any:
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            raise GatewayError(
                f"{response.request.method} {response.request.url.path}: {response.status_code} {detail}",
                response.status_code,
            )
        return response.json()

    def health(self) -> dict[str, Any]:
        result: dict[str, Any] = self._check(self._request("GET", "/healthz"))
        return result

    def post_messages(self, messages: Sequence[ChatMessage]) -> dict[str, Any]:
        body = [m.model_dump(mode="json", exclude={"ingest_time"}) for m in messages]
        result: dict[str, Any] = self._check(self._request("POST", "/v1/messages", json=body))
        return result

    def post_documents(self, documents: Sequence[Document]) -> dict[str, Any]:
        body = [d.model_dump(mode="json", exclude={"ingest_time"}) for d in documents]
        result: dict[str, Any] = self._check(self._request("POST", "/v1/documents", json=body))
        return result

    def post_import(self, platform: str, user_id: str, posts: Sequence[Any]) -> dict[str, Any]:
        """A batch of exported platform messages (``services.ingest.platforms.PlatformPost``)."""
        body = {
            "platform": platform,
            "user_id": user_id,
            "posts": [
                {
                    "key": p.key,
                    "conversation_id": p.conversation_id,
                    "speaker": p.speaker,
                    "text": p.text,
                    "time": p.when.isoformat(),
                    "version": p.version,
                }
                for p in posts
            ],
        }
        result: dict[str, Any] = self._check(self._request("POST", "/v1/imports", json=body))
        return result

    def ask(self, user_id: str, question: str, **fields: Any) -> str:
        body = {"user_id": user_id, "question": question, **fields}
        return str(self._check(self._request("POST", "/v1/questions", json=body))["query_id"])

    def answer(self, query_id: str, wait_s: float = 0.0) -> dict[str, Any] | None:
        response = self._request("GET", f"/v1/answers/{query_id}", params={"wait": wait_s})
        if response.status_code == 404:
            return None
        result: dict[str, Any] = self._check(response)
        return result

    def wait_answer(self, query_id: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise GatewayError(f"no answer for query {query_id} within {timeout_s:.0f}s")
            found = self.answer(query_id, wait_s=min(10.0, max(0.1, left)))
            if found is not None:
                return found

    def stats(self, user_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._check(self._request("GET", f"/v1/stats/{user_id}"))
        return result

    def metrics_text(self) -> str:
        """The gateway's Prometheus page (the workers' metrics too, under `memstream up`)."""
        response = self._request("GET", "/metrics")
        if response.status_code != 200:
            raise GatewayError(f"/metrics answered {response.status_code}")
        return response.text

    def dead_letters(
        self,
        user_id: str | None = None,
        reason: str | None = None,
        status: str | None = None,
        limit: int = 100,
        offset: int = 0,
        include_payload: bool = False,
    ) -> dict[str, Any]:
        """One page of dead letters, newest first: ``{"total", "complete", "dead_letters": [...]}``."""
        params: dict[str, Any] = {"limit": limit, "offset": offset, "include_payload": include_payload}
        params |= {k: v for k, v in (("user_id", user_id), ("reason", reason), ("status", status)) if v is not None}
        result: dict[str, Any] = self._check(self._request("GET", "/v1/dead-letters", params=params))
        return result

    def replay_dead_letters(
        self,
        event_ids: Sequence[str] | None = None,
        *,
        replay_all: bool = False,
        user_id: str | None = None,
        reason: str | None = None,
    ) -> dict[str, Any]:
        """Replay the named dead letters, or (``replay_all``) every dead one matching the filters."""
        body: dict[str, Any] = {"event_ids": list(event_ids)} if event_ids is not None else {"all": replay_all}
        body |= {k: v for k, v in (("user_id", user_id), ("reason", reason)) if v is not None}
        result: dict[str, Any] = self._check(self._request("POST", "/v1/dead-letters/replay", json=body))
        return result

    def forget(self, user_id: str, scope: str, target: str | None = None) -> dict[str, Any]:
        """Forget a message, document, conversation (``target``: its id) or the whole user (``scope`` user):
        ``{"forget_id", "topics", ...}``; the erasure follows on the topics."""
        body = {"user_id": user_id, "scope": scope, **({"target": target} if target is not None else {})}
        result: dict[str, Any] = self._check(self._request("POST", "/v1/forget", json=body))
        return result

    def forget_status(self, forget_id: str, wait_s: float = 0.0) -> dict[str, Any]:
        """``{"status": "pending" | "done", ...what was removed}``; ``wait_s`` long-polls for done."""
        response = self._request("GET", f"/v1/forget/{forget_id}", params={"wait": wait_s})
        result: dict[str, Any] = self._check(response)
        return result

    def wait_forgotten(self, forget_id: str, timeout_s: float) -> dict[str, Any]:
        """The forget's status once done, or the last one seen (``pending``) at the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            status = self.forget_status(forget_id, wait_s=min(10.0, max(0.0, left)))
            if status["status"] == "done" or left <= 0:
                return status

    def create_key(self, users: Sequence[str], scopes: Sequence[str], label: str = "") -> dict[str, Any]:
        """A new API key (admin): its record with the key itself under ``key``, shown this once."""
        body = {"users": list(users), "scopes": list(scopes), "label": label}
        result: dict[str, Any] = self._check(self._request("POST", "/v1/keys", json=body))
        return result

    def list_keys(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._check(self._request("GET", "/v1/keys"))["keys"]
        return result

    def revoke_key(self, key_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._check(self._request("DELETE", f"/v1/keys/{key_id}"))
        return result

    def trace_events(self, query_id: str, user_id: str, timeout_s: float) -> Iterator[tuple[str, Any]]:
        """Server-sent trace events of a query as ``(event, data)``, until the stream ends (``end``)."""
        ends = ("end", "timeout", "unavailable", "forgotten")
        return self._events(f"/v1/traces/{query_id}/stream", {"user_id": user_id}, timeout_s, ends)

    def answer_events(self, query_id: str, timeout_s: float) -> Generator[tuple[str, Any], None, None]:
        """The answer as it is written: ``("text", {"delta", "text", "reset"})`` events, then ``("answer", the
        answer event)``. Leaving early (closing the iterator) cancels the question, as the gateway is told."""
        ends = ("answer", "timeout", "unavailable", "forgotten")
        return self._events(f"/v1/questions/{query_id}/stream", {}, timeout_s, ends)

    def cancel(self, query_id: str) -> dict[str, Any]:
        """Cancel a question still being answered."""
        result: dict[str, Any] = self._check(self._request("DELETE", f"/v1/questions/{query_id}"))
        return result

    def _events(
        self, path: str, params: dict[str, Any], timeout_s: float, ends: tuple[str, ...]
    ) -> Generator[tuple[str, Any], None, None]:
        event, data = "message", ""
        try:
            with self._http.stream("GET", path, params=params, timeout=timeout_s) as response:
                if response.status_code >= 400:
                    response.read()
                    self._check(response)
                for line in response.iter_lines():
                    if line.startswith("event:"):
                        event = line[6:].strip()
                    elif line.startswith("data:"):
                        data += line[5:].strip()
                    elif not line and data:
                        yield event, json.loads(data)
                        if event in ends:
                            return
                        event, data = "message", ""
        except httpx.TransportError as exc:
            raise GatewayError(f"stream {path} broke: {exc}") from exc
