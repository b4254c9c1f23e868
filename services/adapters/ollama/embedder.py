"""The ``Embedder`` port on an Ollama server's /api/embed."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
from ollama import AsyncClient, EmbedResponse

from services.adapters.ollama.errors import OllamaError, translate_errors
from services.backends import RetryPolicy, refused, timed_out
from services.ports import Embedder


class OllamaEmbedder(Embedder):
    def __init__(
        self,
        model: str = "all-minilm",
        *,
        dim: int = 384,
        host: str = "http://127.0.0.1:11434",
        timeout_s: float = 60.0,
        batch_size: int = 64,
        outage_s: float = 600.0,
    ) -> None:
        self.name = model
        self.dim = dim
        self.host = host
        self.batch_size = max(1, batch_size)
        self.client = AsyncClient(host=host, timeout=timeout_s)
        self.policy = RetryPolicy("embedder", refused, timed_out, attempts=3, outage_s=outage_s)

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        vectors: list[list[float]] = []
        for start in range(0, len(texts), self.batch_size):
            batch = list(texts[start : start + self.batch_size])
            response = await self.policy.run("embed", functools.partial(self._embed, batch))
            matrix = np.asarray(response.embeddings, dtype=np.float32)
            if matrix.shape != (len(batch), self.dim):
                raise OllamaError(f"{self.name} returned shape {matrix.shape}, expected ({len(batch)}, {self.dim})")
            # Ollama does not promise unit vectors for every model; the port does.
            norms = np.linalg.norm(matrix, axis=1, keepdims=True)
            vectors.extend((matrix / np.clip(norms, 1e-12, None)).tolist())
        return vectors

    async def _embed(self, batch: list[str]) -> EmbedResponse:
        with translate_errors(self.host, self.name):
            return await self.client.embed(model=self.name, input=batch, truncate=True)

    async def close(self) -> None:
        await self.client.close()
