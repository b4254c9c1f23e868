"""Turn the ollama client's failures into the errors the LLM layers understand.

Transient failures (server unreachable, overloaded, a dropped or slow connection) become ``ConnectionError`` or
``TimeoutError``, which ``RetryingLLM`` retries; anything else (unknown model, bad request) stays a plain error.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from ollama import ResponseError

_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}


class OllamaError(RuntimeError):
    """The Ollama server refused the request for a reason a retry will not fix."""


class OllamaUnavailable(ConnectionError):
    """The Ollama server could not serve the request now."""


@contextmanager
def translate_errors(host: str, model: str) -> Iterator[None]:
    try:
        yield
    except ResponseError as exc:
        if exc.status_code in _TRANSIENT_STATUS:
            raise OllamaUnavailable(f"ollama at {host} answered {exc.status_code}: {exc.error}") from exc
        if exc.status_code == 404:
            raise OllamaError(f"ollama at {host} has no model {model!r} (ollama pull {model}): {exc.error}") from exc
        raise OllamaError(f"ollama at {host} failed ({exc.status_code}): {exc.error}") from exc
    except httpx.TimeoutException as exc:
        raise TimeoutError(f"ollama at {host} timed out: {exc}") from exc
    except httpx.TransportError as exc:
        raise OllamaUnavailable(f"ollama at {host} unreachable: {exc}") from exc
