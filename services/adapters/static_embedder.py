"""Static sentence embeddings distilled from the int8 MiniLM: a text's vector is the weighted mean of its tokens'.

Model2Vec's recipe (Tulkens & van Dongen, 2024), done with the MiniLM this project already installs: every token of
the vocabulary goes through MiniLM once as ``[CLS] token [SEP]``, the outputs are mean-pooled, reduced to 256
dimensions by PCA and weighted by a Zipf estimate of the token's frequency (rare tokens weigh more, as in SIF). The
``model2vec`` package's own distiller needs PyTorch and a Hugging Face checkpoint, neither of which is installed
here, so the ~20 lines of the recipe live in this module. The table is distilled once (about 16 s on 2 cores) and
kept beside the models as a ``.npy`` named by the ONNX file's hash and the recipe's version.

Why it exists: on 2 CPU cores MiniLM embeds ~140 chat messages a second and bounds memorize at 60-70 messages/s
with no model time at all; a token-table lookup embeds thousands a second. What it costs in retrieval:
``docs/benchmarks.md``, "A static embedder".
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from services.adapters.minilm import MODEL_DISTRIBUTION, TOKENIZER_DISTRIBUTION, MiniLMEmbedder, installed_file
from services.logging import get_logger
from services.ports import BlockingEmbedder

log = get_logger(__name__)

#: bump when the recipe changes, so an old table is never read as a new one
RECIPE = "m2v-pca256-zipf1e-4-v1"
DIM = 256
SIF = 1e-4
# BERT's special tokens: a token's row is read between [CLS] and [SEP]; [UNK] stands for a text of no token
_CLS, _SEP, _UNK = 101, 102, 100


def distill(model: MiniLMEmbedder, vocab_size: int, *, batch: int = 1024) -> np.ndarray[Any, Any]:
    """The token table: one ``DIM``-dimensional row per token id, weighted, not normalised (a text's mean is)."""
    session, _ = model._load()
    raw = np.empty((vocab_size, model.dim), dtype=np.float32)
    for start in range(0, vocab_size, batch):
        ids = np.arange(start, min(start + batch, vocab_size), dtype=np.int64)
        seqs = np.stack([np.full(len(ids), _CLS), ids, np.full(len(ids), _SEP)], axis=1)
        ones = np.ones_like(seqs)
        (hidden,) = session.run(
            ["last_hidden_state"], {"input_ids": seqs, "attention_mask": ones, "token_type_ids": seqs * 0}
        )
        raw[start : start + len(ids)] = hidden.mean(axis=1)
    centred = raw - raw.mean(axis=0)
    _, _, components = np.linalg.svd(centred, full_matrices=False)
    table = centred @ components[:DIM].T
    # Zipf: a token's frequency falls with its rank, and BERT's vocabulary is ordered roughly by frequency
    rank = np.arange(1, vocab_size + 1, dtype=np.float64)
    proba = (1.0 / rank) / (1.0 / rank).sum()
    return (table * (SIF / (SIF + proba))[:, None]).astype(np.float32)


class StaticEmbedder(BlockingEmbedder):
    """256-dimensional, L2-normalised; the table is distilled or read on first use, off the event loop."""

    dim = DIM
    name = "all-minilm-l6-v2-static256"

    def __init__(self, cache_dir: Path, *, tokenizer_path: Path | None = None, model_path: Path | None = None) -> None:
        self.cache_dir = cache_dir
        self._tokenizer_path = tokenizer_path
        self._model_path = model_path
        self._table: np.ndarray[Any, Any] | None = None
        self._tokenizer: Tokenizer | None = None
        self._lock = threading.Lock()
        self.distilled = False  # whether this instance distilled its table (rather than read a kept one)

    def embed_sync(self, texts: Sequence[str]) -> list[list[float]]:
        if not texts:
            return []
        table, tokenizer = self._load()
        out = np.empty((len(texts), DIM), dtype=np.float32)
        for row, encoding in zip(out, tokenizer.encode_batch(list(texts), add_special_tokens=False), strict=True):
            ids = encoding.ids or [_UNK]  # a text of no known token still gets a unit vector
            row[:] = table[ids].mean(axis=0)
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return (out / np.clip(norms, 1e-12, None)).tolist()

    def table_path(self, model_path: Path) -> Path:
        digest = hashlib.sha256(model_path.read_bytes()).hexdigest()[:16]
        return self.cache_dir / f"{self.name}-{RECIPE}-{digest}.npy"

    def _load(self) -> tuple[np.ndarray[Any, Any], Tokenizer]:
        with self._lock:
            if self._table is None or self._tokenizer is None:
                tokenizer = Tokenizer.from_file(
                    str(self._tokenizer_path or installed_file(TOKENIZER_DISTRIBUTION, "tokenizer.json"))
                )
                tokenizer.no_padding()
                tokenizer.no_truncation()
                model_path = self._model_path or installed_file(MODEL_DISTRIBUTION, "model.onnx")
                path = self.table_path(model_path)
                table = self._read(path, tokenizer.get_vocab_size())
                if table is None:
                    table = distill(MiniLMEmbedder(model_path=model_path), tokenizer.get_vocab_size())
                    self._write(path, table)
                    self.distilled = True
                self._table, self._tokenizer = table, tokenizer
            return self._table, self._tokenizer

    @staticmethod
    def _read(path: Path, vocab_size: int) -> np.ndarray[Any, Any] | None:
        """The kept table, or None (absent, or not the shape this vocabulary needs: distilled again)."""
        if not path.exists():
            return None
        try:
            table = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            log.warning("static_embedder_table_unreadable", path=str(path), error=str(exc))
            return None
        if table.shape != (vocab_size, DIM) or table.dtype != np.float32:
            log.warning("static_embedder_table_unreadable", path=str(path), shape=list(table.shape))
            return None
        log.info("static_embedder_loaded", path=str(path))
        return table

    @staticmethod
    def _write(path: Path, table: np.ndarray[Any, Any]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.partial")
        with partial.open("wb") as handle:
            np.save(handle, table, allow_pickle=False)
        os.replace(partial, path)  # whole or absent, even with two workers distilling at once
        log.info("static_embedder_distilled", path=str(path))
